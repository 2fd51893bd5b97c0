"""The server's protocol-neutral core: the models it serves, and the one inference path every
front end calls (KServe V2 over HTTP, MLflow's /invocations, KServe V2 over gRPC).

    `Server.answer(slot, request, exchange)`
        the decoded request of a version -> the rest of its receipt -> infer (the batcher,
        following a reload that swapped the version meanwhile) -> its observers told -> the
        Answer, which the front end encodes
    `Server.decode(fn, size)`
        a protocol's decoder on a request: in a thread for a big one, two at a time

A front end (serving/http/ for HTTP, serving/grpc/service.py for gRPC) picks the version a
request names (`model_slot`, `invocations_slot`), writes it and the id it knows on the request's
Exchange (the receipt, serving/envelope.py), decodes the request with its codec (codec.py,
grpc/codec.py) and hands both to `answer`. Nothing here calls back into a front end. Front ends
that listen on their own port (gRPC) are started and stopped by the server's lifespan, which is
handed their start functions: this module imports none of them.

What watches the answers subscribes to them (`Observer`): the payload log (serving/payload_log.py),
the shadow's mirror (serving/shadow.py) and the warm-up of new versions (`WarmUp`). What watches
the batches subscribes to each version's batcher: the metrics, and drift (serving/drift.py: on the
engine thread, a batch at a time). Every model run of every model happens on one engine thread
(serving/runner.py), which takes each batch when it is free to run it. Also here: opening and
warming up models at start (`open_models`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import numpy as np

from serving import drift, image_inputs, input_range, lengths
from serving.batcher import Batcher, BatcherClosed, NotRowWise, QueueFull, RunTimedOut
from serving.classification import classify
from serving.codec import UNFORESEEN, BadRequest, Limits, shape_fits
from serving.config import Settings
from serving.console import clip
from serving.engine import GPU_PROVIDERS, Engine, ModelInputError
from serving.envelope import Auth, Exchange, Refused, new_request_id
from serving.loader import LoadedModel, SourceError, load_model
from serving.metrics import Metrics
from serving.payload_log import PayloadLog
from serving.repository import (
    HEADER_SAFE,
    Model,
    Repository,
    RepositoryError,
    Slot,
    Source,
    receipt_values,
)
from serving.runner import Runner
from serving.shadow import Mirror, Rule
from serving.shm import SharedMemory
from serving.staging import NonFinite

log = logging.getLogger("serving.core")
RETRY_AFTER = {"Retry-After": "1"}
# A request bigger than this is decoded in a thread.
BIG_BODY = 64 * 1024
# Allocations between two collections of the youngest generation (Python's default: 700).
GC_THRESHOLD = 20_000


def check_request_id(value: str, where: str) -> str:
    """A client's request id, which is echoed in a header: 1 to 128 printable ASCII characters."""
    if not HEADER_SAFE.fullmatch(value):
        raise Refused(
            400,
            f"{where} must be 1 to 128 printable ASCII characters (it is echoed in the "
            f"X-Request-Id response header), got {value!r:.60}",
        )
    return value


@dataclass(slots=True)
class Answer:
    """One request that reached the model: what its front end encodes, and its observers see."""

    # The version that computed it (after a reload swap too).
    slot: Slot
    # What decode returned: .feeds, .rows, and what the protocol asks of its answer.
    request: Any
    # Its receipt: the request id, the server's id of the answer, the client's address.
    exchange: Exchange
    # As the payload log names it.
    endpoint: str
    # The feeds, as an array of their own when an observer keeps them past the run.
    inputs: dict[str, np.ndarray]
    # The observers that asked to keep the inputs (Observer.keeps).
    keepers: tuple
    # None when refused at the model; as the request asked for them once the observers were told.
    results: dict[str, np.ndarray] | None = None
    # From queueing to the answer.
    ms: float = 0.0
    status: int = 200
    error: str | None = None

    @property
    def request_id(self) -> str:
        return self.exchange.request_id


