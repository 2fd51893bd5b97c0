"""A front-end process: takes HTTP and gRPC requests in for the engine's process that started it
(serving/front_ends.py), on the same ports as its sibling front ends (SO_REUSEPORT), with the code
one process runs (serving/http/, serving/grpc/). It imports no onnxruntime and runs no model.

    python -m serving.front_end_process CHANNEL SIDE ENGINE_PID    (its engine starts it)

What it does itself, for an inference request (V2 over HTTP, binary or JSON; /invocations; gRPC
ModelInfer, unary or on a stream): the checks on its head (Host, Origin, token, sizes, the model
named), the body received straight into its place in the version's batch rows (serving/arena.py:
reserved here, under the arena's lock) or decoded and copied there, the NaN/Inf check, then one
SUBMIT record to the engine (serving/channel.py); the ANSWER comes back with the outputs and the
receipt, and it encodes the response. Where no place is to be had (every buffer taken, a version
whose rows vary), the tensors follow the record.

What it hands the engine whole (FORWARD, answered with REPLY): everything else, which is rare and
small: metadata, readiness, configuration, statistics, the repository API, /metrics (the engine
adds every front end's counts to its own), the shadow and labels, the shared-memory registry, and
an inference request that names a shared-memory region (the engine reads and writes regions, so a
region registered through one front end serves all of them).

What it is told (VERSIONS, at start and after every load, unload and alias move): the models, each
version's inputs, outputs and receipt, and each version's arena, whose descriptor comes over the
side socket. A version that goes keeps its rows here until this process lets go of them.

It is started not knowing its number: the engine keeps one started as a spare (serving/processes.py)
and tells it its number with its settings (SETUP) when it takes a dead front end's place.

It dies with its engine: the kernel kills it when the engine's process ends (PR_SET_PDEATHSIG), and
it exits when its channel closes. DRAIN, SIGTERM or SIGINT: it stops accepting, answers what is in
flight (up to --graceful-timeout) and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import os
import signal
import socket
import struct
import sys
import threading
from dataclasses import replace
from functools import partial

import numpy as np

from serving import arena, channel, core
from serving.codec import Limits
from serving.config import Settings
from serving.engine import TensorSpec
from serving.envelope import Auth, Refused
from serving.http import routes
from serving.http.wire import Response
from serving.metrics import Metrics
from serving.placements import Arrival, Placements
from serving.receiving import ReceivingCounts
from serving.staging import NonFinite, check_finite, copy_finite

log = logging.getLogger("serving.front_end")
# past --request-timeout, what the front end waits more for the engine's own 504
ANSWER_GRACE_S = 5.0
# SUBMIT's fixed fields: number, version key, buffer, place, ticket, rows, flags
SUBMIT = struct.Struct("<IIiIQIB")
PLACED, COUNTED, INLINE, FOLLOW_SWAP = 1, 2, 4, 8
# ENDED's: version key, counted, buffer, place, ticket
ENDED = struct.Struct("<IBiIQ")
# ANSWER's and REFUSED's: number, status, the answering version's key
REPLIED = struct.Struct("<IHI")


class Elsewhere(Exception):
    """The request names a shared-memory region: the engine answers it whole (FORWARD)."""


def die_with(engine: int) -> None:
    """SIGKILL when the engine's process ends (Linux); gone already: exit now."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != engine:
        os._exit(1)


def settings_of(fields: dict) -> Settings:
    """Settings from their JSON form (serving/front_ends.py: settings_json)."""
    kinds = {f.name: f.type for f in dataclasses.fields(Settings)}
    return Settings(
        **{
            key: tuple(value) if isinstance(value, list) else value
            for key, value in fields.items()
            if key in kinds
        }
    )


# ---- the engine's versions, as a front end sees them ------------------------------------------


class Engine:
    """What the front ends read of a version's engine (serving/engine.py's Engine): its inputs and
    outputs, and whether its requests share runs."""

    def __init__(self, described: dict):
        self.inputs = [spec_of(s) for s in described["inputs"]]
        self.outputs = [spec_of(s) for s in described["outputs"]]
        self.output_names = [spec.name for spec in self.outputs]
        self.batchable = described["batchable"]


