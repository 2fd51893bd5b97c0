"""The envelope around every request, written once for every front end (HTTP, gRPC unary, each
message of a gRPC stream): what became of it (a refusal -> a status and a message), the receipt
naming the model version that answered, and the request's line in the metrics.

    Auth          who may call what: the clients' tokens (--auth-token), the labels' own
                  (--feedback-token)
    Exchange      one request as the envelope follows it: its route, when it began, the version
                  that answered and the receipt naming it: X-Request-Id (the client's id echoed,
                  else a fresh one), X-Server-Request-Id (the server's own id of an answer,
                  random, never the client's: labels for the answer are posted under it), X-Model-*
    Refused       a refusal with an HTTP status, raised anywhere on the request's path (gRPC maps
                  the status)
    refusal(exc)  any exception as (status, message, headers): a client's mistake is its 4xx, logged
                  once as a warning; a client gone is 499; anything else is ours, a 500 logged with
                  its traceback

A front end decides only how to carry these: HTTP puts the receipt in headers and the refusal in an
{"error": ...} body, gRPC puts them in initial metadata and a status.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from typing import NamedTuple

from serving.codec import BadRequest


def source_of(peer) -> str:
    """The client's host from what a front end knows of its connection: a socket's peername ((host,
    port, ...)) or grpc's peer ("ipv4:127.0.0.1:50123", "ipv6:[::1]:50123"); "" when unknown."""
    if isinstance(peer, (tuple, list)):
        return str(peer[0]) if peer else ""
    if not isinstance(peer, str):
        return ""
    family, _, address = peer.partition(":")
    if family not in ("ipv4", "ipv6"):
        # a unix socket's path, or grpc's name for something else: the whole name
        return peer
    host = address.rpartition(":")[0]
    return host.strip("[]").replace("%5B", "").replace("%5D", "")


# ids not yet handed out, read from os.urandom IDS_AT_ONCE at a time
IDS_AT_ONCE = 256
_ids = iter(())


def new_request_id() -> str:
    """A fresh request id: 32 hex digits of the system's randomness (os.urandom), as a uuid4's hex
    is. No one can tell the next from those seen (a prefix and a counter let a client predict other
    clients' ids: the shadow's answers are kept under the server's ids, serving/shadow.py), and ids
    are unique across processes.

    Read IDS_AT_ONCE ids' worth at a time: os.urandom lets go of the GIL, and the engine thread,
    waiting for it, took it at each call (docs/benchmarks.md#servingenvelopepy). Taking the next id
    of the list is atomic under the GIL; two threads refilling at once only read more. A forked
    child starts without the parent's (os.register_at_fork), whose ids it would hand out again."""
    global _ids
    try:
        return next(_ids)
    except StopIteration:
        block = os.urandom(16 * IDS_AT_ONCE).hex()
        _ids = iter([block[i : i + 32] for i in range(0, len(block), 32)])
        return next(_ids)


def _forget_ids() -> None:
    global _ids
    _ids = iter(())


os.register_at_fork(after_in_child=_forget_ids)


class Refused(Exception):
    """A request refused, with the HTTP status that says why (4xx the client's, 5xx ours); gRPC maps
    it."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers


class Auth:
    """Who may call what. Inference and everything else but the health checks: one of the clients'
    tokens (--auth-token), when any is set. Labels (feedback): their own token (--feedback-token),
    never an inference token, so that whoever may ask for answers does not thereby decide which
    version becomes champion. Every comparison takes constant time.
    """

    def __init__(self, tokens: list[bytes], feedback: str | None = None):
        self.tokens = tokens
        self.feedback = None if feedback is None else feedback.strip().encode()

    @property
    def required(self) -> bool:
        """Whether a token is needed at all (none: a loopback server, open to all who reach it)."""
        return bool(self.tokens)

    def check(self, authorization: str) -> None:
        """An `Authorization` value (HTTP header or gRPC metadata) against the clients' tokens."""
        if not self.tokens:
            return
        scheme, _, token = authorization.partition(" ")
        given = token.strip().encode()
        # Every token compared: which one matched, or none, takes no less time to find.
        matched = [hmac.compare_digest(given, known) for known in self.tokens]
        if scheme.lower() != "bearer" or not any(matched):
            raise Refused(
                401,
                "missing or wrong bearer token: send 'Authorization: Bearer <token>'",
                {"WWW-Authenticate": "Bearer"},
            )

    def check_labels(self, authorization: str) -> None:
        """An `Authorization` value against the feedback token."""
        if self.feedback is None:
            if self.tokens:
                raise Refused(
                    403,
                    "this server takes no labels: start it with --feedback-token (env "
                    "TRAINSERVE_FEEDBACK_TOKEN), a token of their own, and send that one",
                )
            # No auth at all: labels as open as the rest.
            return
        scheme, _, token = authorization.partition(" ")
        given = token.strip().encode()
        if scheme.lower() == "bearer" and hmac.compare_digest(given, self.feedback):
            return
        if any(hmac.compare_digest(given, known) for known in self.tokens):
            raise Refused(
                403, "labels need the feedback token (--feedback-token), not the inference token"
            )
        raise Refused(
            401,
            "missing or wrong bearer token: labels need "
            "'Authorization: Bearer <the feedback token>'",
            {"WWW-Authenticate": "Bearer"},
        )


