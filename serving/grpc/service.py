"""KServe V2 over gRPC: the protocol's GRPCInferenceService on a second port, a front end of the
server's core.

ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata and ModelInfer, and the
extensions HTTP has: ModelConfig, RepositoryIndex, RepositoryModelLoad/Unload, ModelStatistics (each
serving/extensions.py's one operation, its JSON answer carried as Triton's message of the same field
names) and the six shared-memory RPCs, in the same event loop as the HTTP server. The handlers below
take bytes and give bytes; what carries them is grpc's C++ server (serving/grpc/native.py,
`--grpc-engine native`, the default where it is built) or grpc.aio, and start_grpc picks one. A
ModelInfer request becomes a call of the core's one inference path (serving/core.py: version,
receipt, decode with serving/grpc/codec.py, infer on the same batcher as HTTP, payload log, shadow),
so the protocols share batches, limits, metrics and the payload log. An unmodified
`tritonclient.grpc` client works.

As over HTTP: the bearer token (metadata `authorization: Bearer <token>`) on all but ServerLive and
ServerReady; every client mistake is a 4xx-like status (INVALID_ARGUMENT, NOT_FOUND,
UNAUTHENTICATED, RESOURCE_EXHAUSTED for a message over --max-body-bytes), never INTERNAL; the
receipt (x-request-id, x-model-name, x-model-version, x-model-run-id, x-model-weights-sha256,
x-model-onnx-sha256) comes back as initial metadata, and the response's `id` echoes the request's.

ModelStreamInfer, Triton's bidirectional stream (tritonclient.grpc's
start_stream/async_stream_infer, perf_analyzer --streaming): many ModelInferRequests on one call,
each through the same inference path, answered in the order they came, each as a
ModelStreamInferResponse holding the answer or an `error_message` ("<STATUS>: why"); a refused
request does not end the stream (a message over --max-body-bytes does: grpc's limit holds for the
whole call, before a handler sees it). Why it is there: on grpc.aio a unary call costs about four
event-loop turns and twenty system calls on the loop thread (accept the call, read its message, send
the receipt, send the answer and status, learn it closed), a request on a stream one read and one
write: for a tiny model half the server CPU. On the native engine both cost less than a binary HTTP
request, the stream least (README, "Benchmarks"). The token is checked once, from the stream's
metadata; per-message metadata does not exist in gRPC, so each answer carries its receipt in
`infer_response.parameters` (the same keys and values as the unary call's initial metadata).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from functools import partial

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError

import serving
from serving import core, extensions, image_inputs
from serving.codec import BadRequest
from serving.envelope import Exchange, new_request_id, refusal, source_of
from serving.grpc import codec, schema
from serving.repository import version_key

log = logging.getLogger("serving.grpc")

# The HTTP status each refusal has on the HTTP side -> its gRPC status code.
STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
# health checks: no token, as over HTTP
OPEN = {"ServerLive", "ServerReady"}
# Parsed in a thread above this, two at a time: a message of typed contents (a list of numbers per
# value) is slow to parse; raw bytes cost only a copy, less than a hop to a thread and back
# (docs/benchmarks.md#servinggrpcservicepy).
BIG_MESSAGE = 1 << 20
# Connections: HTTP closes one idle for --read-timeout; gRPC's own options do the same here (a
# GOAWAY and the close: 250 silent connections were all closed 2.2 s after opening with
# --read-timeout 2), and bound what one connection may hold. then a GOAWAY: clients reconnect, so no
# connection is held for ever
MAX_CONNECTION_AGE_S = 3600
# Concurrent RPCs on one connection; a client queues the rest itself. Unbounded, a burst of 2,000 on
# one channel had ~150 of them CANCELLED before reaching the service.
MAX_STREAMS_PER_CONNECTION = 128
# over all connections; past it RESOURCE_EXHAUSTED at once
MAX_CONCURRENT_RPCS = 4096
# Of the stream requests the server holds (MAX_CONCURRENT_RPCS, read and not yet answered), one
# connection's streams may hold this many: a client that does not read its answers stalls its own
# streams, not every other client's.
CONNECTION_SHARE = 512
# Requests of one stream being answered at once. Past it the stream is not read until the oldest is
# answered: HTTP/2 flow control then holds the client back instead of the server queueing for it.
STREAM_WINDOW = 128


def code_of(status: int) -> grpc.StatusCode:
    """The gRPC status of a refusal's HTTP status."""
    return STATUS_CODES.get(
        status, grpc.StatusCode.INVALID_ARGUMENT if status < 500 else grpc.StatusCode.INTERNAL
    )


