"""One HTTP/1.1 connection: requests read off the socket, handed to their route, answered in order.

The head (request line and headers) is received into the connection's buffer, counted as it arrives
(--max-header-bytes, 431 beyond) and parsed by llhttp (httptools), a fresh parser per request. The
route is chosen and its checks made (Host and Origin, the token, the model named, the declared
sizes) before any of the body is read: a refusal costs the server no body (one too large to drop
closes the connection). The body is then received straight into the memory the route gives it
(serving/http/bodies.py): for a binary KServe V2 request, each input's bytes go from the kernel into
the array that will be its feed, the one copy there is.

A large body's read (BODY_WAKE_MIN_BYTES or more left) wakes the loop only once the rest of it is
in, up to BODY_WAKE_MAX_BYTES at a time (SO_RCVLOWAT: Linux's epoll then reports the socket readable
only once that many bytes are queued, growing its receive buffer to hold them). Read as it trickled
in, a large body takes many reads, each a loop wake-up, two calls into this class, a NaN check and a
window update sent back to the client; with the mark it takes about 3 (the head's, the body's, and
one that finds nothing). A smaller rest is read as it comes: setting the mark and setting it back
cost two system calls, more than the reads they save. The mark is never more than the client is
sending anyway: a body cut short still ends when the client closes, and one that stalls still meets
its deadline. Only on Linux 5.10 and later (WAKE_ON_BODY; what earlier kernels do with the mark:
docs/benchmarks.md#servinghttpconnectionpy); a container runs on its host's kernel.

Deadlines: a connection has --read-timeout seconds to deliver a whole request, counted from when the
server starts waiting for it (the connection opening, or the first byte after a keep-alive pause);
past that it is closed, with a 408 if a request had begun. Between requests a keep-alive connection
stays at most KEEP_ALIVE_S. A deadline is a number on the connection; the front end sweeps them a
few times a second. On shutdown an idle connection is closed at once, one still receiving a request
too (that request never started), and one whose request is being answered after its answer.
"""

from __future__ import annotations

import asyncio
import logging
import platform
import re
import socket
from urllib.parse import unquote

import httptools

from serving.envelope import Exchange, Refusal, Refused, refusal, source_of
from serving.http import bodies
from serving.http.wire import Request, Response, error_response, too_large

try:
    # a system call (uvloop's socket object: 2 us a call)
    from serving._ingest import (
        wake_at as set_rcvlowat,
    )
except ImportError:
    # not built: through a socket object made around the descriptor and let go (as uvloop's does)
    def set_rcvlowat(fd: int, nbytes: int) -> None:
        sock = socket.socket(fileno=fd)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
        finally:
            sock.detach()


log = logging.getLogger("serving.http")
# an idle keep-alive connection is closed after this long
KEEP_ALIVE_S = 5.0
# the connection's buffer for heads (and what arrives with them)
BUFFER_BYTES = 64 * 1024
# the first read of a request (see get_buffer)
FIRST_READ_BYTES = 4096
# less of a body left than this: read as it comes, as before (a mark costs two calls)
BODY_WAKE_MIN_BYTES = 256 * 1024
# most a body read waits for (the kernel's buffer for the socket grows to twice it)
BODY_WAKE_MAX_BYTES = 1 << 20
IDLE, HEAD, BODY, BUSY, CLOSED = range(5)
_TIMEOUT_408 = error_response(408, "the whole request did not arrive within --read-timeout")


def _kernel_wakes_on_body() -> bool:
    """Whether this kernel's TCP honours SO_RCVLOWAT without hanging (see the module's docstring):
    Linux >= 5.10."""
    found = re.match(r"(\d+)\.(\d+)", platform.release()) if platform.system() == "Linux" else None
    return found is not None and (int(found.group(1)), int(found.group(2))) >= (5, 10)


WAKE_ON_BODY = _kernel_wakes_on_body()