class ClientGone(Exception):
    """The client went away before its request had arrived: its own doing, answered to nobody
    (499)."""


class Refusal(NamedTuple):
    status: int
    message: str
    headers: dict[str, str] | None = None


class Exchange:
    """One request through any front end: its route (as metrics name it), when it began, and once
    the version is known, the model that answered and the receipt naming it and the request
    (X-Request-Id, X-Model-*).

    Each part of the receipt is written once:
    - `slot`: by the front end when it picks the version (a refusal names it from then on);
      rewritten by Server.answer only when a reload swap had another version answer;
    - `request_id`: by the front end when it knows one before decoding (HTTP's X-Request-Id, a gRPC
      message's id or metadata; checked), else by Server.answer (the V2 body's id, or a fresh one);
    - `server_id`: by Server.answer.
    """

    __slots__ = ("route", "started", "slot", "request_id", "server_id", "source", "warning")

    def __init__(self, route: str, source: str = ""):
        self.route = route
        # The client's address (its host, not its port): the shadow counts pairs by it.
        self.source = source
        self.started = time.perf_counter()
        self.slot = None
        self.request_id: str | None = None
        self.server_id: str | None = None
        # a Warning header's value for an answer given despite something off
        # (serving/input_range.py)
        self.warning: str | None = None

    @property
    def model(self) -> tuple[str, str]:
        return ("", "") if self.slot is None else (self.slot.model.info.name, self.slot.version)

    @property
    def receipt(self) -> dict[str, str]:
        """X-Request-Id, X-Server-Request-Id and the X-Model-* headers of the version that answered
        ({} before one was chosen)."""
        if self.slot is None:
            return {}
        if self.request_id is None and self.server_id is None:
            return self.slot.headers
        receipt = {**self.slot.headers}
        if self.request_id is not None:
            receipt["X-Request-Id"] = self.request_id
        if self.server_id is not None:
            receipt["X-Server-Request-Id"] = self.server_id
        if self.warning is not None:
            receipt["Warning"] = self.warning
        return receipt

    def finish(self, metrics, status: str) -> None:
        metrics.observe_request(self.route, status, time.perf_counter() - self.started, *self.model)


def refusal(exc: BaseException, where: str, log: logging.Logger, label=str) -> Refusal:
    """What `exc` tells the client. Client mistakes are logged once, in our words
    (`where -> label(status): why`); a 5xx refusal (503, 504) is the server's load, counted in the
    metrics, not logged per request."""
    # RepositoryError is a BadRequest
    if isinstance(exc, (Refused, BadRequest)):
        status, message = exc.status, str(exc)
        if 400 <= status < 500:
            log.warning("%s -> %s: %s", where, label(status), message)
        return Refusal(status, message, getattr(exc, "headers", None))
    if isinstance(exc, ClientGone):
        log.debug("%s: the client disconnected before its request arrived", where)
        return Refusal(499, "client closed the request")
    log.error("%s failed", where, exc_info=exc)
    return Refusal(500, f"internal error: {type(exc).__name__}: {exc}")