def spec_of(described: list) -> TensorSpec:
    name, dtype, datatype, shape, batched, ranked = described
    return TensorSpec(name, np.dtype(dtype), datatype, tuple(shape), batched, ranked)


class Info:
    """What the front ends read of a version's ModelInfo (serving/loader.py)."""

    def __init__(self, described: dict):
        self.name, self.version = described["name"], described["version"]
        self.source = described["source"]
        self.lineage = described["lineage"]
        self.labels = tuple(described["labels"]) if described["labels"] is not None else None
        self.max_lengths = {
            name: {int(axis): n for axis, n in axes.items()}
            for name, axes in (described["max_lengths"] or {}).items()
        }


class Model:
    """A version's model: its engine's specs and its info. A version that takes image files
    (`takes_images`) has its inference requests answered whole by the engine, which decodes them:
    here it takes none (`images`, as serving/image_inputs.py reads it)."""

    def __init__(self, described: dict):
        self.engine, self.info = Engine(described), Info(described)
        self.images = None
        self.takes_images = described["images"]


class Rows:
    """A version's batch rows as a front end has them (serving/arena.py), in the part of the
    batcher's interface the front ends call (Batcher.arriving, place), and the engine told when an
    arrival goes no further (ENDED). Without an arena (a version whose rows vary in size, or that
    runs each request alone) nothing is counted or placed: its requests' tensors follow their
    SUBMIT."""

    def __init__(self, remote: Remote, key: int, placements: Placements | None):
        self.remote, self.key, self.placements = remote, key, placements

    @property
    def buffers(self):
        return self.placements.buffers if self.placements is not None else None

    def arriving(self, rows: int | None = None) -> Arrival:
        if self.placements is None:
            arrival = Arrival(self, self.remote.owner, None)
            # (counted nowhere: nothing for the engine to forget)
            arrival.over = True
            return arrival
        return self.placements.arriving(self, rows)

    def place(self, arrival: Arrival, rows: int):
        if self.placements is None:
            return None
        return self.placements.place(arrival, rows)

    def ended(self, arrival: Arrival) -> None:
        """An arrival that goes no further: the engine forgets it and kills its place."""
        if arrival.over:
            return
        arrival.over = True
        place = arrival.place
        index, k, ticket = (place.group.index, place.k, place.ticket) if place else (-1, 0, 0)
        self.remote.channel.send(channel.ENDED, ENDED.pack(self.key, 1, index, k, ticket))


class Slot:
    """A loaded version as the front ends use one (serving/repository.py's Slot): its model, its
    rows, its receipt's headers; `key`, the engine's number for it."""

    def __init__(self, remote: Remote, described: dict, placements: Placements | None):
        self.key = described["key"]
        self.model = Model(described)
        self.batcher = Rows(remote, self.key, placements)
        self.headers = described["headers"]
        self.source = described["source"]

    @property
    def version(self) -> str:
        return self.model.info.version


# ---- the server, as the front ends call it ----------------------------------------------------