class Observer(Protocol):
    """What watches the answers, told by Server.answer on the loop that answered."""

    def keeps(self, slot: Slot, request_id: str) -> bool:
        """Before the run: whether it keeps this request's inputs past it."""

    def answered(self, answer: Answer) -> None:
        """After the run, once per request, refused at the model too (no results); never waits."""


class Server:
    """The state behind the front ends (HTTP and gRPC): settings, the model repository, the engine
    thread, metrics, and what watches the answers."""

    def __init__(
        self,
        settings: Settings,
        models: LoadedModel | list[tuple[Source, LoadedModel]],
        payload_log: PayloadLog | None = None,
        front_ends: tuple[Callable[["Server"], Awaitable[Any]], ...] = (),
        rows: Callable[[LoadedModel, int, Callable[[int], int]], Any] | None = None,
    ):
        self.settings = settings
        # Each version's batch rows where front-end processes share them (serving/front_ends.py:
        # (model, rows a run, its buckets) -> Placements over an arena, or None); else the
        # batcher's own.
        self.rows = rows
        self.auth = Auth(settings.tokens(), settings.feedback_token)
        # One thread runs every model run of every model: onnxruntime parallelizes inside a run,
        # and two runs at once on the same cores only fight. It takes each batch when it is free to,
        # the models' batchers in turn (serving/runner.py); warm-ups take their turns too.
        self.executor = Runner()
        self.metrics = Metrics(queue_rows=self._queued_rows)
        self.drift = drift.Watch(settings.drift_window, settings.drift_threshold)
        self.warm_up = WarmUp(self.executor, settings.max_batch_size)
        self.repository = Repository(
            partial(open_source, settings),
            partial(make_batcher, self),
            self.warm_up.between_batches,
            directory=settings.repository,
            policy=settings.policy(),
            default_model=settings.default_model,
        )
        self.repository.on_change = self._announce
        # One model, opened by the caller (tests, tools).
        if isinstance(models, LoadedModel):
            source = settings.sources()[0] if settings.sources() else Source(models.info.source)
            models = [(source, models)]
        self.repository.place(models)
        # The rest of the repository: listed, loadable, not loaded.
        self.repository.add_repository_models()
        check_names(settings, self.repository)
        # Between startup and shutdown.
        self._serving = False
        self._followers: list[asyncio.Task] = []
        self.limits = Limits(settings.max_rows_per_request, settings.max_body_bytes)
        # Clients' shared memory regions (the V2 extensions); CUDA ones once a version is on a GPU.
        self.shared_memory = SharedMemory(
            int(settings.max_shared_memory_mb * (1 << 20)),
            settings.shared_memory == "on",
            tokened=self.auth.required,
        )
        # Big bodies decoded at once, over every event loop (HTTP runs several): bounds their
        # memory. Taken by the decoding thread itself, so no loop waits on it.
        self.decoding = threading.BoundedSemaphore(2)
        # Started and closed with the server.
        self.payload_log = payload_log
        # Started with the server (gRPC), each returning something with stop(grace).
        self.front_ends = front_ends
        self.listening: list[Any] = []
        self._stopping: list[asyncio.Future] = []
        self.mirror = Mirror(
            self.repository,
            settings.shadow_alias,
            settings.shadow,
            Rule(**settings.shadow_rule()),
            settings.request_timeout,
        )
        watchers = (payload_log, self.mirror if self.mirror.comparisons else None, self.warm_up)
        self.observers: tuple[Observer, ...] = tuple(w for w in watchers if w is not None)
        if payload_log is not None:
            self.metrics.watch_payload_log(payload_log.stats)
        self.metrics.watch_drift(lambda: self.drift.scores(self._loaded()))
        self.metrics.watch_shadows(self.mirror.reports)
        self.metrics.watch_rows(self._rows)

    @property
    def ready(self) -> bool:
        """Started, not shutting down, at least one version loaded, and every loaded version's
        batcher running with no model run past its deadline. A model unloaded or still loading
        leaves the server ready (its own ready says no); a server with nothing loaded is not."""
        slots = [slot for _, slot in self.repository.slots()]
        return self._serving and bool(slots) and all(slot.healthy for slot in slots)

    def model_ready(self, model: Model) -> bool:
        return self._serving and model.ready

    @property
    def slot(self) -> Slot:
        """The default model's default version (what /invocations serves)."""
        return self.repository.slot(self.repository.default_model().name, None)

    def _loaded(self) -> set[tuple[str, str]]:
        return {(name, slot.version) for name, slot in self.repository.slots()}

    def _rows(self) -> list[tuple[str, str, int, int]]:
        found = []
        for name, slot in self.repository.slots():
            placements = slot.batcher.placements
            in_use = placements.table.count - len(placements.free_buffers())
            found.append((name, slot.version, in_use, placements.arriving_now()))
        return found

    def _queued_rows(self) -> list[tuple[str, str, float]]:
        return [
            (name, slot.version, slot.batcher.queued_rows) for name, slot in self.repository.slots()
        ]

    def incoming(self) -> int:
        """Requests on their way whose model is not named yet (ModelInfer messages the native gRPC
        engine is still receiving), which batches wait for as for HTTP bodies arriving
        (serving/batcher.py). Counted only where one version is loaded (a flood to one model must
        not hold another's batches) and no token is required (a call is counted before its token is
        checked: anyone could otherwise hold every batch). Called under a batcher's lock, on the
        engine thread or a loop's kick."""
        if self.auth.required:
            return 0
        # Registered models with no version loaded count too.
        loaded = sum(len(model.slots) for model in list(self.repository.models.values()))
        if loaded != 1:
            return 0
        return sum(front_end.receiving() for front_end in self.listening)

    # ---- lifecycle -----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lifespan(self, app=None):
        # The mirror's queues live on this loop: an answer on another one hands its pair over.
        self.mirror.start()
        self.repository.start()
        self._announce()
        if any(slot.model.engine.provider in GPU_PROVIDERS for _, slot in self.repository.slots()):
            self.shared_memory.cuda_device = self.settings.device_id
        for _, slot in self.repository.slots():
            info = slot.model.info
            log.info(
                "serving %s version %s from %s on %s",
                info.name,
                info.version,
                info.source,
                slot.model.engine.describe(),
            )
        if self.payload_log is not None:
            self.payload_log.start()
        if self.settings.reload_interval:
            self._followers = [
                asyncio.create_task(
                    self.repository.follow(
                        name, alias, self.settings.reload_interval, self._alias_event
                    ),
                    name=f"follow {alias}",
                )
                for name, alias in self.repository.aliases()
            ]
        for start in self.front_ends:
            self.listening.append(await start(self))
        # What start-up made (imports, MLflow's among them, the models) lives as long as the server:
        # out of the collector's sight, a full collection (an alias move's, or the interpreter's
        # own) scans only what came since, not every object of start-up on the event loop.
        gc.freeze()
        # A request allocates a few hundred objects, almost none in cycles: the youngest
        # generation's default threshold ran the collector every few requests for nothing.
        gc.set_threshold(GC_THRESHOLD, 20, 20)
        self._serving = True
        try:
            yield
        finally:
            # Here after SIGTERM, once the front ends stopped accepting and in-flight requests
            # were answered; drain what is still queued anyway.
            self._serving = False
            self._stop_front_ends()
            for stopping in self._stopping:
                await stopping
            await self.mirror.stop()
            for task in self._followers:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await self.repository.close()
            self.shared_memory.close()
            # Every request was answered: its records are all queued.
            if self.payload_log is not None:
                await asyncio.to_thread(self.payload_log.close, self.settings.graceful_timeout)
            self.executor.shutdown(wait=True)
            log.info("stopped")

    def begin_shutdown(self) -> None:
        """SIGTERM: report not ready at once (load balancers stop sending), and let queued requests
        run now instead of waiting out --max-delay-ms, so that the front ends' wait for in-flight
        requests ends with them answered, not cut at --graceful-timeout."""
        self._serving = False
        for _, slot in self.repository.slots():
            slot.batcher.flush()
        # gRPC drains alongside HTTP, not after it.
        self._stop_front_ends()

    def _stop_front_ends(self) -> None:
        if not self._stopping:
            self._stopping = [
                asyncio.ensure_future(f.stop(self.settings.graceful_timeout))
                for f in self.listening
            ]

    def _announce(self) -> None:
        """Metrics of what is loaded now (after every load, unload and alias move)."""
        served = []
        for name, slot in self.repository.slots():
            model, info = slot.model, slot.model.info
            say_unsent_receipt(name, info)
            options = model.engine.options_text()
            served.append(
                (name, info.version, model.engine.provider, info.source, model.variant, options)
            )
        self.metrics.set_models(served)
        self.drift.keep(self._loaded())
        loaded = {name for name, _ in self.repository.slots()}
        self.metrics.forget_aliases(lambda model: model not in loaded)

    def _alias_event(self, name: str, alias: str, event: str, version: str) -> None:
        model = self.repository.models.get(name)
        self.metrics.set_alias(name, alias, version, behind=model is None or model.behind(alias))
        if event == "failed":
            self.metrics.reload_failures.labels(name, version).inc()
        elif event == "moved":
            self.metrics.reloads.labels(name).inc()
            log.info("serving %s version %s (alias %s)", name, version, alias)

    # ---- the one inference path ------------------------------------------------------------------

    def model_slot(self, name: str, version: str | None) -> Slot:
        try:
            return self.repository.slot(name, version)
        except RepositoryError as exc:
            raise Refused(exc.status, str(exc)) from None

    def invocations_slot(self) -> Slot:
        try:
            return self.repository.slot(self.repository.default_model().name, None)
        except RepositoryError as exc:
            raise Refused(exc.status, f"/invocations serves the default model: {exc}") from None

    async def decode(self, decode: Callable[[], Any], size: int):
        """decode_now, in a thread for a big request (two at a time), inline for a small one."""
        if size <= BIG_BODY:
            return decode_now(decode)
        return await asyncio.to_thread(self.in_turn, decode_now, decode)

    def in_turn(self, fn: Callable, *args):
        """`fn(*args)` (in a thread) once one of the two decoding places is free."""
        with self.decoding:
            return fn(*args)

    async def answer(
        self,
        slot: Slot,
        request,
        exchange: Exchange,
        *,
        endpoint: str,
        follow_swap: bool,
        arrival=None,
    ) -> Answer:
        """The one inference path (see the module's docstring). `request` is what the front end
        decoded for `slot`: .feeds, .rows, and .request_id, the body's id (None when it has none);
        `arrival` the batcher's note that its body was on its way (Batcher.arriving), ended once it
        is queued.

        The receipt is settled here (Exchange): the request id where the front end knew none (the
        body's, or a fresh one), the server's own id of the answer, and the version that ran when
        a reload swap moved the request. Refusals raise Refused or BadRequest, with the
        receipt on `exchange`.
        """
        if exchange.request_id is None:
            given = getattr(request, "request_id", None)
            # An empty "id" is no id (perf_analyzer sends one): the request gets a fresh one.
            exchange.request_id = (
                check_request_id(given, 'the "id" of the request') if given else new_request_id()
            )
        # Whatever the client sent: what the shadow keeps its answers under, so that a client can
        # neither predict nor reuse another's (the receipt's X-Server-Request-Id).
        exchange.server_id = new_request_id()
        # Encoded images become the model's input here, for every front end; a request far
        # outside the training data's range is answered with a warning.
        request = await image_inputs.decoded(self, slot, request)
        exchange.warning = input_range.warning(slot.model, request.feeds)
        keepers = tuple(o for o in self.observers if o.keeps(slot, exchange.request_id))
        # What outlives the run takes a copy of the inputs now: a request received into a batch
        # buffer has views of rows the next batch is received into.
        inputs = owned(request.feeds) if keepers else request.feeds
        answer = Answer(slot, request, exchange, endpoint, inputs, keepers)
        started = time.perf_counter()
        try:
            results, answer.slot = await self.infer(
                slot, request.feeds, request.rows, follow_swap, arrival
            )
        except (Refused, BadRequest) as exc:
            slot.batcher.statistics.answered(False, exchange.started)
            answer.status, answer.error = exc.status, str(exc)
            self._tell(answer)
            raise
        except Exception:
            slot.batcher.statistics.answered(False, exchange.started)
            raise
        answer.results, answer.ms = results, (time.perf_counter() - started) * 1e3
        answer.slot.batcher.statistics.answered(True, exchange.started)
        # A reload swap had another version answer: the receipt names the one that ran.
        if answer.slot is not slot:
            exchange.slot = answer.slot
        self._tell(answer)
        answer.results = answered(answer.slot, request, results)
        return answer

    def _tell(self, answer: Answer) -> None:
        for observer in self.observers:
            try:
                observer.answered(answer)
            except Exception:  # noqa: BLE001
                # what watches the answers must never fail one
                log.exception("%s failed on request %s", type(observer).__name__, answer.request_id)

    async def infer(
        self,
        slot: Slot,
        feeds: dict[str, np.ndarray],
        rows: int,
        follow_swap: bool = True,
        arrival=None,
    ) -> tuple[dict[str, np.ndarray], Slot]:
        """The outputs, and the slot whose model computed them: `slot`, or with `follow_swap` (the
        client named no version) the one a reload put in its place before the request could be
        queued."""
        # A 400 naming the limit, not onnxruntime's words.
        lengths.check(slot.model.info.max_lengths, feeds, slot.model.info.name)
        limit = self.settings.max_rows_per_request
        if rows > limit:
            raise Refused(
                400,
                f"the request has {rows} rows; this server takes at most {limit} per request "
                "(--max-rows-per-request): split it",
            )
        timeout = self.settings.request_timeout
        try:
            # Not wait_for: it would make a task of its own per request.
            async with asyncio.timeout(timeout):
                return await self._submit(slot, feeds, rows, follow_swap, arrival)
        except TimeoutError:
            raise Refused(
                504,
                f"no answer within {timeout:g} s (--request-timeout); the server is overloaded or "
                "a model run is stuck",
            ) from None
        except RunTimedOut as exc:
            raise Refused(504, str(exc)) from None
        except (ModelInputError, NonFinite) as exc:
            raise Refused(400, str(exc)) from None
        except NotRowWise as exc:
            raise Refused(
                500, f"model '{slot.model.info.name}' version {slot.version}: {exc}"
            ) from None
        except (QueueFull, BatcherClosed) as exc:
            raise Refused(503, f"{exc}; retry later", RETRY_AFTER) from None

    async def _submit(
        self, slot: Slot, feeds: dict[str, np.ndarray], rows: int, follow_swap: bool, arrival=None
    ) -> tuple[dict[str, np.ndarray], Slot]:
        try:
            return await slot.batcher.submit(feeds, rows, arrival), slot
        except BatcherClosed:
            if arrival is not None:
                arrival.end()
            if not self._serving:
                raise
            current = swapped_in(self.repository, slot, follow_swap)
            if current is None:
                raise
            return await current.batcher.submit(feeds, rows), current


