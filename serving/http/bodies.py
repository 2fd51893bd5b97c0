"""Where a request body goes as it arrives (the connection asks its body for memory to receive
into).

    Bytes       the whole body in one buffer of its Content-Length (most routes)
    Chunked     a chunked body, as the HTTP parser hands its pieces over, up to the limit
    Discard     a body nobody will read (a request refused when its head arrived), dropped as it
                comes
    V2Binary    a KServe V2 request with binary tensor data: the JSON header into a small buffer,
                checked as soon as it is whole, then each input's bytes straight into the rows of
                the batch buffer it will run in (or into an array of its own when there is none to
                be had): the kernel's copy off the socket is the only one; no body joined, no
                decode, no gather into a batch

A body is `direct` when the connection may receive into its memory itself (`view`/`wrote`); bytes
that arrived with the head are handed in with `take`. `done` once every byte is in; an error found
on the way (a malformed V2 header) is kept in `error`, the rest of the body still read and dropped,
so that the client reads the refusal.

Memory for a body becomes resident only as its bytes land in it (`receiving`): a head declares a
size, and a buffer of that size zero-filled at once would be resident before a byte arrives (40
connections sending only heads that declared 16 MiB held 642 MiB until their read timeout). What is
received is still received once, into the memory it is read from.
"""

from __future__ import annotations

import numpy as np

from serving import codec
from serving.codec import UNFORESEEN, BadRequest, Limits, V2Header, V2Request
from serving.staging import NonFinite, finite_bytes

# what discarded bytes are received into (never read)
_SCRATCH = memoryview(bytearray(1 << 16))


def receiving(nbytes: int) -> memoryview:
    """`nbytes` of writable memory for a body to be received into, never written before the body's
    bytes are: malloc's fresh pages become resident only when touched (a bytearray is zero-filled,
    every page touched at once), and pages it reuses were resident already."""
    return memoryview(np.empty(nbytes, np.uint8))


class Bytes:
    direct = True

    def __init__(self, length: int):
        self.data = receiving(length)
        self.filled = 0
        self.error: Exception | None = None

    @property
    def done(self) -> bool:
        return self.filled >= len(self.data)

    def view(self) -> memoryview:
        return self.data[self.filled :]

    def wrote(self, n: int) -> None:
        self.filled += n

    def take(self, data: memoryview) -> int:
        n = min(len(data), len(self.data) - self.filled)
        self.data[self.filled : self.filled + n] = data[:n]
        self.filled += n
        return n

    def result(self) -> bytes:
        return self.data.tobytes()


class Discard:
    direct = True

    def __init__(self, length: int):
        self.remaining = length
        self.error: Exception | None = None

    @property
    def done(self) -> bool:
        return self.remaining <= 0

    def view(self) -> memoryview:
        return _SCRATCH[: min(len(_SCRATCH), self.remaining)]

    def wrote(self, n: int) -> None:
        self.remaining -= n

    def take(self, data: memoryview) -> int:
        n = min(len(data), self.remaining)
        self.remaining -= n
        return n

    def result(self) -> bytes:
        return b""


class Chunked:
    """Pieces of a chunked body from the HTTP parser (the connection feeds it the raw bytes); past
    `limit` the body is refused (413) and the connection closed."""

    direct = False

    def __init__(self, limit: int):
        self.parts: list[bytes] = []
        self.size = 0
        self.limit = limit
        self.done = False
        self.error: Exception | None = None

    def piece(self, data: bytes) -> None:
        self.size += len(data)
        if self.size <= self.limit:
            self.parts.append(data)

    def result(self) -> bytes:
        return b"".join(self.parts)