class Remote:
    """The Server (serving/core.py) as this process's HTTP and gRPC code call it: what a request
    needs decided here (its version, its limits, its token) is here; the rest is a record to the
    engine and its answer."""

    # written once, in core: the decoders of big bodies in a thread, two at a time
    decode = core.Server.decode
    in_turn = core.Server.in_turn

    def __init__(self, owner: int, side: socket.socket):
        self.owner, self.side = owner, side
        self.channel = channel.Channel(self._record, self._lost)
        loop = asyncio.get_running_loop()
        self.set_up: asyncio.Future = loop.create_future()
        self.drained = asyncio.Event()
        self.settings: Settings | None = None
        self.metrics = Metrics(queue_rows=lambda: [])
        self.decoding = threading.BoundedSemaphore(2)
        self.shared_memory = NoRegions()
        self.listening: list = []
        self.slots: dict[int, Slot] = {}
        self.models: dict[str, dict] = {}
        self.default_model: str | None = None
        self.described = "no models"
        # the gRPC calls this process is receiving, counted where the engine reads them (SETUP)
        self.receiving: ReceivingCounts | None = None
        self._waiting: dict[int, asyncio.Future] = {}
        self._number = 0
        # the versions' rows this turn handed requests of over (Placements.turn_begun)
        self._turns: set[Placements] = set()
        self.channel.before_flush = self._turn_over

    # ---- from the engine ----

    def _record(self, kind: int, fields: memoryview) -> None:
        if kind in (channel.ANSWER, channel.REFUSED, channel.REPLY):
            number = struct.unpack_from("<I", fields)[0]
            waiting = self._waiting.pop(number, None)
            if waiting is not None and not waiting.done():
                waiting.set_result((kind, bytes(fields)))
        elif kind == channel.SETUP:
            setup = channel.unjson(fields)
            self.owner = setup["owner"]
            self.settings = settings_of(setup["settings"])
            log_as(self.owner, self.settings.log_level)
            self.auth = Auth(self.settings.tokens(), self.settings.feedback_token)
            self.limits = Limits(self.settings.max_rows_per_request, self.settings.max_body_bytes)
            # the versions' new arenas, then the gRPC calls' counts (serving/receiving.py)
            fds = arena.receive(self.side)
            self.receiving = ReceivingCounts.open(fds.pop())
            # (the mapping stays; the descriptor is not needed past it, as an arena's)
            self.receiving.close()
            self._versions(setup["versions"], fds)
            self.set_up.set_result(None)
        elif kind == channel.VERSIONS:
            table = channel.unjson(fields)
            self._versions(table, arena.receive(self.side) if table["arenas"] else [])
        elif kind == channel.ASK_METRICS:
            number = struct.unpack_from("<I", fields)[0]
            self.channel.send(channel.METRICS, struct.pack("<I", number), self.metrics.render())
        elif kind == channel.DRAIN:
            self.drained.set()

    def _versions(self, table: dict, fds: list[int]) -> None:
        """The engine's models now: each version's rows mapped (new ones' descriptors, from the
        side socket, in the table's order), those gone let go."""
        slots = {}
        for described in table["versions"]:
            slot = self.slots.get(described["key"])
            if slot is None:
                placements = None
                if described["arena"] is not None:
                    rows = arena.Arena.open(fds[described["arena"]], described["layout"])
                    # (the mapping stays; the descriptor is not needed past it)
                    rows.close()
                    placements = rows.placements(described["capacity"], owner=self.owner)
                slot = Slot(self, described, placements)
            slots[slot.key] = slot
        self.slots = slots
        self.models = table["models"]
        self.default_model = table["default_model"]
        self.described = table["described"]

    def _turn_over(self) -> None:
        """The turn's records are about to be written: the engine may take its batches."""
        for placements in self._turns:
            placements.turn_over()
        self._turns.clear()

    def _lost(self, exc) -> None:
        """The engine is gone: nothing here can be answered any more."""
        log.error("front end %d: the engine's channel closed; exiting", self.owner)
        os._exit(70)

    # ---- the versions ----

    def model_slot(self, name: str, version: str | None) -> Slot:
        """As Repository.slot, in its words."""
        model = self.models.get(name)
        if model is None:
            raise Refused(404, f"unknown model '{name[:128]}'; this server has {self.described}")
        if version is None:
            key = model["default"]
            if key is None:
                raise Refused(
                    404,
                    f"model '{name}' is {model['state'].lower()} ({model['reason']}); load it "
                    f"with POST /v2/repository/models/{name}/load",
                )
            return self.slots[key]
        key = model["versions"].get(version)
        if key is None:
            loaded = ", ".join(model["versions"]) or "none"
            raise Refused(
                404, f"model '{name}' has no version {version[:40]} loaded (loaded: {loaded})"
            )
        return self.slots[key]

    def takes_images(self, name: str, version: str | None) -> bool:
        """Whether the version named takes image files (False where none is found: the inference
        path refuses it)."""
        try:
            return self.model_slot(name, version).model.takes_images
        except Refused:
            return False

    def invocations_slot(self) -> Slot:
        try:
            return self.model_slot(self.default_model or "", None)
        except Refused as exc:
            raise Refused(exc.status, f"/invocations serves the default model: {exc}") from None

    def incoming(self) -> int:
        return 0

    # ---- the one inference path, through the engine ----

    async def answer(
        self, slot: Slot, request, exchange, *, endpoint: str, follow_swap: bool, arrival=None
    ) -> core.Answer:
        """Server.answer, its run in the engine's process: the request's rows put in its place
        (copied there if it was not received into one), one SUBMIT, and its ANSWER as the Answer
        (or its refusal raised)."""
        rows, feeds = request.rows, request.feeds
        batcher = slot.batcher
        if arrival is None or arrival.over and arrival.place is None:
            arrival = batcher.arriving()
        place = None if arrival.over else arrival.place
        try:
            if place is None and not arrival.over and _fits(batcher.buffers, feeds, rows):
                if batcher.place(arrival, rows) is not None:
                    place = arrival.place
                    _copy_checked(place.views, feeds)
                    arrival.filled = arrival.checked = True
            elif place is not None and not arrival.filled:
                _copy_checked(place.views, feeds)
                arrival.filled = arrival.checked = True
            elif place is not None and not arrival.checked:
                check_finite(place.views)
        except NonFinite as exc:
            raise Refused(400, str(exc)) from None
        flags = FOLLOW_SWAP if follow_swap else 0
        if not arrival.over:
            flags |= COUNTED
        if place is not None:
            flags |= PLACED
            index, k, ticket = place.group.index, place.k, place.ticket
        else:
            flags |= INLINE
            index, k, ticket = -1, 0, 0
        self._number = number = (self._number + 1) & 0xFFFFFFFF
        classification = getattr(request, "classification", None)
        parts = [
            SUBMIT.pack(number, slot.key, index, k, ticket, rows, flags),
            channel.text(exchange.request_id or ""),
            channel.text(getattr(request, "request_id", None) or ""),
            channel.text(endpoint),
            channel.text(exchange.source),
            *channel.blob(channel.json(classification) if classification else b""),
        ]
        if flags & INLINE:
            parts += channel.tensors(feeds)
        waiting = self._waiting[number] = asyncio.get_running_loop().create_future()
        self.channel.send(channel.SUBMIT, *parts)
        placements = batcher.placements
        if placements is not None and placements not in self._turns:
            placements.turn_begun()
            self._turns.add(placements)
        # the engine forgets it now
        arrival.over = True
        try:
            async with asyncio.timeout(self.settings.request_timeout + ANSWER_GRACE_S):
                kind, data = await waiting
        except TimeoutError:
            self._waiting.pop(number, None)
            raise Refused(
                504, f"no answer within {self.settings.request_timeout:g} s (--request-timeout)"
            ) from None
        reader = channel.Reader(memoryview(data))
        _, status, key = reader.take(REPLIED)
        exchange.request_id, exchange.server_id = reader.text() or None, reader.text() or None
        if kind == channel.ANSWER:
            exchange.warning = reader.text() or None
        answered = self.slots.get(key, slot)
        if answered is not slot:
            exchange.slot = answered
        if kind == channel.REFUSED:
            message, headers = reader.text(), channel.unjson(reader.blob())
            raise Refused(status, message, headers or None)
        results = reader.tensors()
        return core.Answer(answered, request, exchange, endpoint, feeds, (), results)

    # ---- what the engine answers whole ----

    async def forward(
        self, kind: str, head: dict, body: bytes, exchange
    ) -> tuple[int, dict, bytes]:
        """A request the engine answers whole: (status, what it said of it, its body). The receipt
        it gave is set on `exchange`."""
        self._number = number = (self._number + 1) & 0xFFFFFFFF
        waiting = self._waiting[number] = asyncio.get_running_loop().create_future()
        head = {"kind": kind, "source": exchange.source, **head}
        self.channel.send(
            channel.FORWARD,
            struct.pack("<I", number),
            *channel.blob(channel.json(head)),
            *channel.blob(body),
        )
        try:
            async with asyncio.timeout(self.settings.request_timeout + ANSWER_GRACE_S):
                _, data = await waiting
        except TimeoutError:
            self._waiting.pop(number, None)
            raise Refused(504, "the engine did not answer in time") from None
        reader = channel.Reader(memoryview(data))
        _, status, key = reader.take(REPLIED)
        said = channel.unjson(reader.blob())
        exchange.slot = self.slots.get(key, exchange.slot)
        exchange.request_id = said.get("request_id") or exchange.request_id
        exchange.server_id = said.get("server_id") or exchange.server_id
        exchange.warning = said.get("warning") or exchange.warning
        return status, said, bytes(reader.blob())