def label(status: int) -> str:
    return code_of(status).name


class Service:
    """The RPCs, over the HTTP app's Server (its repository, batchers, limits, metrics, payload
    log)."""

    def __init__(self, server):
        self.server = server

    # ---- health and metadata ----

    async def ServerLive(self, request, context):
        return schema.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return schema.ServerReadyResponse(ready=self.server.ready)

    async def ModelReady(self, request, context):
        model = self.server.repository.model(request.name)
        if request.version:
            self.server.model_slot(request.name, request.version)
        return schema.ModelReadyResponse(ready=self.server.model_ready(model))

    async def ServerMetadata(self, request, context):
        return schema.ServerMetadataResponse(
            name="trainserve",
            version=serving.__version__,
            extensions=extensions.extensions(self.server),
        )

    async def ModelMetadata(self, request, context):
        slot = self.server.model_slot(request.name, request.version or None)
        model = self.server.repository.models[slot.model.info.name]
        engine = slot.model.engine
        versions = [slot.version] if request.version else sorted(model.slots, key=version_key)
        response = schema.ModelMetadataResponse(
            name=slot.model.info.name, versions=versions, platform="onnxruntime_onnx"
        )
        inputs = image_inputs.request_inputs(slot.model)
        for specs, field in ((inputs, response.inputs), (engine.outputs, response.outputs)):
            for spec in specs:
                field.add(name=spec.name, datatype=spec.datatype, shape=list(spec.shape))
        return response

    # ---- the extensions: serving/extensions.py's operations, their JSON as Triton's messages ----

    async def ModelConfig(self, request, call: "Call"):
        config = extensions.model_config(self.server, request.name, request.version or None)
        # (fields this schema does not declare are left out: the message is Triton's part we fill
        # in)
        return json_format.ParseDict(
            {"config": config}, schema.ModelConfigResponse(), ignore_unknown_fields=True
        )

    async def ModelStatistics(self, request, call: "Call"):
        report = extensions.statistics(self.server, request.name, request.version or None)
        return json_format.ParseDict(report, schema.ModelStatisticsResponse())

    async def RepositoryIndex(self, request, call: "Call"):
        extensions.check_repository(request.repository_name)
        response = schema.RepositoryIndexResponse()
        for row in await extensions.repository_index(self.server, request.ready):
            response.models.add(**row)
        return response

    async def RepositoryModelLoad(self, request, call: "Call"):
        extensions.check_repository(request.repository_name)
        await extensions.repository_load(self.server, request.model_name, dict(request.parameters))
        return schema.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, call: "Call"):
        extensions.check_repository(request.repository_name)
        await extensions.repository_unload(self.server, request.model_name)
        return schema.RepositoryModelUnloadResponse()

    # ---- inference ----

    async def ModelInfer(self, request, call: "Call"):
        # The shared memory regions the request names are held until it ends (serving/shm.py: Use).
        regions = self.server.shared_memory.use(call.authorization, request.model_name)
        try:
            return await self._model_infer(request, call, regions)
        finally:
            regions.close()

    async def _model_infer(self, request, call: "Call", regions):
        server = self.server
        rid = _request_id(request.id or call.metadata.get("x-request-id"))
        slot = server.model_slot(request.model_name, request.model_version or None)
        # The receipt, with a refusal too, as over HTTP.
        call.exchange.slot, call.exchange.request_id = slot, rid
        engine = slot.model.engine
        arrival = None

        # raw contents the native engine kept: copied straight into the batch they run in
        def place(
            rows: int,
        ):
            nonlocal arrival
            arrival = slot.batcher.arriving(rows)
            return arrival.views

        # typed contents: a list of numbers to convert
        typed = not (request.raw_input_contents or call.raw)
        try:
            decoded = await server.decode(
                partial(
                    codec.decode_infer,
                    request,
                    image_inputs.request_inputs(slot.model),
                    engine.output_names,
                    server.limits,
                    regions.read,
                    call.raw,
                    place,
                ),
                call.size if typed else 0,
            )
            regions.hold(decoded.output_refs)
            if arrival is not None:
                arrival.checked, arrival.filled = decoded.checked, decoded.placed
            answer = await server.answer(
                slot,
                decoded,
                call.exchange,
                endpoint=call.endpoint,
                follow_swap=not request.model_version,
                arrival=arrival,
            )
        finally:
            if arrival is not None:
                # (queued: ended already; refused: its place freed)
                arrival.end()
        placed = regions.write(decoded.output_refs, answer.results) if decoded.output_refs else None
        info = answer.slot.model.info
        return codec.encode_infer(
            info.name,
            info.version,
            request.id or None,
            answer.results,
            decoded.outputs,
            answer.slot.model.engine.outputs,
            placed,
        )

    def call(self, method: str):
        """The coroutine that answers `method`: one of the methods above, or a shared-memory RPC."""
        found = getattr(self, method, None)
        return found if found is not None else self.shared_memory[method]

    @functools.cached_property
    def shared_memory(self) -> dict:
        """Triton's shared-memory RPCs, {System,Cuda}SharedMemory{Status,Register,Unregister}
        (serving/shm.py does the work), built in one loop as routes.py builds their HTTP routes."""
        calls = {}
        for kind, fields in SHM_FIELDS.items():
            rpc = f"{kind.capitalize()}SharedMemory"
            calls |= {
                rpc + "Status": partial(
                    _shm_status, self.server, kind, schema.METHODS[rpc + "Status"][1]
                ),
                rpc + "Register": partial(
                    _shm_register, self.server, kind, fields, schema.METHODS[rpc + "Register"][1]
                ),
                rpc + "Unregister": partial(
                    _shm_unregister, self.server, kind, schema.METHODS[rpc + "Unregister"][1]
                ),
            }
        return calls


