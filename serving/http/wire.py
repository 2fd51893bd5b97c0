"""HTTP/1.1 requests and responses as the routes see them, and a response's bytes on the wire."""

from __future__ import annotations

from dataclasses import dataclass, field
from http import HTTPStatus

import orjson

JSON = "application/json"
_REASONS = {s.value: s.phrase for s in HTTPStatus} | {499: "Client Closed Request"}


@dataclass(slots=True)
class Request:
    """One request: its head as parsed, the route's parameters, and its body once arrived (bytes, or
    what the route's body sink made of it)."""

    method: str
    # percent-decoded
    path: str
    query: str
    # lower-case names; a repeated header's values joined with ", "
    headers: dict[str, str]
    params: dict[str, str] = field(default_factory=dict)
    body: object = b""
    # The batcher's note that this request's body is on its way (Batcher.arriving).
    arrival: object = None

    def header(self, name: str, default: str = "") -> str:
        return self.headers.get(name, default)


@dataclass(slots=True)
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str | None = JSON
    headers: dict[str, str] | None = None

    def head(self, keep_alive: bool, extra: dict[str, str] | None = None) -> bytes:
        """The status line and headers; `extra` (the receipt) after the response's own."""
        lines = [f"HTTP/1.1 {self.status} {_REASONS.get(self.status, 'Unknown')}"]
        if self.content_type:
            lines.append(f"content-type: {self.content_type}")
        lines.append(f"content-length: {len(self.body)}")
        for headers in (self.headers, extra):
            if headers:
                lines.extend(f"{k}: {v}" for k, v in headers.items())
        if not keep_alive:
            lines.append("connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def json_response(obj, status: int = 200) -> Response:
    return Response(status, orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY))


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(status, orjson.dumps({"error": message}), JSON, headers)


def too_large(headers, size: str, limit: int, how: str = "") -> str:
    """The 413 of a body past --max-body-bytes, in Triton's words too ('request JSON size of ...
    exceeds the maximum allowed input size of ...'), which its clients look for."""
    kind = "JSON" if "json" in headers.get("content-type", "").lower() else "body"
    return (
        f"request {kind} size of {size}{how} exceeds the maximum allowed input size of {limit} "
        "bytes: send less, or start the server with a larger --max-body-bytes"
    )