class NoRegions:
    """The shared-memory registry as the front ends' inference path reads it: a request that names
    a region is the engine's to answer (Elsewhere), as are the registry's own routes."""

    def use(self, authorization: str, model: str = "") -> NoRegions:
        return self

    def read(self, *args, **kwargs):
        raise Elsewhere()

    def hold(self, refs) -> None:
        if refs:
            raise Elsewhere()

    def write(self, refs, results):
        raise Elsewhere()

    def close(self) -> None:
        pass


def _fits(buffers, feeds, rows: int) -> bool:
    return buffers is not None and buffers.fits(feeds, rows)


def _copy_checked(views: dict, feeds: dict) -> None:
    """A request's feeds into its place, checked for NaN and Inf as they are copied."""
    for name, x in feeds.items():
        if not copy_finite(views[name], x):
            raise NonFinite(name)


# ---- the route tables: what is answered here, what the engine answers ----------------------------


async def forward_http(remote: Remote, request, exchange) -> Response:
    """A request the engine answers whole (see the module's docstring)."""
    head = {
        "method": request.method,
        "path": request.path,
        "query": request.query,
        "headers": request.headers,
    }
    body = request.body if isinstance(request.body, bytes) else b""
    status, said, payload = await remote.forward("http", head, body, exchange)
    return Response(status, payload, said.get("content_type"), said.get("headers") or {})