def make_batcher(server: "Server", model: LoadedModel) -> Batcher:
    """A loaded version's batcher, with the server's settings where its config.pbtxt sets none."""
    s = server.settings
    name, version = model.info.name, model.info.version

    def observe(rows: int, seconds: float, waits: list[float]) -> None:
        server.metrics.observe_batch(name, version, rows, seconds, waits)

    cap = batch_cap(model, s.max_batch_size)
    return Batcher(
        model.engine.run_parts,
        server.executor,
        max_batch_size=cap,
        # (a repository model's config.pbtxt may set its own: ModelInfo)
        max_delay_ms=(
            s.max_delay_ms if model.info.max_delay_ms is None else model.info.max_delay_ms
        ),
        max_queue_rows=min(s.max_queue_rows, model.info.max_queue_rows or s.max_queue_rows),
        merge=model.engine.batchable,
        on_batch=observe,
        run_timeout=s.run_timeout,
        buffers=model.engine.batch_buffers(cap),
        run_gathered=model.engine.run_gathered,
        bucket_for=model.engine.bucket_for,
        placements=None
        if server.rows is None
        else server.rows(model, cap, model.engine.bucket_for),
        arrival_wait_ms=s.arrival_wait_ms,
        incoming=server.incoming,
        name=f"model '{name}' version {version}",
        observe=server.drift.observer(name, version, model.drift_reference, model.engine.metadata),
    )


