"""What the engine's process and each of its front-end processes say to each other: small
records over a Unix stream socket, a pair per front end (serving/front_ends.py,
serving/front_end_process.py).

A record is its length (4 bytes), its kind (1 byte) and its fields, packed with `struct`: never
pickled (what crosses is data, and a record from a front end is no more trusted than a request). A
request's tensors never cross it: they are in the arena's rows (serving/arena.py), which the front
end received or copied them into, and the record names the place. What does cross is small: the
place, the request's id and deadline, and the answer's outputs (a classifier's logits; a model
whose outputs are large pays a copy here). Where no place could be had (every buffer taken) the
request's tensors follow its record, the one exception.

Records are written at the end of the event loop's turn, every one of that turn in one system call
(`Channel.send` queues, the turn's end flushes): a front end busy taking requests in hands the
engine a turn's worth at once, as grpc's C++ threads hand the loop theirs (serving/grpc/native.cc).

    front end -> engine              engine -> front end
    WAITING    started, imports done  SETUP    its number, settings, models; descriptors follow on
    LISTENING  its addresses                   the side socket
    SUBMIT     a request in its place VERSIONS the models again (a load, an unload, a swap)
    ENDED      an arrival given up    ANSWER   a request's outputs and receipt
    FORWARD    a request the engine   REFUSED  a request's refusal (status, message, headers)
               answers whole          REPLY    the answer to a FORWARD, whole
    METRICS    its /metrics text      METRICS? its /metrics text, please
                                      DRAIN    stop taking requests in, answer what is in flight
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable

import numpy as np
import orjson

log = logging.getLogger("serving.channel")

(
    LISTENING,
    SUBMIT,
    ENDED,
    FORWARD,
    METRICS,
    SETUP,
    VERSIONS,
    ANSWER,
    REFUSED,
    REPLY,
    ASK_METRICS,
    DRAIN,
    WAITING,
) = range(1, 14)
NAMES = {
    LISTENING: "LISTENING",
    SUBMIT: "SUBMIT",
    ENDED: "ENDED",
    FORWARD: "FORWARD",
    METRICS: "METRICS",
    SETUP: "SETUP",
    VERSIONS: "VERSIONS",
    ANSWER: "ANSWER",
    REFUSED: "REFUSED",
    REPLY: "REPLY",
    ASK_METRICS: "METRICS?",
    DRAIN: "DRAIN",
    WAITING: "WAITING",
}
HEAD = struct.Struct("<IB")
# a record's largest length: a forwarded request's body is at most --max-body-bytes (< 2 GiB)
MAX_RECORD = (1 << 31) - 1


class ChannelError(Exception):
    """A record that does not parse: the other process is not speaking this protocol (a bug)."""


class Channel(asyncio.BufferedProtocol):
    """One end of the socket: records in (`on_record(kind, fields)`, a memoryview valid during the
    call), records out (`send`, written at the end of the loop's turn). `on_lost(exc)` once the
    other end is gone."""

    def __init__(
        self,
        on_record: Callable[[int, memoryview], None],
        on_lost: Callable[[Exception | None], None],
    ):
        self.on_record, self.on_lost = on_record, on_lost
        self.transport: asyncio.Transport | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._buffer = bytearray(1 << 20)
        self._end = 0
        self._out: list[bytes] = []
        self._flushing = False
        self.closed = False
        # called at the end of each turn that sent records, before they are written
        self.before_flush: Callable[[], None] | None = None

    # ---- asyncio's calls ----

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.loop = asyncio.get_running_loop()

    def get_buffer(self, sizehint: int) -> memoryview:
        if len(self._buffer) - self._end < 65536:
            self._grow(2 * len(self._buffer))
        return memoryview(self._buffer)[self._end :]

    def _grow(self, size: int) -> None:
        # a new buffer, never a resized one: the loop may still hold a view of the last
        grown = bytearray(size)
        grown[: self._end] = self._buffer[: self._end]
        self._buffer = grown

    def buffer_updated(self, nbytes: int) -> None:
        self._end += nbytes
        at, need = 0, 0
        with memoryview(self._buffer) as data:
            try:
                while self._end - at >= HEAD.size:
                    length, kind = HEAD.unpack_from(data, at)
                    if length > MAX_RECORD:
                        raise ChannelError(f"a record of {length} bytes")
                    if self._end - at - HEAD.size < length:
                        need = HEAD.size + length
                        break
                    with data[at + HEAD.size : at + HEAD.size + length] as fields:
                        at += HEAD.size + length
                        self.on_record(kind, fields)
            except Exception:
                log.exception("the other process's records can't be read; closing the channel")
                self.transport.close()
                return
        if at:
            # (the same length: no resize, whatever views of it are left)
            self._buffer[: self._end - at] = self._buffer[at : self._end]
            self._end -= at
        if need > len(self._buffer):
            self._grow(need)

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.on_lost(exc)

    # ---- out ----

    def send(self, kind: int, *parts: bytes) -> None:
        """A record of `parts` (joined), written with every other record of this loop turn."""
        if self.closed:
            return
        length = sum(len(p) for p in parts)
        self._out.append(HEAD.pack(length, kind))
        self._out.extend(parts)
        if not self._flushing:
            self._flushing = True
            self.loop.call_soon(self._flush)

    def send_now(self, kind: int, *parts: bytes) -> None:
        """(from another thread) `send`, on the channel's loop."""
        self.loop.call_soon_threadsafe(self.send, kind, *parts)

    def _flush(self) -> None:
        self._flushing = False
        if self.before_flush is not None:
            self.before_flush()
        out, self._out = self._out, []
        if out and not self.transport.is_closing():
            self.transport.writelines(out)

    def close(self) -> None:
        self._flush()
        self.closed = True
        self.transport.close()


# ---- fields ----


def json(value) -> bytes:
    return orjson.dumps(value)


def unjson(data: memoryview):
    return orjson.loads(data)


class Reader:
    """Fields read off a record in order."""

    __slots__ = ("data", "at")

    def __init__(self, data: memoryview):
        self.data, self.at = data, 0

    def take(self, form: struct.Struct) -> tuple:
        values = form.unpack_from(self.data, self.at)
        self.at += form.size
        return values

    def text(self) -> str:
        (n,) = self.take(U16)
        value = str(self.data[self.at : self.at + n], "utf-8")
        self.at += n
        return value

    def blob(self) -> memoryview:
        (n,) = self.take(U64)
        value = self.data[self.at : self.at + n]
        self.at += n
        return value

    def rest(self) -> memoryview:
        return self.data[self.at :]

    def tensors(self) -> dict[str, np.ndarray]:
        """Tensors `tensors()` wrote (copies: the record's memory is reused)."""
        (count,) = self.take(U16)
        found = {}
        for _ in range(count):
            name, kind = self.text(), self.text()
            (ndim,) = self.take(U16)
            shape = struct.unpack_from(f"<{ndim}q", self.data, self.at)
            self.at += 8 * ndim
            if kind in ("U", "S"):
                items = []
                for _ in range(int(np.prod(shape, dtype=np.int64))):
                    item = bytes(self.blob())
                    items.append(item.decode("utf-8") if kind == "U" else item)
                array = np.empty(len(items), object)
                array[:] = items
                found[name] = array.reshape(shape)
            else:
                found[name] = np.frombuffer(self.blob(), kind).reshape(shape).copy()
        return found


U8, U16, U32, U64 = (struct.Struct(f) for f in ("<B", "<H", "<I", "<Q"))


def text(value: str) -> bytes:
    data = value.encode("utf-8")
    return U16.pack(len(data)) + data


def blob(data) -> list:
    return [U64.pack(len(data)), data]


def tensors(arrays: dict[str, np.ndarray]) -> list:
    """`arrays` as fields: each name, dtype, shape and bytes (BYTES ones element by element)."""
    parts: list = [U16.pack(len(arrays))]
    for name, x in arrays.items():
        if x.dtype == object:
            strings = any(isinstance(v, str) for v in x.flat)
            parts += [text(name), text("U" if strings else "S")]
            parts += [U16.pack(x.ndim), struct.pack(f"<{x.ndim}q", *x.shape)]
            for v in x.flat:
                parts += blob(v.encode("utf-8") if isinstance(v, str) else bytes(v))
        else:
            x = np.ascontiguousarray(x)
            parts += [text(name), text(x.dtype.str), U16.pack(x.ndim)]
            parts += [struct.pack(f"<{x.ndim}q", *x.shape), *blob(memoryview(x).cast("B"))]
    return parts
