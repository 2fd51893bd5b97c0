"""The gRPC front end on grpc's C++ server (serving/grpc/native.cc, built as serving.grpc._native):
the Python half.

grpc's C++ threads take the calls and their messages; this module runs each one's handler,
serving/grpc/service.py's own (the very coroutines grpc.aio would run, bytes in and bytes out), on
the event loop, through a context that offers what they use of grpc.aio's: invocation_metadata,
send_initial_metadata, abort, read and write. What a unary call costs the loop here: one event (its
message included), one task, one call back to C++ with the answer.

`--grpc-engine native` asks for it, `auto` (the default) takes it when the extension was built
(scripts/setup builds it where grpc's C++ library is installed: Debian's libgrpc++-dev) and grpc.aio
otherwise.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading

import grpc

try:
    from serving.grpc import _native
except ImportError as exc:
    # not built here: grpc.aio serves instead
    _native = None
    WHY_NOT = f"serving.grpc._native is not built ({exc}); scripts/setup builds it where libgrpc++-dev is installed"
else:
    WHY_NOT = ""

log = logging.getLogger("serving.grpc")
# a stream's messages C++ may read before its handler takes them (the batch a client sends at once)
READ_AHEAD = 32
# a stream's answers C++ may hold, not yet written, before the handler waits
WRITE_AHEAD = 32
# answers not yet written over all streams (service.MAX_CONCURRENT_RPCS): past it handlers wait
UNWRITTEN = 4096
# ...and over one connection's streams: a client that does not read its answers (an HTTP/2 window of
# 0) stalls its own streams, not every other client's (it took all 4,096 with 128 streams).
CONNECTION_UNWRITTEN = UNWRITTEN // 8


def available() -> bool:
    return _native is not None


class NativeContext:
    """One call, as its handler sees it (the part of grpc.aio.ServicerContext that service.py
    uses)."""

    __slots__ = (
        "bridge",
        "id",
        "metadata",
        "reading",
        "writing",
        "task",
        "finished",
        "inbox",
        "ended",
        "granted",
        "unwritten",
        "broken",
        "places",
        "client",
    )

    def __init__(
        self,
        bridge,
        call_id: int,
        metadata: tuple,
        places: tuple[asyncio.Semaphore, ...],
        peer: str = "",
    ):
        self.bridge, self.id, self.metadata, self.client = bridge, call_id, metadata, peer
        # its connection's and the front end's (every stream's): one each an unwritten answer
        self.places = places
        # a stream's messages read ahead, not yet taken
        self.inbox: collections.deque = collections.deque()
        # a stream's reading is over: the client's last message came (or the call broke)
        self.ended = False
        # whether the read-ahead was granted yet
        self.granted = False
        # a stream's answers handed to C++ and not yet written
        self.unwritten = 0
        # a write failed: the client is gone
        self.broken = False
        self.reading: asyncio.Future | None = None
        self.writing: asyncio.Future | None = None
        self.task: asyncio.Task | None = None
        self.finished = False

    def invocation_metadata(self) -> tuple:
        return self.metadata

    def peer(self) -> str:
        """The client's connection, as grpc names it ("ipv4:127.0.0.1:50123")."""
        return self.client

    async def send_initial_metadata(self, pairs) -> None:
        # Sent with the answer or the status, whichever goes first: the client sees them as initial
        # metadata.
        _native.add_initial_metadata(self.bridge, self.id, tuple(pairs))

    async def abort(self, code: grpc.StatusCode, details: str = ""):
        self.end(code, details)
        raise grpc.aio.AbortError(f"aborted with {code.name}")

    async def read(self):
        """The stream's next message, or EOF. C++ reads up to READ_AHEAD messages before the handler
        asks for them (each one taken grants one more), so that the requests a client sends together
        reach the batcher together; the handler's own window (service.STREAM_WINDOW) still bounds
        what it has read and not answered."""
        if not self.granted:
            self.granted = True
            self.grant(READ_AHEAD)
        if not self.inbox and not self.ended:
            self.reading = asyncio.get_running_loop().create_future()
            await self.reading
        if not self.inbox:
            return grpc.aio.EOF
        if not self.ended:
            self.grant(1)
        return self.inbox.popleft()

    def grant(self, reads: int) -> None:
        if not _native.start_read(self.bridge, self.id, reads):
            # the call is over: what is in the inbox is all there is
            self.ended = True

    def arrived(self, message: bytes | None) -> None:
        """A READ event: a message, or None for the end of the client's messages."""
        if message is None:
            self.ended = True
        else:
            self.inbox.append(message)
        if self.reading is not None and not self.reading.done():
            self.reading.set_result(None)

    async def write(self, message: bytes) -> None:
        """Hands the answer to C++, which writes a stream's answers in order; waits only while more
        than WRITE_AHEAD of them are not yet written (a client not reading its answers holds the
        handler back)."""
        if self.broken:
            raise ConnectionError("the call ended before its answer could be written")
        taken = []
        try:
            for places in self.places:
                await places.acquire()
                taken.append(places)
        finally:
            # cancelled while waiting
            if len(taken) < len(self.places):
                for places in taken:
                    places.release()
        if self.broken or not _native.write(self.bridge, self.id, message, False):
            for places in self.places:
                places.release()
            raise ConnectionError("the call ended before its answer could be written")
        self.unwritten += 1
        while self.unwritten >= WRITE_AHEAD and not self.broken:
            self.writing = asyncio.get_running_loop().create_future()
            await self.writing
        if self.broken:
            raise ConnectionError("the call ended before its answer could be written")

    def written(self, ok: bool) -> None:
        """A WRITTEN event: one answer written, or the write failed and C++ dropped the ones queued
        behind it."""
        gone = 1 if ok else self.unwritten
        self.unwritten -= gone
        for _ in range(gone):
            for places in self.places:
                places.release()
        self.broken = self.broken or not ok
        if self.writing is not None and not self.writing.done():
            self.writing.set_result(None)

    # Finished only once the call back to C++ went through: one that raises (an answer that is not
    # bytes) leaves the call to be ended by the caller's fallback. (C++ finishes a call at most once
    # whatever Python asks.)
    def end(self, code: grpc.StatusCode, details: str) -> None:
        if not self.finished:
            _native.finish(self.bridge, self.id, code.value[0], details)
            self.finished = True

    def answer(self, message: bytes) -> None:
        if not self.finished:
            _native.write(self.bridge, self.id, message, True)
            self.finished = True


