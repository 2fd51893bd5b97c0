"""A model's batch buffers: the host memory its batched runs read their inputs from, and the check
that every floating-point value is finite (NaN and Inf are refused with a 400, request by request).

A request is copied into a batch buffer once, when it has arrived, on the thread that took it in
(its bytes are still in that core's cache), into the rows after the requests before it: the batch is
assembled while the engine runs the previous one, and the engine runs the buffer as it is, no
gather, no array allocated per batch; a bucket's padding is written in place. On the CUDA provider
the buffers are pinned (page-locked: the host-to-device copy is a DMA at full speed, not staged
through the driver's bounce buffer). Only for models whose every input has a fixed shape past the
batch axis; other models' requests are concatenated as they come (`concat`).

The copy and the finite check are one pass (serving/_ingest.c; numpy's two passes where it is not
built): over exactly the bytes that will run, so a value in shared memory a client changes
afterwards is not what runs.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from serving import cuda

try:
    from serving import _ingest
except ImportError:
    # not built (no C compiler at install): numpy does the same in two passes
    _ingest = None

log = logging.getLogger("serving.staging")
Feeds = dict[str, np.ndarray]
# one running, one assembling, one full and waiting
BUFFERS = 3
# all of a model's batch buffers together; past it fewer buffers (at least one)
MAX_BYTES = 1 << 30
PAGE = 4096


class NonFinite(ValueError):
    """A request's input holds NaN or Inf."""

    def __init__(self, name: str):
        super().__init__(
            f"input '{name}' contains NaN or Inf; this server refuses non-finite values"
        )


def _width(dtype: np.dtype) -> int:
    """The check's value width for a dtype: its size for floating point, 0 (no check) for the
    rest."""
    return dtype.itemsize if dtype.kind == "f" and dtype.itemsize in (2, 4, 8) else 0


def finite_bytes(data: memoryview, width: int) -> bool:
    """Whether the floating-point values of `width` bytes in `data` (a whole number of them) are all
    finite."""
    if _ingest is not None:
        return _ingest.finite(data, width)
    return bool(np.isfinite(np.frombuffer(data, dtype=f"<f{width}")).all())


def all_finite(x: np.ndarray) -> bool:
    if x.dtype.kind != "f" or not x.size:
        return True
    if _ingest is not None and x.flags.c_contiguous and _width(x.dtype):
        return _ingest.finite(x, x.dtype.itemsize)
    return bool(np.isfinite(x).all())


def copy_finite(destination: np.ndarray, source: np.ndarray) -> bool:
    """destination[...] = source (same shape and dtype, destination contiguous); whether every value
    is finite."""
    width = _width(source.dtype)
    if _ingest is not None and source.flags.c_contiguous:
        return _ingest.copy_finite(destination, source, width)
    destination[...] = source
    return not width or bool(np.isfinite(destination).all())


def check_finite(feeds: Feeds) -> None:
    """NonFinite for the first floating-point input holding NaN or Inf."""
    for name, x in feeds.items():
        if not all_finite(x):
            raise NonFinite(name)


def concat(parts: list[Feeds]) -> Feeds:
    """The parts as one batch, a new array per input (one part: itself)."""
    if len(parts) == 1:
        return parts[0]
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def nbytes(tensors) -> int:
    """The bytes of tensors given as (dtype, shape) pairs, together."""
    return sum(
        int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize for dtype, shape in tensors
    )


def rows_of(feeds: Feeds) -> int:
    """The rows of a request's feeds (validated: every input has them on its first axis)."""
    return len(next(iter(feeds.values())))