# A region's description in each kind's Register message (after its name): what serving/shm.py
# registers.
SHM_FIELDS = {
    "system": ("key", "offset", "byte_size"),
    "cuda": ("raw_handle", "device_id", "byte_size"),
}


async def _shm_status(server, kind: str, response, request, call: "Call"):
    return _regions(
        response(), server.shared_memory.status(call.authorization, kind, request.name or None)
    )


async def _shm_register(
    server, kind: str, fields: tuple[str, ...], response, request, call: "Call"
):
    server.shared_memory.register(
        call.authorization, kind, request.name, **{f: getattr(request, f) for f in fields}
    )
    return response()


async def _shm_unregister(server, kind: str, response, request, call: "Call"):
    server.shared_memory.unregister(call.authorization, kind, request.name or None)
    return response()


def _regions(response, regions: list[dict]):
    for region in regions:
        entry = response.regions[region["name"]]
        for key, value in region.items():
            setattr(entry, key, value)
    return response


def _request_id(given: str | None) -> str:
    return new_request_id() if not given else core.check_request_id(given, "the request id")


class Call:
    """What a handler learns about its call (metadata in, its envelope's Exchange), whichever engine
    carries it."""

    __slots__ = ("metadata", "size", "endpoint", "exchange", "raw")

    def __init__(
        self,
        metadata: dict[str, str],
        size: int,
        exchange: Exchange,
        endpoint: str = "grpc ModelInfer",
        raw=None,
    ):
        self.metadata = metadata
        # of the message on the wire
        self.size = size
        # as the payload log names it
        self.endpoint = endpoint
        self.exchange = exchange
        # raw_input_contents handed over apart from the message (native engine), else None
        self.raw = raw

    @property
    def authorization(self) -> str:
        return self.metadata.get("authorization", "")

    @property
    def receipt(self) -> tuple[tuple[str, str], ...]:
        return tuple((k.lower(), v) for k, v in self.exchange.receipt.items())


