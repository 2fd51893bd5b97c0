"""The HTTP front end of one server: its listening socket, its connections, their shutdown.

What every connection shares lives here (the core, the route table, the limits, the Host and Origin rules);
each connection (serving/http/connection.py) reads its requests and answers them through the routes
(serving/http/routes.py).
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import socket

from serving.envelope import Refused
from serving.http.connection import BUFFER_BYTES, Connection
from serving.http.routes import Router, table
from serving.http.wire import Request

log = logging.getLogger("serving.http")
SWEEP_S = 0.25  # how often connection deadlines are looked at


class HttpFrontEnd:
    def __init__(self, server):
        settings = server.settings
        self.server = server
        self.routes = Router(table())
        self.read_timeout = settings.read_timeout
        self.max_body_bytes = settings.max_body_bytes
        self.max_header_bytes = settings.max_header_bytes
        self.buffer_bytes = max(BUFFER_BYTES, settings.max_header_bytes + 16 * 1024)
        self._hosts = settings.host_patterns()
        self._hosts_seen: dict[str, bool] = {}
        self._origins = settings.origins()
        self.connections: set[Connection] = set()
        self.closing = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self._servers: list[asyncio.AbstractServer] = []
        self._sweeper: asyncio.Task | None = None

    def check_origin(self, request: Request) -> None:
        """Cross-site requests: a Host this server does not go by (DNS rebinding), a browser Origin not allowed."""
        host = request.headers.get("host", "")  # absent only without HTTP/1.1 (never from a browser)
        if host and not self._host_ok(host):
            raise Refused(403, f"Host {host!r} is not one this server answers; add it with --allowed-hosts")
        origin = request.headers.get("origin")
        if origin is not None and origin.rstrip("/") not in self._origins:
            raise Refused(403, f"cross-site requests from {origin!r} are refused; allow an origin with "
                               "--allowed-origins")

    def _host_ok(self, host: str) -> bool:
        known = self._hosts_seen.get(host)
        if known is None:
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            known = any(fnmatch.fnmatchcase(name.lower(), pattern) for pattern in self._hosts)
            if len(self._hosts_seen) >= 1024:  # bounded: any client may send any Host
                self._hosts_seen.clear()
            self._hosts_seen[host] = known
        return known

    async def listen(self, host: str, port: int) -> list[tuple]:
        """Start accepting on host:port (OSError when it can't be bound); the addresses bound."""
        self.loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server = await self.loop.create_server(lambda: Connection(self), host, port, family=family,
                                               reuse_address=True, backlog=2048)
        self._servers.append(server)
        if self._sweeper is None:
            self._sweeper = self.loop.create_task(self._sweep(), name="http deadlines")
        return [s.getsockname() for s in server.sockets]

    async def _sweep(self) -> None:
        """Closes the connections past their deadline (serving/http/connection.py), every SWEEP_S at most: a
        deadline is enforced within that much of when it falls."""
        interval = min(SWEEP_S, self.read_timeout / 4)
        while True:
            await asyncio.sleep(interval)
            now = self.loop.time()
            for connection in list(self.connections):
                connection.expire_if_due(now)

    def stop_accepting(self) -> None:
        """No new connections; idle ones and those still receiving a request close now, the others after their
        answer."""
        self.closing = True
        for server in self._servers:
            server.close()
        for connection in list(self.connections):
            connection.shutdown()

    async def drain(self, timeout: float) -> None:
        """Wait (at most `timeout` s) for the connections answering a request to close, then close the rest."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.connections and loop.time() < deadline:
            await asyncio.sleep(0.02)
        for connection in list(self.connections):
            connection.transport.abort()
        if self._sweeper is not None:
            self._sweeper.cancel()
        for server in self._servers:
            await server.wait_closed()