class RawContents:
    """A ModelInferRequest's raw_input_contents, left by C++ in grpc's own buffers (the message
    Python parses comes without them): each is copied once, into the array it will be, by
    `copy_into` (serving/grpc/codec.py), with the NaN/Inf check on the way. `len(raw[i])` is its
    byte count."""

    __slots__ = ("parts", "lengths")

    def __init__(self, parts, lengths: tuple[int, ...]):
        self.parts, self.lengths = parts, lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> "RawInput":
        if not -len(self.lengths) <= index < len(self.lengths):
            raise IndexError(index)
        return RawInput(self, index % len(self.lengths))


class RawInput:
    __slots__ = ("raw", "index")

    def __init__(self, raw: RawContents, index: int):
        self.raw, self.index = raw, index

    def __len__(self) -> int:
        return self.raw.lengths[self.index]

    def copy_into(self, destination, width: int) -> bool:
        """Its bytes into `destination` (writable, exactly as long), without the GIL; whether every
        value of `width` bytes is finite (width 0: not checked)."""
        return _native.copy_raw(self.raw.parts, self.index, destination, width)


def _message(message):
    """A message event's payload for the handlers: bytes, or a split one as (bytes without its raw
    contents, them)."""
    if isinstance(message, tuple):
        rest, parts, lengths = message
        return rest, RawContents(parts, lengths)
    return message