class BatchBuffers:
    """`count` buffers of `capacity` rows for every input (pinned when `pin`). In `memory` when
    given (a writable buffer of `nbytes_for` bytes, e.g. a mapping of a memfd that front-end
    processes map too: serving/arena.py), all made at once; else each made when first asked for
    (`make`). Which buffer is free is its one user's business, a batcher's placements
    (serving/placements.py)."""

    def __init__(self, inputs, capacity: int, pin: bool = False, count: int = BUFFERS, memory=None):
        self.inputs = _layout(inputs)
        self.capacity = capacity
        self.count = _count(self.inputs, capacity, count)
        self.pin = pin
        self._lock = threading.Lock()
        self._buffers: list[Feeds] = []
        self._memory = memory
        self._offsets = _laid_out(self.inputs, capacity, self.count)[0]
        if memory is not None:
            self.make(self.count - 1)

    @staticmethod
    def nbytes_for(inputs, capacity: int, count: int = BUFFERS) -> int:
        """The bytes the buffers of BatchBuffers(inputs, capacity, count=count) take in one piece
        of memory."""
        layout = _layout(inputs)
        return _laid_out(layout, capacity, _count(layout, capacity, count))[1]

    def make(self, index: int) -> Feeds:
        """Buffer `index` (made now if it was not: those before it first)."""
        with self._lock:
            while len(self._buffers) <= index:
                self._buffers.append(self._new(len(self._buffers)))
            return self._buffers[index]

    def _new(self, index: int) -> Feeds:
        if self._memory is None:
            buffer = {
                name: np.empty((self.capacity, *shape), dtype) for name, dtype, shape in self.inputs
            }
        else:
            buffer = {
                name: np.frombuffer(
                    self._memory,
                    dtype,
                    self.capacity * int(np.prod(shape, dtype=np.int64)),
                    self._offsets[index][name],
                ).reshape(self.capacity, *shape)
                for name, dtype, shape in self.inputs
            }
        if self.pin and not all([cuda.pin(array) for array in buffer.values()]):
            log.info(
                "batch buffers could not be pinned (cudaHostRegister refused): copies to the GPU "
                "go through pageable memory, slower"
            )
            self.pin = False
        return buffer

    def fits(self, feeds: Feeds, rows: int) -> bool:
        """Whether a request's feeds have this layout (names, shapes past the batch axis, dtypes)
        and fit a buffer."""
        if rows > self.capacity or len(feeds) != len(self.inputs):
            return False
        for name, dtype, shape in self.inputs:
            x = feeds.get(name)
            if x is None or x.dtype != dtype or x.shape[1:] != shape:
                return False
        return True

    def views(self, index: int, start: int, rows: int) -> Feeds:
        """Rows start..start+rows of buffer `index`, every input's (where a request's body may be
        received into)."""
        return {name: buffer[start : start + rows] for name, buffer in self._buffers[index].items()}

    def fill(self, index: int, start: int, rows: int, source: int) -> None:
        """Rows start..start+rows of buffer `index` made copies of row `source` (a refused request's
        place in a run)."""
        for buffer in self._buffers[index].values():
            buffer[start : start + rows] = buffer[source]

    def put(self, index: int, start: int, feeds: Feeds) -> None:
        """A request's rows into buffer `index` from row `start`; NonFinite if one of its values is
        NaN or Inf."""
        buffer = self._buffers[index]
        for name, x in feeds.items():
            if not copy_finite(buffer[name][start : start + len(x)], x):
                raise NonFinite(name)

    def batch(self, index: int, rows: int, size: int, start: int = 0) -> Feeds:
        """Rows start..start+size of buffer `index`, the last size-rows of them padded with copies
        of the batch's last row (a bucket's padding: values the model certainly takes, where a zero
        could be an index or a divisor it does not expect)."""
        out = {name: buffer[start : start + size] for name, buffer in self._buffers[index].items()}
        if size > rows:
            for view in out.values():
                view[rows:size] = view[rows - 1]
        return out

    def gather(self, index: int, parts: list[Feeds], rows: int, size: int) -> Feeds:
        """Requests' feeds copied one after another into buffer `index` (checked), then as
        `batch`."""
        start = 0
        for part in parts:
            self.put(index, start, part)
            start += rows_of(part)
        return self.batch(index, rows, size)

    def close(self) -> None:
        """Unpinned and let go (a mapping goes once no view of it is left)."""
        with self._lock:
            for buffer in self._buffers:
                for array in buffer.values():
                    cuda.unpin(array)
            self._buffers, self._memory = [], None


def _layout(inputs) -> list[tuple[str, np.dtype, tuple]]:
    """(name, dtype, shape past the batch axis) of each input spec."""
    return [(spec.name, np.dtype(spec.dtype), tuple(spec.shape[1:])) for spec in inputs]


def _count(layout, capacity: int, count: int) -> int:
    """How many buffers are made of the `count` asked for: fewer past MAX_BYTES in all, at least
    one."""
    row_bytes = nbytes((dtype, shape) for _, dtype, shape in layout)
    return max(1, min(count, MAX_BYTES // max(1, row_bytes * capacity)))


def _laid_out(layout, capacity: int, count: int) -> tuple[list[dict[str, int]], int]:
    """Where each buffer's array of each input begins in one piece of memory (page-aligned: what
    is pinned), and the bytes in all."""
    offsets, at = [], 0
    for _ in range(count):
        buffer = {}
        for name, dtype, shape in layout:
            buffer[name] = at
            size = capacity * int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            at += -(-size // PAGE) * PAGE
        offsets.append(buffer)
    return offsets, at
