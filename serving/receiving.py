"""How many gRPC ModelInfer calls each front-end process is still receiving (begun, their message
not all in: serving/grpc/native.cc `receiving`), where the engine's batches can read them.

One memfd of C ints, made by the engine (`ReceivingCounts.create`) and mapped by every front end
(`open`), whose descriptor goes with its SETUP. Int `owner` is front end `owner`'s: its grpc threads
add and subtract there (native.cc's `counter`), and the engine adds them all up (`total`) for
Server.incoming, so a batch waits for messages on their way to any front end as it waits for those
on their way to one process. A front end's int is zeroed when it dies (what it was receiving will
never come) and before its replacement takes its number.
"""

from __future__ import annotations

import mmap
import os

INT = 4


class ReceivingCounts:
    """Front ends 1..`count`'s ints (index 0 is unused); `fd` the memfd, kept by whoever made or
    opened it until `close`."""

    def __init__(self, fd: int, count: int):
        self.fd, self.count = fd, count
        self._map = mmap.mmap(fd, INT * (count + 1))
        self._ints = memoryview(self._map).cast("i")

    @classmethod
    def create(cls, count: int) -> ReceivingCounts:
        fd = os.memfd_create("trainserve-receiving", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, INT * (count + 1))
            return cls(fd, count)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def open(cls, fd: int) -> ReceivingCounts:
        """The counts the engine made, from their descriptor (kept here)."""
        return cls(fd, os.fstat(fd).st_size // INT - 1)

    def of(self, owner: int) -> memoryview:
        """Front end `owner`'s int, as native.cc's `start` takes it (a writable, aligned buffer)."""
        return memoryview(self._map)[INT * owner : INT * (owner + 1)]

    def total(self) -> int:
        # Aligned 4-byte reads: each int is read whole. None counts below 0: a front end killed
        # between a call's end and its zeroing must not make every batch wait from then on.
        return sum(n for n in self._ints[1:] if n > 0)

    def zero(self, owner: int) -> int:
        """Front end `owner`'s int set to 0; what it was."""
        was, self._ints[owner] = self._ints[owner], 0
        return was

    def close(self) -> None:
        """The descriptor let go; the mapping stays while native.cc holds a view of it."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