def swapped_in(repository: Repository, slot: Slot, follow_swap: bool) -> Slot | None:
    """The slot a request queued on `slot` goes to after a reload closed that slot's batcher.

    A reload swapped the model between choosing this slot and queueing on it (decoding a big body
    lies in between): the new model takes it if its inputs are the same. Named a version: the same
    version's new slot (a reload of it). Unloaded meanwhile: a 404. None: no slot takes it (the
    caller's BatcherClosed stands, a 503).
    """
    name = slot.model.info.name
    model = repository.models.get(name)
    if model is None:
        return None
    current = model.default_slot() if follow_swap else model.slots.get(slot.version)
    if current is None:
        raise Refused(
            404,
            f"model '{name}' version {slot.version} was unloaded while the request "
            f"waited ({model.state.lower()})",
        )
    # the feeds were decoded from image files by this version's preprocessing: another's
    # would have made other tensors of the same files
    if (
        current is slot
        or current.model.engine.inputs != slot.model.engine.inputs
        or current.model.images != slot.model.images
    ):
        return None
    return current


class WarmUp:
    """The warm-up of a version loaded while its model serves: one run per batch size on the engine
    thread, queued between live batches, never two runs at once on the device (on a GPU, cuDNN
    picking algorithms for the new model while live traffic runs would time them on a busy device
    and slow the requests in flight). A live batch waits for at most one warm-up run.

    No size can be guessed for zeros where an input has a dynamic axis besides the batch axis (a
    sequence length, an image size): the new version runs the last request its model answered
    instead, so that the first requests after a swap do not pay for its allocations. As an observer
    of answers it keeps one row of that request, for such models only: a client's data, kept for
    nothing else (such a model has no batch buffers, so its feeds are its own).
    """

    def __init__(self, executor, max_batch_size: int):
        self.executor = executor
        self.max_batch_size = max_batch_size
        self._last: dict[str, dict[str, np.ndarray]] = {}

    def keeps(self, slot: Slot, request_id: str) -> bool:
        return False

    def answered(self, answer: Answer) -> None:
        engine = answer.slot.model.engine
        if answer.results is None or not engine.other_dynamic_axes:
            return
        feeds = answer.request.feeds
        self._last[answer.slot.model.info.name] = (
            {k: v[:1] for k, v in feeds.items()} if engine.batchable else feeds
        )

    async def between_batches(self, model: LoadedModel) -> None:
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        sizes = warm_up_sizes(model.engine, batch_cap(model, self.max_batch_size))
        for n in sizes:
            if not await loop.run_in_executor(self.executor, warmed, model, (n,)):
                await self._with_last_request(model)
                return
        log.info(
            "%s version %s: warm-up of %d batch sizes done in %.2f s",
            model.info.name,
            model.info.version,
            len(sizes),
            time.perf_counter() - started,
        )

    async def _with_last_request(self, model: LoadedModel) -> None:
        """Only a warm-up: its failure is said, not a refusal of the version (another version's
        request may hold values this one does not take)."""
        name, version = model.info.name, model.info.version
        feeds = self._last.get(name)
        if feeds is None or not fits(model.engine.inputs, feeds):
            log.info(
                "%s version %s: no warm-up: an input has a dynamic axis besides the batch axis, "
                "and no request answered yet fits this version",
                name,
                version,
            )
            return
        started = time.perf_counter()
        try:
            await asyncio.get_running_loop().run_in_executor(self.executor, model.engine.run, feeds)
        except Exception as exc:  # noqa: BLE001
            # see the docstring
            log.warning(
                "%s version %s: warm-up with the last request answered failed (serving it anyway): "
                "%s",
                name,
                version,
                clip(str(exc), 300),
            )
            return
        log.info(
            "%s version %s: warm-up with the last request answered (an input has a dynamic axis "
            "besides the batch axis) done in %.2f s",
            name,
            version,
            time.perf_counter() - started,
        )