def v2_body(remote: Remote, request, exchange, length: int, chunked: bool):
    """routes.v2_body, or the body whole for a version that takes image files (the engine answers
    its requests whole)."""
    slot = remote.model_slot(request.params["name"], request.params.get("version"))
    if slot.model.takes_images:
        exchange.slot = slot
        return routes.whole_body(remote, request, exchange, length, chunked)
    return routes.v2_body(remote, request, exchange, length, chunked)


def invocations_body(remote: Remote, request, exchange, length: int, chunked: bool):
    """routes.invocations_body, or the body whole for a version that takes image files."""
    slot = remote.invocations_slot()
    if slot.model.takes_images:
        exchange.slot = slot
        return routes.whole_body(remote, request, exchange, length, chunked)
    return routes.invocations_body(remote, request, exchange, length, chunked)


async def invocations(remote: Remote, request, exchange) -> Response:
    """routes.invocations here, or at the engine for a version that takes image files."""
    if exchange.slot.model.takes_images:
        return await forward_http(remote, request, exchange)
    return await routes.invocations(remote, request, exchange)


async def v2_infer(remote: Remote, request, exchange) -> Response:
    """routes.v2_infer here, or at the engine when the request names a shared-memory region or its
    version takes image files."""
    if exchange.slot.model.takes_images:
        return await forward_http(remote, request, exchange)
    try:
        return await routes.v2_infer(remote, request, exchange)
    except Elsewhere:
        if request.arrival is not None:
            request.arrival.end()
        return await forward_http(remote, _whole(request), exchange)


def _whole(request):
    """The request with its body whole again, as the client sent it."""
    body = request.body
    if not isinstance(body, bytes):
        parsed = body.parsed
        parts = [bytes(body.header)]
        for item in parsed.binary_inputs:
            if item.binary:
                parts.append(memoryview(body.arrays[item.spec.name]).cast("B").tobytes())
        request.body = b"".join(parts)
    return request


def front_end_routes() -> list:
    """The route table of one process (serving/http/routes.py), each route the engine answers
    whole swapped for forward_http."""
    here = {
        routes.v2_infer: (v2_infer, v2_body),
        routes.invocations: (invocations, invocations_body),
        routes.live: None,
    }
    table = []
    for route in routes.table():
        if route.handler in here:
            handler, body = here[route.handler] or (route.handler, route.body)
            table.append(replace(route, handler=handler, body=body))
        else:
            table.append(replace(route, handler=forward_http, body=routes.whole_body, main=False))
    return table


