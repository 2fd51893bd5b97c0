"""How a front-end process should reserve its rows in the engine's shared batch buffers: itself,
under the arena's process-shared lock (serving/arena.py, what the server does), or by a small record
to the engine's process and its answer back. CPU per reservation, both processes counted.

    lock      a front end's `arriving(rows=1)` and its place let go again (kill, forget), in a loop,
              on an arena's placements: what a reservation costs it; the engine's process pays
              nothing
    record    a front end sends a 32-byte record over a Unix socket and waits for the 32-byte
              answer; the engine's process does the same reservation on its own placements for each
              record and answers, on its event loop (asyncio protocols, as the server's channels
              are); 1 or 32 records at once (32: batched per loop turn, as a busy front end's would
              be); CPU of both processes

    python benchmarks/arena.py                     # 20,000 of each, 1 and 32 in flight
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import socket
import sys
import time
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serving.arena import Arena, Spec  # noqa: E402

RECORD = bytes(32)


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


OWNER = types.SimpleNamespace(ended=lambda arrival: None)


def placements(owner: int):
    """Placements of a 602 KB-row model's arena, as a front end (`owner` 1..) or the engine (0)
    has them."""
    return Arena.create([Spec("x", np.float32, (-1, 3, 224, 224))], 32).placements(32, owner=owner)


def reserve(p) -> None:
    """A place reserved and let go again."""
    a = p.arriving(OWNER, 1)
    p.kill(a.place)
    p.forget(a)


def by_lock(n: int) -> float:
    """µs of CPU per reservation under the shared lock."""
    p = placements(1)
    for _ in range(100):
        reserve(p)
    started = cpu()
    for _ in range(n):
        reserve(p)
    return (cpu() - started) / n * 1e6


class Engine(asyncio.Protocol):
    """Reserves a place for each record and answers it."""

    def __init__(self):
        self.p = placements(0)

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        for _ in range(len(data) // len(RECORD)):
            reserve(self.p)
        self.transport.write(data)


class Asker(asyncio.Protocol):
    def __init__(self):
        self.waiting: list[asyncio.Future] = []
        self.pending = b""

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        data = self.pending + data
        whole = len(data) // len(RECORD)
        self.pending = data[whole * len(RECORD) :]
        for _ in range(whole):
            self.waiting.pop(0).set_result(None)

    async def ask(self):
        future = asyncio.get_running_loop().create_future()
        self.waiting.append(future)
        self.transport.write(RECORD)
        await future


def by_record(n: int, in_flight: int) -> float:
    """µs of CPU per reservation by a record and its answer, both processes counted."""
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        ours.close()

        async def engine():
            loop = asyncio.get_running_loop()
            done = loop.create_future()
            transport, _ = await loop.connect_accepted_socket(Engine, theirs)
            transport.get_protocol().connection_lost = lambda exc: done.set_result(None)
            await done

        asyncio.run(engine())
        os._exit(0)
    theirs.close()

    async def front_end() -> float:
        loop = asyncio.get_running_loop()
        _, asker = await loop.connect_accepted_socket(Asker, ours)

        async def client(count: int):
            for _ in range(count):
                await asker.ask()

        await asyncio.gather(*(client(100) for _ in range(in_flight)))
        started = cpu()
        await asyncio.gather(*(client(n // in_flight) for _ in range(in_flight)))
        return cpu() - started

    mine = asyncio.run(front_end())
    ours.close()
    before = children_cpu()
    os.waitpid(pid, 0)
    # (the engine's CPU over the whole run, warm-up included: counted for n + the warm-up's)
    theirs_cpu = (children_cpu() - before) * n / (n + 100 * in_flight)
    return (mine + theirs_cpu) / n * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=20_000)
    args = parser.parse_args()
    print(f"lock: {by_lock(args.n):.1f} µs CPU a reservation (the front end's; the engine's: 0)")
    for in_flight in (1, 32):
        started = time.perf_counter()
        per = by_record(args.n, in_flight)
        print(
            f"record and answer, {in_flight} in flight: {per:.1f} µs CPU a reservation "
            f"(both processes; {time.perf_counter() - started:.1f} s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