class V2Binary:
    """A V2 request body of `length` bytes whose first `header_length` are its JSON header (Triton's
    binary tensor extension). The header is checked against `specs` as soon as it is whole; the
    binary data then lands in the arrays the request's feeds will be."""

    direct = True

    def __init__(
        self,
        header_length: int,
        length: int,
        specs,
        output_names: list[str],
        limits: Limits,
        place=None,
        seen: dict | None = None,
        model: str = "",
    ):
        # its name, for refusals
        self.model = model
        # (rows) -> views of a batch buffer's rows to receive the inputs into, or None
        self.place = place
        # headers of this model already checked (see _parse), or None
        self.seen = seen
        self.header = receiving(header_length)
        self.length = length
        self.specs, self.output_names, self.limits = specs, output_names, limits
        # bytes of the body in so far
        self.filled = 0
        self.parsed: V2Header | None = None
        self.arrays: dict[str, np.ndarray] = {}
        # the binary inputs' bytes, their check's value width
        self._targets: list[tuple[memoryview, int, str]] = []
        # bytes into the current target
        self._at = 0
        # of which checked for NaN and Inf (see `wrote`)
        self._checked = 0
        # the first input found to hold NaN or Inf
        self.nonfinite: str | None = None
        # received into a batch buffer's rows
        self.placed = False
        # those rows (inputs in shared memory are read into theirs at `finish`)
        self.views: dict | None = None
        self.error: Exception | None = None
        self._discard: Discard | None = None
        if header_length == 0:
            self._parse()

    @property
    def done(self) -> bool:
        return self.filled >= self.length

    def view(self) -> memoryview:
        if self._discard is not None:
            return self._discard.view()
        if self.filled < len(self.header):
            return self.header[self.filled :]
        return self._targets[0][0][self._at :]

    def wrote(self, n: int) -> None:
        self.filled += n
        if self._discard is not None:
            self._discard.wrote(n)
        elif self.parsed is None:
            if self.filled == len(self.header):
                self._parse()
        else:
            # Each read's values checked for NaN and Inf as they land, while they are in this core's
            # cache: checked once the whole body was in, they had been pushed out by the other
            # uploads read meanwhile (58 us for a 602 KB image under load, against 13).
            target, width, name = self._targets[0]
            self._at += n
            whole = self._at - self._at % width if width else self._at
            if (
                width
                and whole > self._checked
                and self.nonfinite is None
                and not finite_bytes(target[self._checked : whole], width)
            ):
                self.nonfinite = name
            self._checked = whole
            if self._at == len(target):
                self._targets.pop(0)
                self._at = self._checked = 0

    def take(self, data: memoryview) -> int:
        taken = 0
        while taken < len(data) and not self.done:
            view = self.view()
            n = min(len(view), len(data) - taken)
            view[:n] = data[taken : taken + n]
            self.wrote(n)
            taken += n
        return taken

    def _parse(self) -> None:
        try:
            self.parsed = codec.parse_v2_header_once(
                self.seen,
                self.header,
                len(self.header),
                self.length,
                self.specs,
                self.output_names,
                self.limits,
                self.model,
            )
        except BadRequest as exc:
            self.error = exc
        except UNFORESEEN as exc:
            self.error = BadRequest(f"malformed request: {type(exc).__name__}: {str(exc)[:200]}")
        if self.error is not None:
            self._discard = Discard(self.length - self.filled)
            return
        views = self.views = self._placed()
        self.placed = views is not None
        for item in self.parsed.binary_inputs:
            array = (
                views[item.spec.name].reshape(-1)
                if views
                else np.empty(item.count, dtype=item.spec.dtype)
            )
            self.arrays[item.spec.name] = array
            if item.binary:
                width = item.spec.dtype.itemsize if item.spec.dtype.kind == "f" else 0
                self._targets.append((memoryview(array).cast("B"), width, item.spec.name))

    def _placed(self) -> dict | None:
        """The rows of a batch buffer this request's inputs go straight into, when it can have them:
        every model input sent as binary data or placed in shared memory (read into them at
        `finish`), all with the same rows (see serving/batcher.py)."""
        if self.place is None:
            return None
        return codec.placed_rows(self.parsed, self.specs, self.place)

    def result(self) -> "V2Binary":
        return self

    @property
    def binary_bytes(self) -> int:
        return self.length - len(self.header)

    def finish(self, shared=None) -> V2Request:
        """The decoded request: its arrays in their shapes (BOOL bytes checked; NaN and Inf refused,
        found as they arrived); `shared` reads the inputs placed in shared memory."""
        if self.nonfinite is not None:
            raise BadRequest(str(NonFinite(self.nonfinite)))
        return codec.finish_v2(self.parsed, self.arrays, self.specs, shared, self.views)

    @property
    def checked(self) -> bool:
        """Every value of its binary data was checked as it arrived (it needs no other pass): none
        of its inputs is read from shared memory at `finish`."""
        return (
            self.parsed is not None
            and self.nonfinite is None
            and all(item.ref is None for item in self.parsed.inputs)
        )