def _metadata(context) -> dict[str, str]:
    """The call's metadata, keys in lower case (binary `-bin` values left out)."""
    return {k.lower(): v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


def _parse(request_class, data: bytes):
    """The message, or INVALID_ARGUMENT (not INTERNAL) for bytes that are not one."""
    if request_class is schema.ModelInferRequest:
        # before any message is built: their count is the cost
        codec.check_field_count(data)
    try:
        return request_class.FromString(data)
    except DecodeError as exc:
        raise BadRequest(
            f"the message is not a valid inference.{request_class.__name__}: {exc}"
        ) from None


async def _parsed(server, request_class, data: bytes):
    if len(data) <= BIG_MESSAGE:
        return _parse(request_class, data)
    # as an HTTP body: parsed in a thread, two at a time, never on the event loop
    return await asyncio.to_thread(server.in_turn, _parse, request_class, data)


def _handler(server, service: Service, method: str, request_class):
    """One RPC in its envelope: bytes in (parsed here, so a malformed message is INVALID_ARGUMENT,
    not INTERNAL), the token, every failure its status, the receipt as initial metadata, the
    metrics."""
    call = service.call(method)
    where = f"gRPC {method}"

    async def handle(data, context):
        exchange = Exchange(f"grpc {method}", source_of(context.peer()))
        raw = None
        # the native engine: (the message without its raw contents, the contents)
        if isinstance(data, tuple):
            data, raw = data
        info = Call(
            _metadata(context), len(data) + sum(len(r) for r in raw or ()), exchange, raw=raw
        )
        status, response = 200, None
        try:
            if method not in OPEN:
                server.auth.check(info.authorization)
            request = await _parsed(server, request_class, data)
            response = await call(request, info)
        except Exception as exc:  # noqa: BLE001
            # every failure becomes a status; ours are logged
            found = refusal(exc, where, log, label)
            status, message = found.status, found.message
        if exchange.receipt:
            await context.send_initial_metadata(info.receipt)
        exchange.finish(server.metrics, "OK" if status == 200 else label(status))
        if response is None:
            await context.abort(code_of(status), message)
        return response.SerializeToString()

    # no (de)serializers: bytes in and out
    return grpc.unary_unary_rpc_method_handler(handle)


class _Streams:
    """The open ModelStreamInfer streams' readers, so that a stop ends their reading (see stop)."""

    def __init__(self):
        self.readers: set[asyncio.Task] = set()
        self.closing = False

    def close(self) -> None:
        self.closing = True
        # a cancelled reader leaves the set (its done callback) later
        for reader in list(self.readers):
            reader.cancel()


def _retrieve(task: asyncio.Future) -> None:
    """A done callback: a stream's reader that nobody awaits any more (the client went away) still
    has its error looked at."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("a stream task ended with %r after its stream", task.exception())


def _stream_handler(server, service: Service, streams: _Streams):
    """ModelStreamInfer (see the module's docstring): a reader task takes requests off the stream
    and starts each one's answer; this handler writes the answers in the order the requests came. A
    request holds a place of its stream's window (STREAM_WINDOW) from before it is read until its
    answer is written, and one of the server's (MAX_CONCURRENT_RPCS, shared by every stream) and of
    its connection's (CONNECTION_SHARE) from when it is read: the reader waits for all three, so a
    stream whose answers are not taken holds its client back (one connection at most an eighth of
    the server's), and all streams together hold at most as many requests as the server takes unary
    calls. ("Written" is when the transport took the answer: grpc.aio's one write at a time; on the
    native engine each stream also has up to native.READ_AHEAD requests read ahead of this handler
    and native.WRITE_AHEAD answers queued, and all streams at most native.UNWRITTEN of those.) At
    shutdown the readers stop: what was read is answered, then the stream ends with UNAVAILABLE, so
    that the client knows to send the rest elsewhere."""
    route = "grpc ModelStreamInfer"
    everywhere = asyncio.Semaphore(MAX_CONCURRENT_RPCS)
    # a connection (peer) -> [its CONNECTION_SHARE semaphore, its open streams]
    shares: dict[str, list] = {}

    def share_of(peer: str) -> asyncio.Semaphore:
        entry = shares.setdefault(peer, [asyncio.Semaphore(CONNECTION_SHARE), 0])
        entry[1] += 1
        return entry[0]

    def leave_share(peer: str) -> None:
        entry = shares[peer]
        entry[1] -= 1
        if not entry[1]:
            del shares[peer]

    async def answer(data, metadata: dict[str, str], source: str) -> bytes:
        exchange = Exchange(route, source)
        raw = None
        # the native engine: (the message without its raw contents, the contents)
        if isinstance(data, tuple):
            data, raw = data
        info = Call(
            metadata, len(data) + sum(len(r) for r in raw or ()), exchange, endpoint=route, raw=raw
        )
        status, request = 200, None
        try:
            request = await _parsed(server, schema.ModelInferRequest, data)
            message = schema.ModelStreamInferResponse(
                infer_response=await service.ModelInfer(request, info)
            )
        except Exception as exc:  # noqa: BLE001
            # a refused request is answered; the stream goes on
            found = refusal(exc, "gRPC ModelStreamInfer", log, label)
            status = found.status
            message = schema.ModelStreamInferResponse(
                error_message=f"{label(status)}: {found.message}"
            )
            # what the client needs to tell which request it was
            if request is not None:
                message.infer_response.model_name = request.model_name
                message.infer_response.model_version = request.model_version
                message.infer_response.id = request.id
        # with a refusal too, once the version was chosen, as unary
        for key, value in info.receipt:
            message.infer_response.parameters[key].string_param = value
        exchange.finish(server.metrics, "OK" if status == 200 else label(status))
        return message.SerializeToString()

    async def read(
        context,
        metadata: dict[str, str],
        answers: asyncio.Queue,
        window: asyncio.Semaphore,
        share: asyncio.Semaphore,
    ) -> bool:
        """Starts each request's answer, in order, and queues it; None last. True when a stop cut
        the reading short (the client's further requests were not read)."""
        cut = False
        source = source_of(context.peer())
        try:
            while True:
                await window.acquire()
                try:
                    data = await context.read()
                    if data is grpc.aio.EOF:
                        window.release()
                        break
                    await share.acquire()
                    try:
                        await everywhere.acquire()
                    except BaseException:
                        share.release()
                        raise
                except BaseException:
                    window.release()
                    raise
                # No await between starting the answer and queueing it: a cancelled reader loses
                # none. (An answer ends with bytes, a refusal too: nothing for a done callback to
                # look at.)
                answers.put_nowait(asyncio.ensure_future(answer(data, metadata, source)))
        except asyncio.CancelledError:
            if not streams.closing:
                raise
            cut = True
        finally:
            answers.put_nowait(None)
        return cut

    async def handle(unused_requests, context: grpc.aio.ServicerContext):
        metadata = _metadata(context)
        # one id for many requests would not be an id: each gets its own
        metadata.pop("x-request-id", None)
        try:
            server.auth.check(metadata.get("authorization", ""))
        except Exception as exc:  # noqa: BLE001
            # the stream is refused as a whole
            found = refusal(exc, "gRPC ModelStreamInfer", log, label)
            Exchange(route).finish(server.metrics, label(found.status))
            await context.abort(code_of(found.status), found.message)
        if streams.closing:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "the server is shutting down; open the stream elsewhere",
            )
        # bounded by the window
        answers: asyncio.Queue = asyncio.Queue()
        window = asyncio.Semaphore(STREAM_WINDOW)
        peer = context.peer()
        share = share_of(peer)
        reader = asyncio.ensure_future(read(context, metadata, answers, window, share))
        reader.add_done_callback(_retrieve)
        streams.readers.add(reader)
        reader.add_done_callback(streams.readers.discard)
        try:
            while (answering := await answers.get()) is not None:
                try:
                    await context.write(await answering)
                finally:
                    window.release()
                    share.release()
                    everywhere.release()
            cut = await reader
        finally:
            # also when the client went away: nothing more to answer
            reader.cancel()
            while not answers.empty():
                if (left := answers.get_nowait()) is not None:
                    left.cancel()
                    window.release()
                    share.release()
                    everywhere.release()
            leave_share(peer)
        if cut:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "the server is shutting down: every request it read on "
                "this stream was answered; send the rest on a stream to another server",
            )

    # no (de)serializers: bytes in and out
    return grpc.stream_stream_rpc_method_handler(handle)


class _Admission:
    """grpc.aio's side of what native.cc does before a call reaches the handlers above. grpc.aio's
    own `maximum_concurrent_rpcs` counts a call from its headers: 33 connections x 128 calls that
    sent headers and no message (no token needed) held all of its places, ServerLive's included, for
    as long as they lived (the review's F1). Here a unary call is taken in as a client stream, so
    that it is seen at once: it waits at most --read-timeout for its message, holding no shared
    place while it waits (grpc's max_concurrent_streams bounds such calls per connection), and takes
    one of MAX_CONCURRENT_RPCS only with its message in; a stream takes its place at once, as on the
    native engine (its token is checked before it reads)."""

    def __init__(self, first_message_s: float):
        self.first_message_s = first_message_s
        self.active = 0
        # calls ended for want of a message, not yet logged (one line a second, not one a call)
        self.ended = 0

    def take(self) -> bool:
        if self.active >= MAX_CONCURRENT_RPCS:
            return False
        self.active += 1
        return True

    def release(self) -> None:
        self.active -= 1

    def _log_ended(self) -> None:
        log.warning(
            "gRPC: ended %d call(s) whose request message did not come within --read-timeout (%g s)",
            self.ended,
            self.first_message_s,
        )
        self.ended = 0

    async def first_message(self, context) -> bytes:
        """The unary call's one message, or the call ended with the status that says why."""
        try:
            data = await asyncio.wait_for(context.read(), self.first_message_s)
        except asyncio.TimeoutError:
            if not self.ended:
                asyncio.get_running_loop().call_later(1.0, self._log_ended)
            self.ended += 1
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED, "no request message within --read-timeout"
            )
        if data is grpc.aio.EOF:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "the call ended without its request message"
            )
        return data

    def unary(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        handle = handler.unary_unary

        async def admitted(_requests, context):
            data = await self.first_message(context)
            if not self.take():
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "the server has as many calls as it takes at once",
                )
            try:
                return await handle(data, context)
            finally:
                self.release()

        return grpc.stream_unary_rpc_method_handler(admitted)

    def stream(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        handle = handler.stream_stream

        async def admitted(requests, context):
            if not self.take():
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "the server has as many calls as it takes at once",
                )
            try:
                await handle(requests, context)
            finally:
                self.release()

        return grpc.stream_stream_rpc_method_handler(admitted)