class Connection(asyncio.BufferedProtocol):
    def __init__(self, site, listener):
        # the front end: what every connection shares
        self.site = site
        # the event loop this connection is served on, and its other connections
        self.listener = listener
        self.loop = listener.loop
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        # the unread bytes are buf[start:end]
        self.start = self.end = 0
        # buf[start:scanned] holds no end of head
        self.scanned = 0
        self.state = IDLE
        # loop.time() past which the front end's sweep closes it (see `_arm`)
        self.deadline: float | None = None
        # the deadline is the keep-alive pause's, not a request's
        self.deadline_idle = False
        self.keep_alive = True
        self.paused = False
        # the last get_buffer gave the body's own memory
        self.into_body = False
        # the request being received or answered
        self.parser = None
        self.url = b""
        self.headers: dict[str, str] = {}
        self.head_done = False
        self.message_done = False
        self.body = None
        self.request: Request | None = None
        self.route = None
        self.exchange: Exchange | None = None
        # refused at its head: the body is only being dropped
        self.answered = False

    # ---- asyncio's calls ----

    def connection_made(self, transport) -> None:
        self.transport = transport
        # -1: bodies read as they come
        self.fd = transport.get_extra_info("socket").fileno() if WAKE_ON_BODY else -1
        # the socket's SO_RCVLOWAT (see _wake_at)
        self.wake_bytes = 1
        self.source = source_of(transport.get_extra_info("peername"))
        self.listener.connections.add(self)
        self._arm(self.site.read_timeout)

    def connection_lost(self, exc) -> None:
        self._end_arrival()
        if self.state in (HEAD, BODY) and self.exchange is not None and not self.answered:
            # gone mid-request: its doing, answered to nobody
            self.exchange.finish(self.site.server.metrics, "499")
            log.debug(
                "%s %s: the client disconnected before its request arrived",
                self.request.method if self.request else "",
                self.request.path if self.request else "",
            )
        self.state = CLOSED
        self._disarm()
        self.listener.connections.discard(self)
        self.body = None

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.state == BODY and self.body.direct and self.start == self.end:
            view = self.body.view()
            if len(view):
                self.into_body = True
                return view
        self.into_body = False
        if len(self.buf) - self.end < 4096:
            self._make_room()
        if self.state in (IDLE, HEAD) and self.start == self.end:
            # A new request's first read: its head (and a V2 JSON header) fit in this much, and what
            # the read takes beyond them is body bytes copied out of here again: a small read first,
            # then the body's own memory.
            return memoryview(self.buf)[self.end : self.end + FIRST_READ_BYTES]
        return memoryview(self.buf)[self.end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self.into_body:
            self.into_body = False
            self.body.wrote(nbytes)
            if self.body.done:
                self._body_arrived()
            else:
                # what is left of it (or of its current part), at least
                self._wake_at(len(self.body.view()))
            return
        self.end += nbytes
        self._advance()

    def _wake_at(self, nbytes: int) -> None:
        """The next read is to wait for `nbytes` of the body (never more than the client will send
        unasked: what is left of the body it is sending), or for any byte (1: a head, a small
        rest)."""
        nbytes = 1 if nbytes < BODY_WAKE_MIN_BYTES else min(nbytes, BODY_WAKE_MAX_BYTES)
        if nbytes != self.wake_bytes and self.fd >= 0:
            try:
                set_rcvlowat(self.fd, nbytes)
                self.wake_bytes = nbytes
            except OSError:
                # (a socket without it): reads then take what there is, as before
                self.fd = -1
                # left waiting for more than may come: nothing more is read here
                if self.wake_bytes != 1:
                    self._close()

    def eof_received(self) -> bool:
        # close: a half-closed client sends no more requests
        return False

    # ---- reading requests ----

    def _advance(self) -> None:
        """Make what progress the buffered bytes allow: heads parsed, bodies filled, in order."""
        while self.state != CLOSED:
            if self.state == IDLE:
                if self.start == self.end:
                    return
                self.state = HEAD
                # (a new connection's counts from its opening)
                if self.deadline is None or self.deadline_idle:
                    self._arm(self.site.read_timeout)
            if self.state == HEAD:
                if not self._head():
                    return
            elif self.state == BODY:
                if not self._body_from_buffer():
                    return
            else:
                # BUSY: the next request waits for this one's answer
                if self.end - self.start >= self.site.buffer_bytes // 2 and not self.paused:
                    self.paused = True
                    self.transport.pause_reading()
                return

    def _make_room(self) -> None:
        if self.start:
            n = self.end - self.start
            self.buf[:n] = self.buf[self.start : self.end]
            self.scanned -= self.start
            self.start, self.end = 0, n
        if len(self.buf) - self.end < 4096:
            self.buf.extend(bytes(max(self.site.buffer_bytes - len(self.buf), 4096)))

    def _head(self) -> bool:
        """Parses a whole head from the buffer and starts its request; False while it is
        incomplete."""
        limit = self.site.max_header_bytes
        at = max(self.start, self.scanned - 3)
        # never search a body that follows (a binary one is large)
        stop = min(self.end, self.start + limit + 4)
        crlf = self.buf.find(b"\n\r\n", at, stop)
        # a bare-LF head, before any CRLF end
        lf = self.buf.find(b"\n\n", at, crlf + 2 if crlf >= 0 else stop)
        if crlf < 0 and lf < 0:
            self.scanned = stop
            if self.end - self.start > limit:
                self._refuse_head(
                    431, f"the request head exceeds {limit} bytes (--max-header-bytes)"
                )
            return False
        head_end = lf + 2 if lf >= 0 else crlf + 3
        if head_end - self.start > limit:
            self._refuse_head(431, f"the request head exceeds {limit} bytes (--max-header-bytes)")
            return False
        self.url, self.headers, self.head_done, self.message_done = b"", {}, False, False
        self.parser = httptools.HttpRequestParser(self)
        try:
            self.parser.feed_data(memoryview(self.buf)[self.start : head_end])
        except httptools.HttpParserUpgrade:
            # an Upgrade (h2c, websocket) asked for: this server speaks HTTP/1.1, and answers it as
            # such
            pass
        except httptools.HttpParserError as exc:
            self._refuse_head(400, f"malformed HTTP request: {exc}.")
            return False
        if not self.head_done:
            self._refuse_head(
                400, "malformed HTTP request: the head did not end where a blank line ends it."
            )
            return False
        self.start = self.scanned = head_end
        self._begin()
        return True

    # httptools' callbacks, during feed_data
    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        self.headers[key] = f"{self.headers[key]}, {text}" if key in self.headers else text

    def on_headers_complete(self) -> None:
        self.head_done = True

    def on_body(self, data: bytes) -> None:
        if isinstance(self.body, bodies.Chunked):
            self.body.piece(data)

    def on_message_complete(self) -> None:
        self.message_done = True
        if isinstance(self.body, bodies.Chunked):
            self.body.done = True

    def _begin(self) -> None:
        """A head has arrived: route it, make its checks, and get its body's memory from the
        route."""
        parser, site = self.parser, self.site
        method = parser.get_method().decode("latin-1")
        self.keep_alive = parser.should_keep_alive() and not site.closing
        try:
            url = httptools.parse_url(self.url)
            path, query = unquote(url.path.decode("latin-1")), (url.query or b"").decode("latin-1")
        except (httptools.HttpParserInvalidURLError, UnicodeDecodeError, ValueError):
            path, query = self.url.decode("latin-1"), ""
        headers = self.headers
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        try:
            length = 0 if chunked else int(headers.get("content-length", "0"))
        except ValueError:
            self._refuse_head(400, "malformed HTTP request: Content-Length is not one byte count.")
            return
        self.request = request = Request(method, path, query, headers)
        route, params, allowed = site.routes.match(method, path)
        self.route = route
        self.exchange = exchange = Exchange(
            route.path if route is not None else "unmatched", self.source
        )
        self.answered = False
        try:
            if route is None:
                raise unrouted(method, path, allowed)
            request.params = params
            body = site.admit(route, request, exchange, length, chunked)
        except Exception as exc:  # noqa: BLE001
            # refused on its head: answered now, its body dropped unread
            self._refuse(exc, chunked, length)
            return
        # a route that takes no body: whatever came is dropped
        if body is None:
            body = bodies.Discard(length) if not chunked else bodies.Chunked(0)
        self.body = body
        if not (chunked or length) or (not chunked and body.done):
            self._body_arrived()
            return
        self.state = BODY
        if headers.get("expect", "").lower() == "100-continue":
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _body_from_buffer(self) -> bool:
        """Buffered bytes into the body; True once the body is whole."""
        if self.start == self.end:
            return False
        data = memoryview(self.buf)[self.start : self.end]
        if isinstance(self.body, bodies.Chunked):
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError as exc:
                self._refuse_head(400, f"malformed chunked body: {exc}.")
                return False
            # (what follows a chunked body is not read: the connection closes after it)
            self.start = self.end
            if self.body.size > self.site.max_body_bytes and not self.answered:
                self._refuse(
                    Refused(
                        413,
                        too_large(
                            self.headers,
                            f"more than {self.site.max_body_bytes} bytes",
                            self.site.max_body_bytes,
                        ),
                    ),
                    True,
                    0,
                )
                return False
            if self.body.done:
                self.keep_alive = False
        else:
            self.start += self.body.take(data)
        if self.start == self.end:
            self.start = self.end = self.scanned = 0
        if not self.body.done:
            return False
        self._body_arrived()
        return True

    def _body_arrived(self) -> None:
        self._disarm()
        # the next head may be a few bytes
        self._wake_at(1)
        if self.state == CLOSED:
            return
        # a refusal's dropped body: on to the next request
        if self.answered:
            self._next_request()
            return
        self.state = BUSY
        body, self.body = self.body, None
        error = body.error
        self.request.body = body.result() if error is None else None
        self.loop.create_task(self._answer(self.route, self.request, self.exchange, error))

    # ---- answering ----

    async def _answer(
        self, route, request: Request, exchange: Exchange, error: Exception | None
    ) -> None:
        site = self.site
        if error is not None:
            found = refusal(error, f"{request.method} {request.path}", log)
            response = error_response(found.status, found.message, found.headers)
        else:
            response = await site.respond(route, request, exchange, self.loop)
        if request.arrival is not None:
            # (queued: ended already; refused before: ended here)
            request.arrival.end()
        exchange.finish(site.server.metrics, str(response.status))
        if self.state == CLOSED:
            return
        self._write(response, exchange.receipt)
        if self.keep_alive and not site.closing:
            self._next_request()
        else:
            self._close()

    def _write(self, response: Response, receipt: dict[str, str] | None = None) -> None:
        head = response.head(self.keep_alive, receipt)
        if self.request is not None and self.request.method == "HEAD" or not response.body:
            self.transport.write(head)
        elif len(response.body) < 65536:
            self.transport.write(head + response.body)
        else:
            self.transport.writelines((head, response.body))

    def _next_request(self) -> None:
        self.state = IDLE
        self.request = self.route = self.exchange = self.parser = None
        self.answered = False
        self._arm(min(KEEP_ALIVE_S, self.site.read_timeout), idle=True)
        if self.paused:
            self.paused = False
            self.transport.resume_reading()
        self._advance()

    def _refuse(self, exc: Exception, chunked: bool, length: int) -> None:
        """A request refused on its head: answered now; its body (if any) dropped as it arrives, or
        the connection closed when the body is chunked or too large to drop."""
        request = self.request
        # no such route: no warning each (scanners probe)
        if self.route is None and isinstance(exc, Refused):
            found = Refusal(exc.status, str(exc), exc.headers)
        else:
            found = refusal(exc, f"{request.method} {request.path}", log)
        response = error_response(found.status, found.message, found.headers)
        self.exchange.finish(self.site.server.metrics, str(found.status))
        self.answered = True
        if chunked or length > self.site.max_body_bytes:
            self.keep_alive = False
        self._write(response, self.exchange.receipt)
        if not self.keep_alive:
            self._close()
            return
        self.body = bodies.Discard(length)
        if self.body.done:
            self._next_request()
        else:
            self.state = BODY

    def _refuse_head(self, status: int, message: str) -> None:
        """A head that is not HTTP, or too large: answered and closed (its framing can't be
        trusted)."""
        if self.state == CLOSED:
            return
        self.keep_alive = False
        if status == 400:
            message += " Send a well-formed HTTP/1.1 request."
        log.debug("refused a request head (%d): %s", status, message)
        self.site.server.metrics.observe_request("unmatched", str(status), 0.0)
        self._write(error_response(status, message))
        self._close()

    # ---- deadlines and closing ----

    def _arm(self, seconds: float, idle: bool = False) -> None:
        """A deadline `seconds` from now, which the front end's sweep enforces (`expire_if_due`): a
        float per connection, not a timer handle made and cancelled twice per request."""
        self.deadline = self.loop.time() + seconds
        self.deadline_idle = idle

    def _disarm(self) -> None:
        self.deadline = None

    def expire_if_due(self, now: float) -> None:
        if self.deadline is not None and now >= self.deadline:
            self._expired()

    def _expired(self) -> None:
        self.deadline = None
        if self.state == CLOSED or self.transport.is_closing():
            return
        if self.state in (HEAD, BODY) and not self.answered:
            self.keep_alive = False
            if self.exchange is not None:
                self.exchange.finish(self.site.server.metrics, "408")
                self.answered = True
            self._write(_TIMEOUT_408)
        elif self.state == BUSY:
            # being answered: the request's own deadline (--request-timeout) holds it
            return
        self._close()

    def shutdown(self) -> None:
        """The server is stopping: close now unless a request is being answered (then after its
        answer)."""
        if self.state == BUSY:
            self.keep_alive = False
            return
        self._close()

    def _end_arrival(self) -> None:
        """The request being received goes no further (its connection closes): no batch waits for
        it."""
        if (
            self.request is not None
            and self.request.arrival is not None
            and self.state in (HEAD, BODY)
        ):
            self.request.arrival.end()

    def _close(self) -> None:
        self._end_arrival()
        if self.state != CLOSED:
            self.state = CLOSED
            self._disarm()
            self.transport.close()


def unrouted(method: str, path: str, allowed: bool) -> Refused:
    status = 405 if allowed else 404
    detail = "Method Not Allowed" if allowed else "Not Found"
    return Refused(
        status,
        f"{method} {path[:200]}: {detail}; see /v2 (KServe V2), /invocations (MLflow), /metrics",
    )
