"""uvicorn's HTTP protocol (httptools) with a read deadline, which uvicorn has none of.

uvicorn closes a keep-alive connection idle between requests after `timeout_keep_alive`, but not one
that never sends a request, nor one that sends half a header or half a body: any client could hold
connections open forever, and with a concurrency limit every endpoint, liveness included, answered
503 while it did (the review held 80 idle sockets). Here a connection has `read_timeout` seconds to
deliver a whole request, counted from when the server starts waiting for it (the connection opening,
or the first byte after a keep-alive pause); past that it is closed, with a 408 if a request had
begun. On shutdown a connection still receiving a request body is closed at once: that request was
never started, and waiting for it held SIGTERM up for the whole graceful timeout.
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_BODY_408 = b'{"error": "the whole request did not arrive within --read-timeout"}'
REQUEST_TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                       b"content-length: " + str(len(_BODY_408)).encode() + b"\r\nconnection: close\r\n\r\n" + _BODY_408)


def with_read_deadline(read_timeout: float) -> type[HttpToolsProtocol]:
    """The protocol class for uvicorn.Config(http=...), with this deadline."""

    class DeadlineProtocol(HttpToolsProtocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._deadline: asyncio.TimerHandle | None = None
            self._receiving = False  # between a request's first byte and its last
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._deadline is None:  # the first bytes after a keep-alive pause
                self._arm()
            super().data_received(data)

        def on_message_begin(self) -> None:
            self._receiving = True
            super().on_message_begin()

        def on_message_complete(self) -> None:
            self._receiving = False
            self._disarm()
            super().on_message_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to bytes that are not HTTP (a control character in a header...), in the
            same {"error": ...} form as every other refusal."""
            body = json.dumps({"error": f"{msg} Send a well-formed HTTP/1.1 request."}).encode()
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: "
                                 + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
            self.transport.close()

        def shutdown(self) -> None:
            if self._receiving:  # a body still arriving: the request never started, nothing to finish
                self.transport.close()
                return
            super().shutdown()

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(read_timeout, self._expired)

        def _disarm(self) -> None:
            if getattr(self, "_deadline", None) is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            if self._receiving:
                self.transport.write(REQUEST_TIMEOUT_408)
            self.transport.close()

    return DeadlineProtocol