def forwarding_service(remote: Remote):
    """The gRPC service of one process (serving/grpc/service.py) with ModelInfer answered here
    (the engine's when it names a shared-memory region) and every other method the engine's."""
    from serving.grpc import schema
    from serving.grpc.service import Service

    class Forwarding(Service):
        def call(self, method: str):
            if method == "ModelInfer":
                return self.ModelInfer
            return partial(self.forward, method)

        async def ModelInfer(self, request, call):
            if remote.takes_images(request.model_name, request.model_version or None):
                return await self.forward("ModelInfer", request, call)
            try:
                return await super().ModelInfer(request, call)
            except Elsewhere:
                return await self.forward("ModelInfer", request, call)

        async def forward(self, method: str, request, call):
            if call.raw:
                # (the native engine kept the raw contents apart from the message)
                request.raw_input_contents.extend(raw_bytes(raw) for raw in call.raw)
            head = {"method": method, "metadata": call.metadata}
            data = request.SerializeToString()
            status, said, payload = await remote.forward("grpc", head, data, call.exchange)
            if status != 200:
                raise Refused(status, said.get("message", ""))
            return schema.METHODS[method][1].FromString(payload)

    return Forwarding(remote)


def raw_bytes(raw) -> bytes:
    """A raw input's bytes: the native engine's RawInput (serving/grpc/native.py) copied out."""
    if isinstance(raw, (bytes, bytearray, memoryview)):
        return bytes(raw)
    out = bytearray(len(raw))
    raw.copy_into(out, 0)
    return bytes(out)


# ---- the process ------------------------------------------------------------------------------


async def _serve(channel_fd: int, side_fd: int) -> int:
    from serving.http.front_end import HttpFrontEnd

    loop = asyncio.get_running_loop()
    side = socket.socket(fileno=side_fd)
    side.setblocking(True)
    remote = Remote(0, side)
    await loop.connect_accepted_socket(lambda: remote.channel, socket.socket(fileno=channel_fd))
    # (the spare waits here, its imports done, until it is given a number or told to go)
    remote.channel.send(channel.WAITING, b"")
    drained = loop.create_task(remote.drained.wait())
    await asyncio.wait([remote.set_up, drained], return_when=asyncio.FIRST_COMPLETED)
    if not remote.set_up.done():
        return 0
    settings = remote.settings
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    drained.add_done_callback(lambda _: stop.set())
    http = HttpFrontEnd(remote, front_end_routes())
    bound = await http.listen(settings.host, settings.port, 1, reuse_port=True)
    if settings.grpc_port is not None:
        from serving.grpc import service

        counter = remote.receiving.of(remote.owner)
        remote.listening.append(
            await service.start_grpc(
                remote, forwarding_service(remote), shared_port=True, counter=counter
            )
        )
    remote.channel.send(
        channel.LISTENING, channel.json({"http": [list(a) for a in bound], "pid": os.getpid()})
    )
    await stop.wait()
    for grpc_front_end in remote.listening:
        loop.create_task(grpc_front_end.stop(settings.graceful_timeout))
    http.stop_accepting()
    await http.drain(settings.graceful_timeout)
    return 0


def log_as(owner: int, level: str) -> None:
    """Its log lines as the engine's (serving/console.py), each naming the front end."""
    from serving.console import OneLine

    handler = logging.StreamHandler()
    handler.setFormatter(
        OneLine(
            f"[front end {owner}] %(asctime)s %(levelname)s %(name)s: %(message)s",
            datefmt="%H:%M:%S",
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def main(argv: list[str] | None = None) -> int:
    from serving.cli import keep_freed_memory, raise_open_files_limit

    channel_fd, side_fd, engine = (int(a) for a in (argv or sys.argv[1:]))
    die_with(engine)
    # as one process: a connection is a descriptor; a 602 KB message's memory is reused, not
    # faulted in and zeroed again
    raise_open_files_limit()
    keep_freed_memory()
    try:
        import uvloop
    except ImportError:
        return asyncio.run(_serve(channel_fd, side_fd))
    return uvloop.run(_serve(channel_fd, side_fd))


if __name__ == "__main__":
    sys.exit(main())
