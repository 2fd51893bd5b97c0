"""The engine's side of its front-end processes (`--front-ends N`): the process started keeps the
models, the batchers, the engine thread, the repository and alias following, the payload log, the
shadow and drift, and N processes (serving/front_end_process.py) take the requests in, writing
their tensors into the batch rows of each version (serving/arena.py), so that batches form across
all of them. Started and stopped with the server (Server.front_ends), as the gRPC port is.

Per version, an arena: the batcher's rows are made in a memfd here, pinned for the GPU as a private
pool is, and the front ends map it. Per front end, what it says (serving/channel.py):
    SUBMIT    a request in its place (or its tensors with it): Server.answer, as one process runs
              it, with the arrival the front end counted, adopted (Placements.adopt); ANSWER or
              REFUSED back, with the receipt
    ENDED     an arrival that went no further: forgotten, its place killed (Batcher.ended)
    FORWARD   a request answered whole here, through the route table or the gRPC service of one
              process (serving/http/front_end.py answer_whole); /metrics adds every front end's
              counts to the engine's own (serving/metrics.py merged)
What it is told: its settings and the versions at start (SETUP), the versions again on every load,
unload and alias move (VERSIONS), the new arenas' descriptors over its side socket, and with SETUP
the memfd where its grpc threads count the ModelInfer calls they are receiving, which the engine's
batches wait for (serving/receiving.py).

Invariants:
- a version's rows live as long as a front end may still write into them: the engine keeps a
  version that left the table (a swap, an unload) until no arrival of it is on its way and every
  buffer of it is back, and each front end keeps its mapping until it lets go of the version;
- a front end that dies has its places still arriving killed and its arrivals forgotten in every
  version (Placements.gone), its requests in flight answered to nobody, and is replaced
  (serving/processes.py);
- every arrival a front end counted is forgotten exactly once, here: by its SUBMIT, its ENDED or
  its death. The engine's own batchers are the only ones that wait for arrivals, and they are told
  on this loop, so the last arrival's end always wakes a batch that waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import struct
import time
from dataclasses import replace

from serving import arena, channel
from serving.codec import BadRequest
from serving.envelope import Exchange, Refused, refusal
from serving.front_end_process import COUNTED, ENDED, FOLLOW_SWAP, INLINE, PLACED, REPLIED, SUBMIT
from serving.metrics import merged
from serving.processes import Processes
from serving.receiving import ReceivingCounts

log = logging.getLogger("serving.front_ends")
# how long the engine waits for a front end's /metrics counts
METRICS_S = 2.0


class Submitted:
    """A request as its front end decoded it, in the engine's process: what Server.answer reads
    (its shared-memory outputs are never here: such a request is forwarded whole)."""

    __slots__ = ("feeds", "rows", "request_id", "classification")
    output_refs = None

    def __init__(self, feeds: dict, rows: int, request_id: str | None, classification):
        self.feeds, self.rows = feeds, rows
        self.request_id, self.classification = request_id, classification


class FrontEnds:
    """N front-end processes and the engine's half of their channels (see the module's docstring).
    `placements_for(model, capacity)` is the Server's hook for a version's rows (an arena's);
    `start(server)` is one of the Server's front ends."""

    def __init__(self, count: int, why: str):
        self.count, self.why = count, why
        self.server = None
        self.processes = Processes(count, self._setup, self._record, self._gone)
        # version key -> the slot (and those that left the table, until they are drained)
        self._slots: dict[int, object] = {}
        self._retired: dict[int, float] = {}
        self._arenas: dict[int, arena.Arena] = {}
        # a new version's rows, by its placements, until its slot is named (_key)
        self._made: dict[int, tuple[object, arena.Arena]] = {}
        self._keys = 0
        self._table: dict | None = None
        # per front end, its requests being answered here
        self._tasks: dict[int, set[asyncio.Task]] = {}
        self._metrics: dict[int, asyncio.Future] = {}
        self._numbers = 0
        self.http = None
        self.grpc = None
        # the gRPC calls each front end is receiving (Server.incoming)
        self._receiving: ReceivingCounts | None = None

    # ---- the server's hooks ----

    def placements_for(self, model, capacity: int, bucket_for):
        """A new version's rows in an arena the front ends map (None for a version whose rows
        vary in size, or a model run alone: its requests' tensors come with their records)."""
        if not arena.has_rows(model):
            return None
        from serving.engine import GPU_PROVIDERS

        rows = arena.Arena.create(
            model.engine.inputs,
            capacity,
            pin=model.engine.provider in GPU_PROVIDERS,
            name=f"{model.info.name}-{model.info.version}",
        )
        placements = rows.placements(capacity, bucket_for)
        self._made[id(placements)] = (placements, rows)
        return placements

    async def start(self, server) -> FrontEnds:
        """(Server.lifespan) The processes started and listening; the versions announced to them
        whenever the repository changes."""
        from serving.grpc.service import Service
        from serving.http import routes
        from serving.http.front_end import HttpFrontEnd

        self.server = server
        table = [
            replace(route, handler=self._metrics_route)
            if route.handler is routes.metrics
            else route
            for route in routes.table()
        ]
        self.http = HttpFrontEnd(server, table)
        self.grpc = Service(server) if server.settings.grpc_port is not None else None
        announce = server.repository.on_change

        def changed() -> None:
            if announce is not None:
                announce()
            self.announce()

        server.repository.on_change = changed
        server.metrics.watch_front_ends(lambda: (self.processes.states(), self.processes.replaced))
        self._versions()
        self._receiving = ReceivingCounts.create(self.count)
        await self.processes.start()
        return self

    @property
    def layout(self) -> str:
        return (
            f"{self.count} front-end process{'es' if self.count > 1 else ''} taking HTTP"
            f"{' and gRPC' if self.grpc is not None else ''} in on the same ports "
            f"(SO_REUSEPORT; {self.why})"
        )

    def receiving(self) -> int:
        """ModelInfer calls the front ends' grpc threads are receiving (serving/receiving.py)."""
        return self._receiving.total() if self._receiving is not None else 0

    async def stop(self, grace: float | None) -> None:
        await self.processes.stop(grace or 0)
        for rows in self._arenas.values():
            rows.close()
        if self._receiving is not None:
            self._receiving.close()

    # ---- the versions ----

    def _versions(self) -> dict:
        """The table of versions as the front ends are told it (new arenas numbered in `fds`)."""
        repository = self.server.repository
        versions, models, fds = [], {}, []
        current = set()
        for name, model in repository.models.items():
            keys = {}
            for version, slot in model.slots.items():
                key = self._key(slot)
                current.add(key)
                keys[version] = key
            default = model.default_slot()
            models[name] = {
                "versions": keys,
                "default": self._key(default) if default is not None else None,
                "state": model.state,
                "reason": model.reason,
            }
        for key in current:
            slot = self._slots[key]
            rows = self._arenas.get(key)
            described = describe(slot, key)
            if rows is not None:
                described["arena"] = len(fds)
                described["layout"] = rows.layout
                described["capacity"] = slot.batcher.placements.capacity
                fds.append(rows.fd)
            versions.append(described)
        now = time.monotonic()
        for key in list(self._slots):
            if key not in current and key not in self._retired:
                self._retired[key] = now
        self._prune(now)
        default = repository.default_model() if repository.models else None
        self._table = {
            "versions": versions,
            "models": models,
            "default_model": default.name if default is not None else None,
            "described": repository.describe(),
            "arenas": len(fds),
        }
        return {"table": self._table, "fds": fds}

    def _key(self, slot) -> int:
        """The number the front ends know a version by (its arena's, or a new one)."""
        for key, known in self._slots.items():
            if known is slot:
                return key
        self._keys += 1
        key = self._keys
        self._slots[key] = slot
        made = self._made.pop(id(slot.batcher.placements), None)
        if made is not None:
            self._arenas[key] = made[1]
        return key

    def _prune(self, now: float) -> None:
        """Versions that left the table, let go once no front end can name them any more: no arrival
        of theirs on its way, every buffer back, and a read timeout past (a front end's request
        without a place names its version within that of its body's end)."""
        wait = self.server.settings.read_timeout + self.server.settings.request_timeout
        for key, since in list(self._retired.items()):
            placements = self._slots[key].batcher.placements
            busy = (
                placements.on_the_way() or len(placements.free_buffers()) < placements.table.count
            )
            if now - since > wait and not busy:
                del self._retired[key], self._slots[key]
                rows = self._arenas.pop(key, None)
                if rows is not None:
                    rows.close()

    def announce(self) -> None:
        """The versions now, to every front end (a load, an unload, an alias move)."""
        found = self._versions()
        self.processes.broadcast(channel.VERSIONS, channel.json(found["table"]), found["fds"])

    def _setup(self, process) -> tuple[bytes, list[int]]:
        found = self._versions()
        settings = dataclasses.asdict(self.server.settings)
        fields = channel.json(
            {"owner": process.owner, "settings": settings, "versions": found["table"]}
        )
        self._tasks[process.owner] = set()
        # (a dead front end's calls, if it had this number, never come)
        self._receiving.zero(process.owner)
        return fields, [*found["fds"], self._receiving.fd]

    # ---- what the front ends say ----

    def _record(self, process, kind: int, fields: memoryview) -> None:
        if kind == channel.SUBMIT:
            self._submit(process, fields)
        elif kind == channel.ENDED:
            key, _, index, k, ticket = ENDED.unpack_from(fields)
            slot = self._slots.get(key)
            if slot is not None:
                slot.batcher.ended(slot.batcher.adopt(process.owner, index, k, ticket))
        elif kind == channel.FORWARD:
            reader = channel.Reader(fields)
            (number,) = reader.take(channel.U32)
            head, body = channel.unjson(reader.blob()), bytes(reader.blob())
            self._spawn(process, self._forwarded(process, number, head, body))
        elif kind == channel.METRICS:
            (number,) = struct.unpack_from("<I", fields)
            waiting = self._metrics.get(number)
            if waiting is not None and not waiting.done():
                waiting.set_result(bytes(fields[4:]))

    def _submit(self, process, fields: memoryview) -> None:
        reader = channel.Reader(fields)
        number, key, index, k, ticket, rows, flags = reader.take(SUBMIT)
        request_id, body_id, endpoint, source = (reader.text() for _ in range(4))
        extras = reader.blob()
        classification = channel.unjson(extras) if len(extras) else None
        slot = self._slots.get(key)
        if slot is None:
            self._refused(process, number, key, None, Refused(503, "the version is gone; retry"))
            return
        arrival = None
        if flags & COUNTED:
            arrival = slot.batcher.adopt(process.owner, index, k, ticket)
        if flags & INLINE:
            feeds = reader.tensors()
        elif flags & PLACED and arrival is not None and arrival.place is not None:
            feeds = arrival.place.views
            arrival.filled = arrival.checked = True
        else:
            if arrival is not None:
                slot.batcher.ended(arrival)
            self._refused(process, number, key, None, Refused(503, "its rows were let go; retry"))
            return
        exchange = Exchange(endpoint, source)
        exchange.slot, exchange.request_id = slot, request_id or None
        request = Submitted(feeds, rows, body_id or None, classification)
        self._spawn(
            process,
            self._answer(process, number, key, slot, request, exchange, flags, arrival),
        )

    def _spawn(self, process, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        tasks = self._tasks.setdefault(process.owner, set())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _answer(self, process, number, key, slot, request, exchange, flags, arrival) -> None:
        try:
            answer = await self.server.answer(
                slot,
                request,
                exchange,
                endpoint=exchange.route,
                follow_swap=bool(flags & FOLLOW_SWAP),
                arrival=arrival,
            )
        except Exception as exc:  # noqa: BLE001
            # every failure goes back as its status
            self._refused(process, number, key, exchange, exc)
            return
        process.channel.send(
            channel.ANSWER,
            REPLIED.pack(number, 200, self._key(answer.slot)),
            channel.text(exchange.request_id or ""),
            channel.text(exchange.server_id or ""),
            channel.text(exchange.warning or ""),
            *channel.tensors(answer.results),
        )

    def _refused(self, process, number: int, key: int, exchange, exc: Exception) -> None:
        if isinstance(exc, (Refused, BadRequest)):
            # (the front end's envelope logs it, as one process does)
            status, message, headers = exc.status, str(exc), getattr(exc, "headers", None)
        else:
            found = refusal(exc, "a front end's request", log)
            status, message, headers = found.status, found.message, found.headers
        if exchange is not None and exchange.slot is not None:
            key = self._key(exchange.slot)
        process.channel.send(
            channel.REFUSED,
            REPLIED.pack(number, status, key),
            channel.text(exchange.request_id or "" if exchange is not None else ""),
            channel.text(exchange.server_id or "" if exchange is not None else ""),
            channel.text(message),
            *channel.blob(channel.json(headers or {})),
        )

    async def _forwarded(self, process, number: int, head: dict, body: bytes) -> None:
        """A request the front end hands over whole: answered as one process answers it."""
        if head["kind"] == "http":
            response, exchange = await self.http.answer_whole(
                head["method"],
                head["path"],
                head["query"],
                head["headers"],
                body,
                head["source"],
            )
            status, payload = response.status, response.body
            said = {"content_type": response.content_type, "headers": response.headers}
        else:
            status, payload, exchange, said = await self._grpc(head, body)
        key = self._key(exchange.slot) if exchange.slot is not None else 0
        said |= {
            "request_id": exchange.request_id,
            "server_id": exchange.server_id,
            "warning": exchange.warning,
        }
        process.channel.send(
            channel.REPLY,
            REPLIED.pack(number, status, key),
            *channel.blob(channel.json(said)),
            *channel.blob(payload or b""),
        )

    async def _grpc(self, head: dict, body: bytes):
        """One gRPC call answered whole by the engine's Service (its envelope was the front
        end's)."""
        from serving.grpc import schema, service

        method = head["method"]
        exchange = Exchange(f"grpc {method}", head["source"])
        call = service.Call(head["metadata"], len(body), exchange)
        try:
            request = schema.METHODS[method][0].FromString(body)
            response = await self.grpc.call(method)(request, call)
        except Exception as exc:  # noqa: BLE001
            # its status goes back
            if isinstance(exc, (Refused, BadRequest)):
                status, message = exc.status, str(exc)
            else:
                found = refusal(exc, f"gRPC {method}", log)
                status, message = found.status, found.message
            return status, b"", exchange, {"message": message}
        return 200, response.SerializeToString(), exchange, {}

    async def _metrics_route(self, server, request, exchange):
        """/metrics of the whole server: the engine's series and every front end's counts."""
        from serving.http.wire import Response

        loop = asyncio.get_running_loop()
        asked = []
        for process in self.processes.processes.values():
            if process.gone:
                continue
            self._numbers = number = (self._numbers + 1) & 0xFFFFFFFF
            self._metrics[number] = waiting = loop.create_future()
            process.channel.send(channel.ASK_METRICS, struct.pack("<I", number))
            asked.append((number, waiting))
        texts = [server.metrics.render()]
        for number, waiting in asked:
            with contextlib.suppress(TimeoutError):
                texts.append(await asyncio.wait_for(waiting, METRICS_S))
            self._metrics.pop(number, None)
        return Response(200, merged(texts), server.metrics.content_type)

    # ---- a front end gone ----

    def _gone(self, process) -> None:
        """Its places still arriving are dead, its arrivals forgotten, its requests answered to
        nobody; every batch is looked at again (one may have waited for its arrivals, its gRPC
        messages, or its place in a sealed buffer)."""
        self._receiving.zero(process.owner)
        for slot in list(self._slots.values()):
            slot.batcher.placements.gone(process.owner)
            slot.batcher.look_again()
        for task in self._tasks.pop(process.owner, set()):
            task.cancel()


def describe(slot, key: int) -> dict:
    """A version as the front ends are told it (serving/front_end_process.py: Slot)."""
    model, info = slot.model, slot.model.info
    engine = model.engine

    def specs(found) -> list:
        return [
            [s.name, s.dtype.str, s.datatype, list(s.shape), s.batched, s.ranked] for s in found
        ]

    return {
        "key": key,
        "name": info.name,
        "version": info.version,
        "source": info.source,
        "lineage": info.lineage,
        "labels": list(info.labels) if info.labels is not None else None,
        "max_lengths": {
            name: {str(axis): n for axis, n in axes.items()}
            for name, axes in (info.max_lengths or {}).items()
        },
        "inputs": specs(engine.inputs),
        "outputs": specs(engine.outputs),
        "batchable": engine.batchable,
        "images": model.images is not None,
        "headers": slot.headers,
        "arena": None,
    }
