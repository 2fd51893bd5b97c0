"""The engine's front-end processes as processes: started, watched, replaced, stopped. What they say
is serving/channel.py's; what the engine does with it is serving/front_ends.py's.

Each front end is `python -m serving.front_end_process` with two Unix sockets of its own: the
channel (records both ways) and a side socket the engine sends descriptors over (the arenas'
memfds: a record can't carry them over the channel's asyncio transport). It is started from the
event loop's own thread: PR_SET_PDEATHSIG, which kills a front end when its engine dies, watches
the thread that started it, and the loop's thread lives as long as the engine does.

A front end is numbered 1..N (the number its arrivals are counted under in every arena) when it is
set up (SETUP). One more process is kept started and not set up, its imports done: the spare. A
front end that dies is replaced by the spare at once (SETUP with the dead one's number: it maps the
arenas and listens in tens of milliseconds, where a new interpreter takes a second or more to
import what it runs), and a new spare is started behind it.

Rules:
- a front end that dies (its channel closes: the kernel closes it whatever killed the process) is
  reaped and, unless the server is stopping, replaced under the same number: its requests' places
  are let go first (`on_gone`), so the number's arrivals start again from zero;
- no front end outlives its engine: each asks the kernel to SIGKILL it when the engine dies, and
  exits on its own when the channel closes (serving/front_end_process.py);
- `stop(grace)` asks each to drain (DRAIN: stop accepting, answer what is in flight, exit), waits
  up to `grace` seconds for them, then kills what is left; the spare exits at DRAIN.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable

from serving import arena, channel

log = logging.getLogger("serving.front_ends")
# a new front end has this long to say it listens (its imports, on a loaded machine, take seconds)
START_S = 60.0


class Process:
    """One front-end process: its number (`owner`, 1..; 0 while it is the spare), its Popen,
    channel and side socket."""

    def __init__(self):
        self.owner = 0
        self.popen: subprocess.Popen | None = None
        self.channel: channel.Channel | None = None
        self.side: socket.socket | None = None
        self.listening: asyncio.Future | None = None
        self.started = 0.0
        # its imports done, it waits to be set up
        self.waiting = False
        self.gone = False

    @property
    def pid(self) -> int:
        return self.popen.pid if self.popen is not None else 0

    def send_fds(self, fds: list[int]) -> None:
        """Descriptors to it over the side socket (before the record that names them)."""
        if fds and self.side is not None:
            arena.send(self.side, fds)


class Processes:
    """`count` front-end processes, numbered 1..count, and a spare.

    `setup(process) -> (fields, fds)`: what one is told as it takes its number (SETUP; the
    descriptors go over the side socket before it); `on_record(process, kind, fields)`: a record
    from one; `on_gone(process)`: one with a number died (before it is replaced)."""

    def __init__(
        self,
        count: int,
        setup: Callable[[Process], tuple[bytes, list[int]]],
        on_record: Callable[[Process, int, memoryview], None],
        on_gone: Callable[[Process], None],
    ):
        self.count = count
        self._setup, self._on_record, self._on_gone = setup, on_record, on_gone
        self.processes: dict[int, Process] = {}
        self.spare: Process | None = None
        self.stopping = False
        self.replaced = 0
        self._reaping: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Every front end started and listening, and a spare started (RuntimeError naming the first
        that did not listen)."""
        for owner in range(1, self.count + 1):
            self._number(await self._spawn(), owner)
        self.spare = await self._spawn()
        for process in list(self.processes.values()):
            await self._listening(process)

    async def _spawn(self) -> Process:
        """A new process, not set up yet."""
        loop = asyncio.get_running_loop()
        process = Process()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        side, side_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        command = [
            sys.executable,
            "-m",
            "serving.front_end_process",
            str(theirs.fileno()),
            str(side_theirs.fileno()),
            str(os.getpid()),
        ]
        try:
            process.popen = subprocess.Popen(
                command, pass_fds=[theirs.fileno(), side_theirs.fileno()], close_fds=True
            )
        finally:
            theirs.close()
            side_theirs.close()
        process.started = time.monotonic()
        process.side = side
        process.listening = loop.create_future()
        process.channel = channel.Channel(
            lambda kind, fields: self._record(process, kind, fields),
            lambda exc: self._lost(process),
        )
        await loop.connect_accepted_socket(lambda: process.channel, ours)
        return process

    def _number(self, process: Process, owner: int) -> None:
        """The process becomes front end `owner`: set up, to listen."""
        process.owner = owner
        process.started = time.monotonic()
        self.processes[owner] = process
        fields, fds = self._setup(process)
        process.send_fds(fds)
        process.channel.send(channel.SETUP, fields)

    async def _listening(self, process: Process) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(process.listening), START_S)
        except TimeoutError:
            raise RuntimeError(
                f"front end {process.owner} (pid {process.pid}) did not start listening within "
                f"{START_S:g} s"
            ) from None

    def _record(self, process: Process, kind: int, fields: memoryview) -> None:
        if kind == channel.WAITING:
            process.waiting = True
            return
        if kind == channel.LISTENING:
            if not process.listening.done():
                process.listening.set_result(channel.unjson(fields))
            return
        self._on_record(process, kind, fields)

    def _lost(self, process: Process) -> None:
        """Its channel closed: it is gone (or going). Let go of what it held, reap it, replace
        it."""
        if process.gone:
            return
        process.gone = True
        if process.popen.poll() is None and not self.stopping:
            # closed its channel yet lives on: a bug; no half-alive front end keeps the port
            process.popen.kill()
        if not process.listening.done():
            process.listening.set_exception(
                RuntimeError(f"front end {process.owner or '(spare)'} exited before it listened")
            )
            process.listening.exception()
        if process.side is not None:
            process.side.close()
            process.side = None
        if process.owner:
            self._on_gone(process)
        task = asyncio.get_running_loop().create_task(self._replace(process))
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)

    async def _replace(self, process: Process) -> None:
        """A front end gone: the spare takes its number now (or a new process, where the spare is
        gone too), a new spare is started, and the dead one is reaped."""
        numbered = process.owner and self.processes.get(process.owner) is process
        if not self.stopping and numbered:
            spare, self.spare = self.spare, None
            if spare is None or spare.gone:
                spare = await self._spawn()
            self._number(spare, process.owner)
            self.replaced += 1
        elif not self.stopping and process is self.spare:
            self.spare = None
        code = await asyncio.to_thread(process.popen.wait)
        if self.stopping:
            return
        if numbered:
            log.warning(
                "front end %d (pid %d) %s; replaced by pid %d",
                process.owner,
                process.pid,
                f"was killed by signal {-code}" if code < 0 else f"exited with code {code}",
                self.processes[process.owner].pid,
            )
        if self.spare is None:
            self.spare = await self._spawn()
        if numbered:
            replacement = self.processes[process.owner]
            try:
                await self._listening(replacement)
            except RuntimeError as exc:
                log.error("%s", exc)
                return
            log.info(
                "front end %d listens again (pid %d), %.2f s after it was set up",
                replacement.owner,
                replacement.pid,
                time.monotonic() - replacement.started,
            )

    def states(self) -> dict[str, int]:
        """How many front ends listen, are starting, and whether a spare waits (for /metrics)."""
        numbered = [p for p in self.processes.values() if not p.gone]
        listening = sum(p.listening.done() and not p.listening.exception() for p in numbered)
        spare = self.spare is not None and self.spare.waiting and not self.spare.gone
        return {
            "listening": listening,
            "starting": len(numbered) - listening,
            "spare": int(spare),
        }

    def broadcast(self, kind: int, fields: bytes, fds: list[int] = ()) -> None:
        """A record to every front end that lives (with descriptors over the side socket first)."""
        for process in self.processes.values():
            if not process.gone:
                process.send_fds(list(fds))
                process.channel.send(kind, fields)

    async def stop(self, grace: float) -> None:
        """DRAIN to each (and the spare), then wait up to `grace` s for them to exit; kill what is
        left."""
        self.stopping = True
        every = [*self.processes.values(), *([self.spare] if self.spare is not None else [])]
        for process in every:
            if not process.gone:
                process.channel.send(channel.DRAIN, b"")
        deadline = time.monotonic() + grace
        for process in every:
            left = max(0.0, deadline - time.monotonic())
            try:
                await asyncio.wait_for(asyncio.to_thread(process.popen.wait), left + 1)
            except TimeoutError:
                log.warning(
                    "front end %d (pid %d) still busy after %.0f s; killing it",
                    process.owner,
                    process.pid,
                    grace,
                )
                process.popen.kill()
                await asyncio.to_thread(process.popen.wait)
        for task in list(self._reaping):
            task.cancel()