class GrpcFrontEnd:
    """The running grpc.aio server, as the core stops it: the streams' reading first, then the
    server."""

    layout = "gRPC on grpc.aio (on the server's loop)"

    def __init__(self, aio: grpc.aio.Server, streams: _Streams):
        self.aio, self.streams = aio, streams

    def receiving(self) -> int:
        """ModelInfer messages on their way: none that this engine shows (it hands a call over with
        its message)."""
        return 0

    async def stop(self, grace: float | None) -> None:
        self.streams.close()
        await self.aio.stop(grace)


def _options(settings, shared_port: bool = False) -> dict[str, int]:
    """grpc's channel arguments for the server, the same for either engine."""
    idle_ms = int(settings.read_timeout * 1000)
    return {
        # past it: RESOURCE_EXHAUSTED
        "grpc.max_receive_message_length": settings.max_body_bytes,
        "grpc.max_send_message_length": -1,
        # a port another process holds is an error, not shared, but among front-end processes
        "grpc.so_reuseport": int(shared_port),
        # Without these a silent client keeps a connection (a file descriptor) for ever: 20,000 of
        # them took every descriptor, HTTP's included. Idle = no RPC in flight, as HTTP's
        # --read-timeout.
        "grpc.max_connection_idle_ms": idle_ms,
        # one that never finishes its HTTP/2 handshake
        "grpc.server_handshake_timeout_ms": idle_ms,
        "grpc.max_connection_age_ms": MAX_CONNECTION_AGE_S * 1000,
        # in-flight RPCs finish
        "grpc.max_connection_age_grace_ms": int(settings.graceful_timeout * 1000),
        "grpc.max_concurrent_streams": MAX_STREAMS_PER_CONNECTION,
    }


