"""The HTTP front end of one server: its listeners (one event loop each), their connections, their
shutdown.

Ingest scales past one core for large bodies: --http-threads event loops (the server's own and that
many more in threads; by default one per usable CPU when the models' input rows are 512 KiB or more,
else one: see Settings.http_loops), each accepting on its own socket bound to the same port
(SO_REUSEPORT: the kernel spreads connections over them). A loop's thread spends most of a large
request in the kernel, receiving its body, and holds no GIL there: the loops take those in side by
side (the rest of a request they take turns at, on the one GIL, which is why small requests get one
loop), and each hands its requests to the same batchers (serving/batcher.py), whose answers come
back to the loop that asked. The routes that change what is loaded (the repository API) run on the
server's own loop, where its model locks live.

What every connection shares lives here (the core, the route table, the limits, the Host and Origin
rules); each connection (serving/http/connection.py) reads its requests and answers them through the
routes (serving/http/routes.py).
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import socket
import threading

from serving.envelope import Exchange, Refused, refusal
from serving.http.connection import BUFFER_BYTES, Connection, unrouted
from serving.http.routes import Router, table
from serving.http.wire import Request, Response, error_response, too_large

log = logging.getLogger("serving.http")
# how often connection deadlines are looked at
SWEEP_S = 0.25


class Listener:
    """One event loop's socket and the connections it accepted."""

    def __init__(
        self,
        site: "HttpFrontEnd",
        loop: asyncio.AbstractEventLoop,
        thread: threading.Thread | None = None,
    ):
        self.site, self.loop, self.thread = site, loop, thread
        self.connections: set[Connection] = set()
        self.server: asyncio.AbstractServer | None = None
        self.sweeper: asyncio.Task | None = None

    async def start(self, host: str, port: int, reuse_port: bool) -> list[tuple]:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.server = await self.loop.create_server(
            lambda: Connection(self.site, self),
            host,
            port,
            family=family,
            reuse_address=True,
            reuse_port=reuse_port or None,
            backlog=2048,
        )
        self.sweeper = self.loop.create_task(self._sweep(), name="http deadlines")
        return [s.getsockname() for s in self.server.sockets]

    async def _sweep(self) -> None:
        """Closes the connections past their deadline (serving/http/connection.py), every SWEEP_S at
        most: a deadline is enforced within that much of when it falls."""
        interval = min(SWEEP_S, self.site.read_timeout / 4)
        while True:
            await asyncio.sleep(interval)
            now = self.loop.time()
            for connection in list(self.connections):
                connection.expire_if_due(now)

    def stop_accepting(self) -> None:
        self.server.close()
        for connection in list(self.connections):
            connection.shutdown()

    def abort(self) -> None:
        for connection in list(self.connections):
            connection.transport.abort()
        if self.sweeper is not None:
            self.sweeper.cancel()

    def call(self, fn) -> None:
        """`fn()` on this listener's loop."""
        if self.thread is None:
            fn()
        else:
            self.loop.call_soon_threadsafe(fn)


