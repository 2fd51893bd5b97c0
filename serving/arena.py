"""A model version's batch rows in memory several processes share: the engine's process makes them,
and its front-end processes (serving/front_ends.py) map them and receive request bodies straight
into their rows, each reserving its places itself (serving/placements.py).

One memfd a version, holding, each part page-aligned:
    the process-shared lock (serving/_ingest.c: a robust pthread mutex)
    the placements' table: each buffer's and each place's state as integers, the arrivals
    the batch buffers (staging.BatchBuffers): `count` buffers of `capacity` rows of every input
A memfd has no name in /dev/shm: whoever crashes, nothing is left behind. The engine makes it up
front (`Arena.create`) and pins its buffers for the GPU as it pins a private pool; it hands the
descriptor to each front end over a Unix socket (`send`, `receive`: SCM_RIGHTS) with its layout
(`layout`, a small dict), and the front end maps it (`Arena.open`). The memory lives until the last
process lets go of its mapping and descriptor: a version swapped out keeps its rows for as long as
a front end still receives a body into them.

Why a lock and not a record to the engine and back for each reservation: reserving under the lock
costs a front end a few microseconds and the engine nothing; a record and its answer cost each side
a system call and an event-loop turn, and would hold the body's first bytes until the answer came
(benchmarks/arena.py measures both).
"""

from __future__ import annotations

import mmap
import os
import socket

import numpy as np

from serving.placements import Placements, Table
from serving.staging import BUFFERS, PAGE, BatchBuffers

try:
    from serving import _ingest
except ImportError:
    # not built: one process only (serving/front_ends.py refuses front ends)
    _ingest = None

WHY_NOT = (
    ""
    if _ingest is not None and hasattr(_ingest, "Lock")
    else "serving._ingest is not built (a C compiler and Python's headers, then `pip install -e "
    ".`): front-end processes need its process-shared lock"
)


def has_rows(model) -> bool:
    """Whether a version's requests are received into an arena's rows (a batched model of fixed
    row shapes); the others' tensors come inline with their records."""
    return model.engine.fixed_rows and model.engine.batchable


class Spec:
    """An input as the arena lays it out: name, dtype, shape (the batch axis first)."""

    __slots__ = ("name", "dtype", "shape")

    def __init__(self, name: str, dtype, shape):
        self.name, self.dtype, self.shape = name, np.dtype(dtype), tuple(shape)


class Arena:
    """One version's shared batch rows (see the module's docstring); `fd` its memfd, owned here
    (`close`)."""

    def __init__(self, fd: int, layout: dict, create: bool, pin: bool = False):
        if WHY_NOT:
            raise RuntimeError(WHY_NOT)
        self.fd, self.layout = fd, layout
        self.memory = mmap.mmap(fd, layout["bytes"])
        view = memoryview(self.memory)
        self.lock = _ingest.Lock(view[: _ingest.LOCK_BYTES], create=create)
        self.table = Table(
            view[: layout["buffers_at"]], layout["count"], layout["places"], self.lock, create
        )
        specs = [Spec(name, dtype, shape) for name, dtype, shape in layout["inputs"]]
        self.buffers = BatchBuffers(
            specs,
            layout["places"],
            pin=pin,
            count=layout["count"],
            memory=view[layout["buffers_at"] :],
        )

    @classmethod
    def create(
        cls, inputs, capacity: int, pin: bool = False, count: int = BUFFERS, name: str = "rows"
    ) -> Arena:
        """A new arena for `inputs` (specs: name, dtype, shape) in `count` buffers (fewer past
        staging.MAX_BYTES) of `capacity` rows."""
        probe = BatchBuffers(inputs, capacity, count=count)
        count = probe.count
        table_bytes = Table.nbytes(count, capacity)
        buffers_at = -(-table_bytes // PAGE) * PAGE
        layout = {
            "inputs": [
                (spec.name, np.dtype(spec.dtype).str, [-1, *spec.shape[1:]]) for spec in inputs
            ],
            "count": count,
            "places": capacity,
            "buffers_at": buffers_at,
            "bytes": buffers_at + BatchBuffers.nbytes_for(inputs, capacity, count),
        }
        fd = os.memfd_create(f"trainserve-{name}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, layout["bytes"])
            return cls(fd, layout, create=True, pin=pin)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def open(cls, fd: int, layout: dict) -> Arena:
        """The arena another process made, from its descriptor (kept here) and layout."""
        return cls(fd, layout, create=False)

    def placements(self, capacity: int, bucket_for=lambda rows: rows, owner: int = 0) -> Placements:
        """Placements over this arena's table and buffers, counting this process as `owner` (0: the
        engine's, which alone closes the pool)."""
        return Placements(self.buffers, capacity, bucket_for, table=self.table, owner=owner)

    def close(self) -> None:
        """The descriptor let go (the mapping goes once no view of it is left)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def send(sock: socket.socket, fds: list[int]) -> None:
    """Descriptors to the process at the other end of a Unix socket (SCM_RIGHTS), in one message."""
    socket.send_fds(sock, [len(fds).to_bytes(4, "little")], fds)


def receive(sock: socket.socket) -> list[int]:
    """The descriptors `send` sent, in order (blocking until they are there)."""
    data, fds, _, _ = socket.recv_fds(sock, 4, 64)
    if len(data) != 4 or int.from_bytes(data, "little") != len(fds):
        for fd in fds:
            os.close(fd)
        raise ConnectionError("the engine's descriptors did not come whole")
    return list(fds)