async def start_grpc(
    server, service: Service | None = None, shared_port: bool = False, counter=None
):
    """The gRPC server on --host:--grpc-port, started on the engine --grpc-engine picks
    (serving/grpc/native.py: grpc's C++ server; or grpc.aio), both running the handlers above (of
    `service`, default Service(server)); `await it.stop(grace)` at shutdown. OSError if the port
    cannot be bound. `shared_port`: other processes serve it too (front ends, SO_REUSEPORT);
    `counter`: where grpc's C++ server counts the calls it is receiving (a front end's int of
    serving/receiving.py; grpc.aio counts none)."""
    from serving.grpc import native

    settings = server.settings
    service = service or Service(server)
    handlers = {
        method: _handler(server, service, method, request_class)
        for method, (request_class, _) in schema.METHODS.items()
    }
    streams = _Streams()
    handlers["ModelStreamInfer"] = _stream_handler(server, service, streams)
    address = (
        f"[{settings.host}]:{settings.grpc_port}"
        if ":" in settings.host
        else f"{settings.host}:{settings.grpc_port}"
    )
    if settings.grpc_engine == "native" or (settings.grpc_engine == "auto" and native.available()):
        # grpc's resource quota (native.cc): what unfinished messages may hold in all, by anyone,
        # token or not
        quota = {"trainserve-memory-quota": settings.grpc_memory()}
        front_end = native.NativeFrontEnd(
            address,
            handlers,
            schema.SERVICE,
            _options(settings, shared_port) | quota,
            MAX_CONCURRENT_RPCS,
            streams,
            split=frozenset({"ModelInfer", "ModelStreamInfer"}),
            first_message_s=settings.read_timeout,
            counter=counter,
        )
        log.info("KServe V2 gRPC on %s (grpc's C++ server)", address)
        return front_end
    if settings.grpc_engine == "auto":
        log.info("gRPC on grpc.aio: %s", native.WHY_NOT)
    admission = _Admission(settings.read_timeout)
    admitted = {
        method: admission.stream(h) if h.stream_stream else admission.unary(h)
        for method, h in handlers.items()
    }
    # (no maximum_concurrent_rpcs: see _Admission)
    aio = grpc.aio.server(options=list(_options(settings, shared_port).items()))
    aio.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(schema.SERVICE, admitted),))
    try:
        bound = aio.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"cannot serve gRPC on {address}: {exc}") from None
    if not bound:
        raise OSError(
            f"cannot serve gRPC on {address}: the port is taken or the address is not this machine's"
        )
    await aio.start()
    log.info("KServe V2 gRPC on %s (grpc.aio)", address)
    return GrpcFrontEnd(aio, streams)