def decode_now(decode: Callable[[], Any]):
    """A protocol's decoder on its request, here and now. An exception the decoder did not foresee
    is still the client's malformed request: a 400."""
    try:
        return decode()
    except BadRequest:
        raise
    except UNFORESEEN as exc:
        log.debug("a request the decoder did not foresee", exc_info=True)
        raise BadRequest(
            f"malformed request: {type(exc).__name__}: {clip(str(exc), 200)}"
        ) from None


def answered(slot: Slot, request, results: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The outputs as the request asked for them: those asked as classes, their top K
    (serving/classification.py)."""
    model = slot.model
    return classify(
        results,
        getattr(request, "classification", None) or {},
        model.engine.batchable,
        model.info.labels_for,
    )


def owned(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A request's feeds as arrays of their own, for what keeps them past its run (the payload log,
    the shadow mirror): a request received into a batch buffer has views of rows the next batch
    reuses."""
    return {name: np.array(x) for name, x in feeds.items()}


def fits(specs, feeds: dict[str, np.ndarray]) -> bool:
    """The feeds are the inputs `specs` describe: the same names, dtypes and ranks, and every fixed
    axis's size."""
    return set(feeds) == {spec.name for spec in specs} and all(
        feeds[spec.name].dtype == spec.dtype and shape_fits(spec, feeds[spec.name].shape)
        for spec in specs
    )


def check_names(settings: Settings, repository: Repository) -> None:
    """--default-model and --batching name models the repository has; RepositoryError otherwise."""
    s, models = settings, repository.models
    if s.default_model is not None and s.default_model not in models:
        raise RepositoryError(
            f"--default-model {s.default_model}: no such model (this server has "
            f"{repository.describe()})"
        )
    unknown = [n for n in s.batching_flags() if n not in models]
    if unknown:
        raise RepositoryError(
            f"--batching {unknown[0]}: no such model (this server has "
            f"{repository.describe()}); name a model as it is served"
        )


def say_unsent_receipt(name: str, info) -> None:
    """One log line naming the X-Model-* headers a version's values keep out of its receipts."""
    unsafe = [h for h, v in receipt_values(info).items() if v and not HEADER_SAFE.fullmatch(v)]
    if unsafe:
        log.warning(
            "%s version %s: not sending %s: the values are not 1 to 128 printable ASCII characters",
            name,
            info.version,
            ", ".join(unsafe),
        )


def open_source(settings: Settings, source: Source, version: str | None = None) -> LoadedModel:
    """One model source on the provider and variant the settings ask (an alias pinned at `version`
    when given). A repository version directory is that version of its model."""
    s = settings
    # Settings.check: --model-name only beside a single unnamed --model.
    name = source.name or s.model_name
    return load_model(
        source.uri,
        device=s.device,
        threads=s.threads,
        name=name,
        version=version or source.version,
        device_id=s.device_id,
        variant=s.variant,
        gpu=s.gpu_options(),
        batch_buckets=s.bucket_sizes(),
        batching=s.batching_flags(),
        config=source.config,
    )


def warm_up_sizes(engine: Engine, max_batch_size: int) -> tuple[int, ...]:
    """The batch sizes to run before serving.

    Batch buckets (the CUDA provider's default): each bucket once, the size its session will only
    ever see. Other GPU: every size the batcher forms from requests (1 to max_batch_size): each new
    input shape costs the CUDA provider a cuDNN algorithm choice and allocations, and TensorRT an
    engine rebuild if the shape is outside the range it has seen, so none of that may land on a
    request. The largest first, then 1: TensorRT's profile then spans every size in between. A
    single request larger than max_batch_size runs alone at its own size, unwarmed (bound it with
    --max-rows-per-request). CPU: 1 and the largest; the CPU provider chooses no algorithm per
    shape, and the largest batch sizes its memory arena.
    """
    if engine.buckets:
        return engine.buckets
    if engine.provider in GPU_PROVIDERS:
        return (max_batch_size, *range(1, max_batch_size))
    return tuple(dict.fromkeys((1, max_batch_size)))


def warmed(model: LoadedModel, sizes: tuple[int, ...]) -> bool:
    """engine.warm_up at `sizes`; a run that shows the version's rows are not independent turned its
    batching off: said in one line naming it, and the warm-up goes on unbatched."""
    try:
        return model.engine.warm_up(sizes)
    except NotRowWise as exc:
        log.error("model '%s' version %s: warm-up: %s", model.info.name, model.info.version, exc)
        return model.engine.warm_up(sizes)


def batch_cap(model: LoadedModel, max_batch_size: int) -> int:
    """The most rows a run of this version gathers: --max-batch-size, or its config.pbtxt's
    max_batch_size when smaller."""
    own = model.info.max_batch_size
    return min(max_batch_size, own) if own else max_batch_size


def warm_up(model: LoadedModel, max_batch_size: int) -> None:
    """Run the model at the warm-up sizes (warm_up_sizes) before the server says it is ready."""
    started = time.perf_counter()
    sizes = warm_up_sizes(model.engine, batch_cap(model, max_batch_size))
    if warmed(model, sizes):
        log.info(
            "%s version %s: warm-up of %d batch sizes done in %.2f s",
            model.info.name,
            model.info.version,
            len(sizes),
            time.perf_counter() - started,
        )
    else:
        log.info(
            "%s: no warm-up: an input has a dynamic axis besides the batch axis",
            model.info.name,
        )


def open_models(settings: Settings) -> list[tuple[Source, LoadedModel]]:
    """Every model the settings load at start, opened and warmed up (blocking, before the server
    starts). Raises the first failure: a server does not start half-loaded."""
    repository = Repository(
        partial(open_source, settings),
        None,
        None,
        directory=settings.repository,
        policy=settings.policy(),
    )
    shadowed = settings.shadow_sources() if settings.shadow else []
    try:
        opened = repository.open_at_start(
            settings.sources() + shadowed, settings.load_model_names()
        )
    except SourceError as exc:
        if any(s.uri in str(exc) for s in shadowed):
            raise SourceError(
                f"--shadow: {exc}; a model gets @{settings.shadow_alias} from an export that does not "
                "win against the champion (or set it in the registry); or serve without --shadow"
            ) from None
        raise
    try:
        for _, model in opened:
            warm_up(model, settings.max_batch_size)
    except BaseException:
        for _, model in opened:
            model.discard()
        raise
    return opened


def check_reload(settings: Settings) -> None:
    """--reload-interval only makes sense for an alias; ValueError otherwise."""
    if settings.reload_interval and not any(source.alias for source in settings.sources()):
        given = ", ".join(s.uri for s in settings.sources()) or "none"
        raise ValueError(
            f"--reload-interval polls a registry alias; no --model is models:/<name>@<alias> "
            f"(given: {given})"
        )