class HttpFrontEnd:
    """`routes`: the route table (default: routes.table(); a front-end process's answers some routes
    itself and hands the engine the rest, serving/front_end_process.py)."""

    def __init__(self, server, routes=None):
        settings = server.settings
        self.server = server
        self.routes = Router(table() if routes is None else routes)
        self.read_timeout = settings.read_timeout
        self.max_body_bytes = settings.max_body_bytes
        self.max_header_bytes = settings.max_header_bytes
        self.buffer_bytes = max(BUFFER_BYTES, settings.max_header_bytes + 16 * 1024)
        self._hosts = settings.host_patterns()
        self._hosts_seen: dict[str, bool] = {}
        self._origins = settings.origins()
        self.closing = False
        # the server's own
        self.loop: asyncio.AbstractEventLoop | None = None
        self.listeners: list[Listener] = []

    def check_origin(self, request: Request) -> None:
        """Cross-site requests: a Host this server does not go by (DNS rebinding), a browser Origin
        not allowed."""
        # absent only without HTTP/1.1 (never from a browser)
        host = request.headers.get("host", "")
        if host and not self._host_ok(host):
            raise Refused(
                403, f"Host {host!r} is not one this server answers; add it with --allowed-hosts"
            )
        origin = request.headers.get("origin")
        if origin is not None and origin.rstrip("/") not in self._origins:
            raise Refused(
                403,
                f"cross-site requests from {origin!r} are refused; allow an origin with "
                "--allowed-origins",
            )

    def _host_ok(self, host: str) -> bool:
        known = self._hosts_seen.get(host)
        if known is None:
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            known = any(fnmatch.fnmatchcase(name.lower(), pattern) for pattern in self._hosts)
            # bounded: any client may send any Host
            if len(self._hosts_seen) >= 1024:
                self._hosts_seen.clear()
            self._hosts_seen[host] = known
        return known

    def admit(self, route, request: Request, exchange, length: int, chunked: bool):
        """A request's head checked as it arrived (its route, Host and Origin, token, size) and its
        body's memory from its route (None: it takes none); raises what refuses it."""
        if route is None:
            raise unrouted(request.method, request.path, False)
        if not route.open:
            self.check_origin(request)
            auth = self.server.auth
            check = auth.check_labels if route.labels else auth.check
            check(request.headers.get("authorization", ""))
        if length > self.max_body_bytes:
            raise Refused(413, too_large(request.headers, f"{length} bytes", self.max_body_bytes))
        return route.body(self.server, request, exchange, length, chunked) if route.body else None

    async def respond(self, route, request: Request, exchange, loop) -> Response:
        """A whole request's response from its route's handler (on the server's own loop for the
        routes that change what is loaded), or its refusal as one: the envelope."""
        try:
            if route.main and loop is not self.loop and self.loop is not None:
                # (the repository API: where the server's model locks are)
                return await asyncio.wrap_future(
                    asyncio.run_coroutine_threadsafe(
                        route.handler(self.server, request, exchange), self.loop
                    )
                )
            return await route.handler(self.server, request, exchange)
        except Exception as exc:  # noqa: BLE001
            # the envelope: every failure becomes its status
            found = refusal(exc, f"{request.method} {request.path}", log)
            return error_response(found.status, found.message, found.headers)

    async def answer_whole(
        self, method: str, path: str, query: str, headers: dict, body: bytes, source: str
    ) -> tuple[Response, Exchange]:
        """A request that arrived whole elsewhere (a front-end process hands the engine what it
        does not answer itself: serving/front_ends.py), answered as a connection answers one, with
        its receipt on the exchange. Its line in the metrics is the front end's."""
        request = Request(method, path, query, headers)
        route, params, allowed = self.routes.match(method, path)
        exchange = Exchange(route.path if route is not None else "unmatched", source)
        request.params = params
        try:
            if route is None:
                raise unrouted(method, path, allowed)
            taken = self.admit(route, request, exchange, len(body), False)
        except Exception as exc:  # noqa: BLE001
            # refused on its head, as a connection refuses it
            found = refusal(exc, f"{method} {path}", log)
            return error_response(found.status, found.message, found.headers), exchange
        if taken is not None:
            taken.take(memoryview(body))
            if taken.error is not None:
                found = refusal(taken.error, f"{method} {path}", log)
                response = error_response(found.status, found.message, found.headers)
                if request.arrival is not None:
                    request.arrival.end()
                return response, exchange
            request.body = taken.result()
        response = await self.respond(route, request, exchange, asyncio.get_running_loop())
        if request.arrival is not None:
            request.arrival.end()
        return response, exchange

    @property
    def connections(self) -> int:
        return sum(len(listener.connections) for listener in self.listeners)

    async def listen(
        self, host: str, port: int, loops: int = 1, reuse_port: bool = False
    ) -> list[tuple]:
        """Accept on host:port on `loops` event loops: this one and loops-1 more in threads
        (OSError when the port can't be bound); the addresses bound. `reuse_port`: other processes
        listen on it too (front ends)."""
        self.loop = asyncio.get_running_loop()
        main = Listener(self, self.loop)
        bound = await main.start(host, port, reuse_port=reuse_port or loops > 1)
        self.listeners.append(main)
        # (a port 0 asked for: the others bind the one this got)
        port = bound[0][1]
        for n in range(1, loops):
            loop = new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name=f"http_{n}", daemon=True)
            thread.start()
            listener = Listener(self, loop, thread)
            try:
                await asyncio.wrap_future(
                    asyncio.run_coroutine_threadsafe(listener.start(host, port, True), loop)
                )
            except BaseException:
                loop.call_soon_threadsafe(loop.stop)
                raise
            self.listeners.append(listener)
        return bound

    def stop_accepting(self) -> None:
        """No new connections; idle ones and those still receiving a request close now, the others
        after their answer."""
        self.closing = True
        for listener in self.listeners:
            listener.call(listener.stop_accepting)

    async def drain(self, timeout: float) -> None:
        """Wait (at most `timeout` s) for the connections answering a request to close, then close
        the rest and stop the other loops."""
        deadline = self.loop.time() + timeout
        while self.connections and self.loop.time() < deadline:
            await asyncio.sleep(0.02)
        for listener in self.listeners:
            listener.call(listener.abort)
        for listener in self.listeners[1:]:
            listener.loop.call_soon_threadsafe(listener.loop.stop)
            await asyncio.to_thread(listener.thread.join, 5)
            if not listener.thread.is_alive():
                listener.loop.close()
        await self.listeners[0].server.wait_closed()


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
