"""A model's batch buffers: the host memory its batched runs read their inputs from, and the check that every
floating-point value of a batch is finite (NaN and Inf are refused with a 400, request by request).

A batch of requests is copied once, each request's rows straight into its place in one buffer per input,
reused run after run (no array is allocated per batch, and the bucket's padding is written in place, not
concatenated on), and on the CUDA provider the buffers are pinned (page-locked: the host-to-device copy is a
DMA at full speed, not staged through the driver's own bounce buffer). Only for models whose every input has a
fixed shape past the batch axis: other models' requests are concatenated as they come (`concat`).

The finite check is made here, on the engine thread, as the batch is copied: one pass over values that are in
the cache already, off the event loop, over exactly the bytes that will run (a value in shared memory a client
changes afterwards is not what runs).

Used on the engine thread only (the engine's runs are one at a time): the buffers hold one batch at a time.
"""

from __future__ import annotations

import logging

import numpy as np

from serving import cuda

log = logging.getLogger("serving.staging")
Feeds = dict[str, np.ndarray]


class NonFinite(ValueError):
    """A request's input holds NaN or Inf."""

    def __init__(self, name: str):
        super().__init__(f"input '{name}' contains NaN or Inf; this server refuses non-finite values")


def check_finite(feeds: Feeds) -> None:
    """NonFinite for the first floating-point input holding NaN or Inf."""
    for name, x in feeds.items():
        if x.dtype.kind == "f" and x.size and not np.isfinite(x).all():
            raise NonFinite(name)


def concat(parts: list[Feeds]) -> Feeds:
    """The parts as one batch, a new array per input (one part: itself)."""
    if len(parts) == 1:
        return parts[0]
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def rows_of(feeds: Feeds) -> int:
    """The rows of a request's feeds (validated: every input has them on its first axis)."""
    return len(next(iter(feeds.values())))


class Staging:
    """Buffers of `capacity` rows for every input (grown when a batch needs more), pinned when `pin`."""

    def __init__(self, inputs, pin: bool = False):
        self.inputs = [(spec.name, spec.dtype, tuple(spec.shape[1:])) for spec in inputs]
        self.pin = pin
        self.capacity = 0
        self.buffers: Feeds = {}
        self.pinned = False  # whether cudaHostRegister took them (said in the log once)

    def gather(self, parts: list[Feeds], rows: int, size: int) -> Feeds:
        """The parts' rows one after another, then the last row repeated up to `size` (a bucket's padding:
        values the model certainly takes, where a zero could be an index or a divisor it does not expect).
        Returns views of the buffers: valid until the next gather. NonFinite if a part holds NaN or Inf."""
        if size > self.capacity:
            self._grow(size)
        out = {name: buffer[:size] for name, buffer in self.buffers.items()}
        for name, view in out.items():
            at = 0
            check = view.dtype.kind == "f"
            for part in parts:
                x = part[name]
                view[at:at + len(x)] = x
                if check and not np.isfinite(view[at:at + len(x)]).all():
                    raise NonFinite(name)
                at += len(x)
            if size > rows:
                view[rows:size] = view[rows - 1]
        return out

    def _grow(self, size: int) -> None:
        for buffer in self.buffers.values():
            cuda.unpin(buffer)
        self.buffers = {name: np.empty((size, *shape), dtype) for name, dtype, shape in self.inputs}
        self.capacity = size
        if self.pin:
            pinned = all([cuda.pin(buffer) for buffer in self.buffers.values()])
            if pinned != self.pinned or size == self.capacity:
                log.debug("batch buffers of %d rows %s", size, "pinned" if pinned else "not pinned (pageable)")
            self.pinned = pinned

    def close(self) -> None:
        for buffer in self.buffers.values():
            cuda.unpin(buffer)
        self.buffers, self.capacity = {}, 0