class NativeFrontEnd:
    """The running C++ server and the loop's side of it; `await stop(grace)` at shutdown, as
    grpc.aio's."""

    layout = "gRPC on grpc's C++ server (its threads take the calls in; the handlers run on the server's loop)"

    def __init__(
        self,
        address: str,
        handlers: dict,
        service_name: str,
        options: dict[str, int],
        max_calls: int,
        streams,
        split: frozenset[str] = frozenset(),
        first_message_s: float = 30.0,
        counter=None,
    ):
        self.loop = asyncio.get_running_loop()
        # a unary call whose message has not come by then is ended
        self.first_message_s = first_message_s
        # full method name -> (is it a stream, its handler's coroutine function)
        self.methods = {
            f"/{service_name}/{name}": (
                handler.stream_stream is not None,
                handler.stream_stream or handler.unary_unary,
            )
            for name, handler in handlers.items()
        }
        self.streams = streams
        self.calls: dict[int, NativeContext] = {}
        self.unwritten_places = asyncio.Semaphore(UNWRITTEN)
        # peer -> [its CONNECTION_UNWRITTEN semaphore, its calls]
        self.connection_places: dict[str, list] = {}
        # mode per method: 1 a stream (read on credits), 2 its messages split (see RawContents)
        modes = {
            name: int(stream) | (2 if name.rpartition("/")[2] in split else 0)
            for name, (stream, _) in self.methods.items()
        }
        # (`counter`: a front end's int of serving/receiving.py, where its calls still receiving
        # are counted for the engine, instead of in the bridge)
        self.bridge, self.efd = _native.start(address, modes, options, max_calls, counter)
        self.loop.add_reader(self.efd, self._drain)
        self._sweeping = self.loop.call_later(self._sweep_every, self._sweep)

    @property
    def _sweep_every(self) -> float:
        return min(1.0, max(self.first_message_s / 4, 0.05))

    def _sweep(self) -> None:
        """Ends the unary calls still waiting for their request message after --read-timeout: while
        they wait they hold no shared place (native.cc, Slot), and this is what bounds them in time,
        as HTTP's read deadline."""
        ended = _native.sweep(self.bridge, self.first_message_s)
        if ended:
            log.warning(
                "gRPC: ended %d call(s) whose request message did not come within --read-timeout (%g s)",
                ended,
                self.first_message_s,
            )
        self._sweeping = self.loop.call_later(self._sweep_every, self._sweep)

    def _drain(self) -> None:
        for event in _native.drain(self.bridge):
            try:
                self._dispatch(*event)
            except Exception:  # noqa: BLE001
                # one event's failure must not lose the others of the batch
                log.exception("gRPC event %r of call %s failed", event[0], event[1])
                if (call := self.calls.get(event[1])) is not None and call.task is not None:
                    # its call is ended as a cancelled one (native.cc: OnCancel's rule)
                    call.task.cancel()

    def _dispatch(self, kind: int, call_id: int, *rest) -> None:
        if kind == _native.CALL:
            self._begin(call_id, *rest)
            return
        call = self.calls.get(call_id)
        if call is None:
            return
        if kind == _native.READ:
            call.arrived(_message(rest[0]))
        elif kind == _native.WRITTEN:
            call.written(rest[0])
            if call.task is not None and call.task.done():
                self._forget(call)
        elif kind == _native.CANCELLED:
            # the client went away (C++ has ended the call): as grpc.aio, the handler's
            # task is cancelled
            call.ended = True
            if call.task is not None and not call.task.done():
                call.task.cancel()

    def _begin(
        self, call_id: int, method: str, metadata: tuple, message: bytes | None, peer: str
    ) -> None:
        # C++ lets only these through
        stream, handle = self.methods[method]
        places = (self.unwritten_places,)
        # (a unary call's one answer goes with its end: it takes no place)
        if stream:
            entry = self.connection_places.setdefault(
                peer, [asyncio.Semaphore(CONNECTION_UNWRITTEN), 0]
            )
            entry[1] += 1
            places = (entry[0], self.unwritten_places)
        call = NativeContext(self.bridge, call_id, metadata, places, peer)
        self.calls[call_id] = call
        call.task = self.loop.create_task(self._serve(call, handle, _message(message), stream))
        call.task.add_done_callback(lambda _: self._forget(call))

    def _forget(self, call: NativeContext) -> None:
        """When its task is done, and again at each WRITTEN after it."""
        # else kept until its answers are written: their places come back then
        if not call.unwritten:
            if self.calls.pop(call.id, None) is not None and len(call.places) > 1:
                entry = self.connection_places[call.client]
                entry[1] -= 1
                if not entry[1]:
                    del self.connection_places[call.client]
        # a task cancelled before it began (the loop closing): its call still ends
        if not call.finished:
            call.end(grpc.StatusCode.CANCELLED, "the call was cancelled")

    async def _serve(
        self, call: NativeContext, handle, message: bytes | None, stream: bool
    ) -> None:
        """Runs the handler and ends the call as grpc.aio would: the answer (unary) or OK (a
        stream), the abort's status, CANCELLED, or UNKNOWN for a handler's bug (logged)."""
        try:
            result = await handle(message, call)
            if stream:
                call.end(grpc.StatusCode.OK, "")
            else:
                call.answer(result)
        except grpc.aio.AbortError:
            # the status went with the abort
            pass
        except (
            asyncio.CancelledError,
            ConnectionError,
        ):
            # (ConnectionError: a stream's write to a client gone)
            call.end(grpc.StatusCode.CANCELLED, "the call was cancelled")
        except Exception as exc:  # noqa: BLE001
            # as grpc.aio: a handler's bug is UNKNOWN, and logged
            log.exception("gRPC handler failed")
            call.end(
                grpc.StatusCode.UNKNOWN,
                f"Unexpected error in the handler: {type(exc).__name__}: {exc}",
            )

    def receiving(self) -> int:
        """ModelInfer calls begun whose message is not all in yet (counted in C++, read from any
        thread)."""
        return _native.receiving(self.bridge)

    async def stop(self, grace: float | None) -> None:
        """No new calls; those in flight have `grace` seconds (None: none) to finish on the running
        loop, then are cancelled."""
        self.streams.close()
        self._sweeping.cancel()
        stopped = self.loop.create_future()

        # grpc's Shutdown blocks until every call is done: off the loop, which must run them
        def stop() -> None:
            try:
                _native.stop(self.bridge, grace or 0.0)
            finally:
                # the loop closed meanwhile
                with contextlib.suppress(RuntimeError):
                    self.loop.call_soon_threadsafe(
                        lambda: stopped.done() or stopped.set_result(None)
                    )

        # A daemon thread, not the loop's executor: were a call never to end, the process could
        # still exit.
        threading.Thread(target=stop, name="grpc-stop", daemon=True).start()
        try:
            await stopped
        finally:
            # what came in while stopping: the cancelled handlers' tasks end
            self._drain()
            self.loop.remove_reader(self.efd)
