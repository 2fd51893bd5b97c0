"""The server's protocol-neutral core: the models it serves, and the one inference path every front end
calls (KServe V2 over HTTP, MLflow's /invocations, KServe V2 over gRPC, and the shadow's mirror).

    `Server.answer(slot, request, exchange)`  the decoded request of a version -> its id and receipt -> infer (the
                            batcher, following a reload that swapped the version meanwhile) -> payload log -> shadow
                            mirror; the front end encodes what it returns
    `Server.decode(fn, size)` a protocol's decoder on a request: in a thread for a big one, two at a time

A front end (serving/http/ for HTTP, serving/grpc/service.py for gRPC) picks the version a request names
(`model_slot`, `invocations_slot`), decodes it with its codec (codec.py, grpc/codec.py), and hands both to
`answer` inside the envelope (serving/envelope.py: auth, refusal -> status, receipt, metrics). Nothing here
calls back into a front end: the receipt is written on the request's Exchange. Front ends that listen on their
own port (gRPC) are started and stopped by the server's lifespan, which is handed their start functions: this
module imports none of them.

Every model run of every model happens on one engine thread (serving/runner.py), which takes each batch when it
is free to run it. Also here: opening and warming up models at start (`open_models`), the drift window of every
loaded version (serving/drift.py; observed on the engine thread, a batch at a time), and the shadow comparison
of each model that has a challenger (serving/shadow.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from serving import drift, lengths
from serving.batcher import Batcher, BatcherClosed, NotRowWise, QueueFull, RunTimedOut
from serving.classification import classify
from serving.codec import BadRequest, Limits, shape_fits
from serving.config import LARGE_ROW_BYTES, Settings
from serving.console import clip
from serving.engine import GPU_PROVIDERS, Engine, ModelInputError
from serving.envelope import Exchange, Refused, new_request_id
from serving.loader import LoadedModel, ModelInfo, SourceError, load_model
from serving.metrics import Metrics
from serving.payload_log import PayloadLog, Record
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
from serving.shadow import Rule, Shadow, input_digest
from serving.shm import SharedMemory
from serving.staging import NonFinite

log = logging.getLogger("serving.core")
RETRY_AFTER = {"Retry-After": "1"}
BIG_BODY = 64 * 1024  # a request bigger than this is decoded in a thread
SHADOW_QUEUE = (
    64  # mirrored requests waiting for the challenger, per model: past it they are dropped
)
GC_THRESHOLD = (
    20_000  # allocations between two collections of the youngest generation (default 700)
)
DRIFT_CHECK_EVERY = (
    50  # batches between two looks at a version's drift (a log line when it crosses the threshold)
)


def model_summary(info: ModelInfo) -> dict:
    """The model as a payload record names it."""
    return {
        "name": info.name,
        "version": info.version,
        "run_id": info.lineage.get("run_id"),
        "weights_sha256": info.lineage.get("weights_sha256"),
        "onnx_sha256": info.lineage.get("onnx_sha256"),
        "source": info.resolved_source,
    }  # `pipeline trace` follows this, not the served name


def check_request_id(value: str, where: str) -> str:
    """A client's request id, which is echoed in a header: 1 to 128 printable ASCII characters."""
    if not HEADER_SAFE.fullmatch(value):
        raise Refused(
            400,
            f"{where} must be 1 to 128 printable ASCII characters (it is echoed in the "
            f"X-Request-Id response header), got {value!r:.60}",
        )
    return value


@dataclass
class Answer:
    slot: Slot  # the version that computed it (after a reload swap too)
    request_id: str
    request: Any  # what decode returned
    results: dict[str, np.ndarray]


class Server:
    """The state behind the routes (HTTP and gRPC): settings, the model repository, the engine thread, metrics."""

    def __init__(
        self,
        settings: Settings,
        models: LoadedModel | list[tuple[Source, LoadedModel]],
        payload_log: PayloadLog | None = None,
        front_ends: tuple[Callable[["Server"], Awaitable[Any]], ...] = (),
    ):
        self.settings = settings
        self.drift: dict[tuple[str, str], drift.DriftWindow] = {}  # (model, version) -> its window
        self._drift_high: set[tuple[str, str, str, str]] = (
            set()
        )  # (model, version, kind, name) above the threshold
        # One thread runs every model run of every model: onnxruntime parallelizes inside a run, and two runs
        # at once on the same cores only fight. It takes each batch when it is free to run it, the models' batchers
        # in turn (serving/runner.py); warm-ups and other engine work take their turns too (an Executor).
        self.executor = Runner()
        self.metrics = Metrics(queue_rows=self._queued_rows)
        self.repository = Repository(
            partial(open_source, settings),
            self._batcher,
            self.warm_up_between_batches,
            directory=settings.repository,
            policy=settings.policy(),
            default_model=settings.default_model,
        )
        self.repository.on_change = self._announce
        if isinstance(models, LoadedModel):  # one model, opened by the caller (tests, tools)
            models = [
                (
                    settings.sources()[0] if settings.sources() else Source(models.info.source),
                    models,
                )
            ]
        self.repository.place(models)
        self.repository.add_repository_models()  # the rest of the repository: listed, loadable, not loaded
        if (
            settings.default_model is not None
            and settings.default_model not in self.repository.models
        ):
            raise RepositoryError(
                f"--default-model {settings.default_model}: no such model (this server has "
                f"{self.repository.describe()})"
            )
        unknown = [n for n in settings.batching_flags() if n not in self.repository.models]
        if unknown:
            raise RepositoryError(
                f"--batching {unknown[0]}: no such model (this server has "
                f"{self.repository.describe()}); name a model as it is served"
            )
        self._serving = False  # between startup and shutdown
        self._tokens = settings.tokens()  # each client's; none: no auth
        self._followers: list[asyncio.Task] = []
        self._last_request: dict[
            str, dict[str, np.ndarray]
        ] = {}  # model -> the feeds of the last request answered
        self.limits = Limits(settings.max_rows_per_request, settings.max_body_bytes)
        # Clients' shared memory regions (the V2 extensions); CUDA ones once a version runs on a GPU (lifespan).
        self.shared_memory = SharedMemory(
            int(settings.max_shared_memory_mb * (1 << 20)),
            settings.shared_memory == "on",
            tokened=bool(self._tokens),
        )
        # Big bodies decoded at once, over every event loop (HTTP runs several): bounds their memory. Taken by the
        # decoding thread itself, so no loop waits on it.
        self.decoding = threading.BoundedSemaphore(2)
        self.loop: asyncio.AbstractEventLoop | None = (
            None  # the main loop (lifespan): the shadow mirrors live on it
        )
        self.payload_log = payload_log  # started and closed with the server
        if payload_log is not None:
            self.metrics.watch_payload_log(payload_log.stats)
        self.front_ends = (
            front_ends  # started with the server (gRPC), each returning something with stop(grace)
        )
        self._listening: list[Any] = []
        self._stopping: list[asyncio.Future] = []
        self.shadows: dict[
            str, Shadow
        ] = {}  # model -> its champion/challenger comparison (--shadow)
        self._mirrors: dict[str, asyncio.Queue] = {}
        self._mirror_tasks: list[asyncio.Task] = []
        if settings.shadow:
            rule = Rule(**settings.shadow_rule())
            self.shadows = {
                name: Shadow(rule)
                for name, alias in self.repository.aliases()
                if alias.rpartition("@")[2] == settings.shadow_alias
            }
        self.metrics.watch_drift(self._drift_scores)
        self.metrics.watch_shadows(
            lambda: {
                name: self.shadow(name).report()
                for name in self.shadows
                if name in self.repository.models
            }
        )

    @property
    def ready(self) -> bool:
        """Started, not shutting down, at least one version loaded, and every loaded version's batcher running with
        no model run past its deadline. A model unloaded or still loading does not make the server unready (its
        own ready says so); a server with nothing loaded is not ready."""
        slots = [slot for _, slot in self.repository.slots()]
        return self._serving and bool(slots) and all(slot.healthy for slot in slots)

    def model_ready(self, model: Model) -> bool:
        return self._serving and model.ready

    @property
    def slot(self) -> Slot:
        """The default model's default version (what /invocations serves)."""
        return self.repository.slot(self.repository.default_model().name, None)

    def _queued_rows(self) -> list[tuple[str, str, float]]:
        return [
            (name, slot.version, slot.batcher.queued_rows) for name, slot in self.repository.slots()
        ]

    def _batcher(self, model: LoadedModel) -> Batcher:
        s = self.settings
        name, version = model.info.name, model.info.version

        def observe(rows: int, seconds: float, waits: list[float]) -> None:
            self.metrics.observe_batch(name, version, rows, seconds, waits)

        run, run_buffer = self._observed(model)
        cap = batch_cap(model, s.max_batch_size)
        return Batcher(
            run,
            self.executor,
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
            run_buffer=run_buffer,
            arrival_wait_ms=s.arrival_wait_ms,
            incoming=self.incoming,
            name=f"model '{name}' version {version}",
        )

    def incoming(self) -> int:
        """Requests on their way whose model is not named yet: ModelInfer messages the native gRPC engine is still
        receiving (a message names its model inside). Only where one model version is loaded are they certainly
        its, and its batches wait for them as for HTTP bodies arriving (serving/batcher.py); else 0: a flood to
        one model must not hold another's batches. Also 0 where a token is required: a call is counted from its
        headers, before its token is checked, and HTTP counts a body arriving only once its token passed (anyone
        could otherwise hold every batch by opening calls and sending nothing). (Called under a batcher's lock, on the
        engine thread or a loop's kick.)"""
        if self._tokens:
            return 0
        loaded = 0
        for model in list(
            self.repository.models.values()
        ):  # (registered models with no version loaded too)
            loaded += len(model.slots)
        if loaded != 1:
            return 0
        return sum(front_end.receiving() for front_end in self._listening)

    # ---- drift -----------------------------------------------------------------------------------

    def _observed(self, model: LoadedModel) -> tuple[Callable, Callable]:
        """The engine's runs of a batch (its requests' feeds, or a batch buffer), with the batch's inputs and outputs
        added to the version's drift window: on the engine thread, once per batch (not per request, and never on
        the event loop)."""
        reference, window = model.drift_reference, self.settings.drift_window
        if reference is None or not window:
            return model.engine.run_parts, model.engine.run_buffer
        key = (model.info.name, model.info.version)
        self.drift[key] = tracker = drift.DriftWindow(reference, window, model.engine.metadata)
        batches = 0

        def observe(feeds: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> None:
            nonlocal batches
            try:
                tracker.observe(feeds, outputs)
                batches += 1
                if batches % DRIFT_CHECK_EVERY == 0:
                    self._say_drift(key, tracker)
            except Exception:  # noqa: BLE001 - a statistic must never fail an answer
                log.exception("drift statistics of %s version %s failed", *key)

        return partial(model.engine.run_parts, observe=observe), partial(
            model.engine.run_buffer, observe=observe
        )

    def _say_drift(self, key: tuple[str, str], tracker: drift.DriftWindow) -> None:
        """One log line when a tensor's PSI crosses the threshold (and one when it is back under)."""
        threshold = self.settings.drift_threshold
        for (kind, name), (value, samples) in tracker.scores().items():
            if samples < tracker.window // 2:
                continue  # too few samples to say
            flag = (*key, kind, name)
            if value > threshold and flag not in self._drift_high:
                self._drift_high.add(flag)
                log.warning(
                    "drift: %s version %s %s '%s': PSI %.3f > %.2f over the last %d samples",
                    key[0],
                    key[1],
                    kind[:-1],
                    name,
                    value,
                    threshold,
                    samples,
                )
            elif value <= threshold and flag in self._drift_high:
                self._drift_high.discard(flag)
                log.info(
                    "drift: %s version %s %s '%s' back under %.2f (PSI %.3f)",
                    key[0],
                    key[1],
                    kind[:-1],
                    name,
                    threshold,
                    value,
                )

    def _drift_scores(self) -> dict[tuple[str, str, str, str], float]:
        """{(model, version, "inputs"|"outputs", tensor): PSI} of the loaded versions, for /metrics."""
        loaded = {(name, slot.version) for name, slot in self.repository.slots()}
        return {
            (*key, kind, name): value
            for key, tracker in list(self.drift.items())
            if key in loaded
            for (kind, name), (value, _) in tracker.scores().items()
        }

    # ---- the shadow --------------------------------------------------------------------------------

    def challenger_slot(self, model: Model) -> Slot | None:
        """The loaded version behind the shadowed alias of `model`, if any."""
        shadowed = [
            a for a in model.alias_served if a.rpartition("@")[2] == self.settings.shadow_alias
        ]
        return model.slots.get(model.alias_served[shadowed[0]]) if shadowed else None

    def mirror(
        self,
        slot: Slot,
        server_id: str,
        feeds: dict[str, np.ndarray],
        rows: int,
        results: dict[str, np.ndarray],
        champion_ms: float,
        mirrored: bool,
        source: str = "",
    ) -> None:
        """Hands a request drawn for the sample (`mirrored`) to its challenger (never waited for). Shed first
        under load: when the mirror queue is full, or the champion has rows waiting, the pair is dropped and
        counted; the champion's answer is never held up by it. Both answers are kept under `server_id`, the
        server's own id of the request (never one a client chose)."""
        name = slot.model.info.name
        shadow = self.shadows.get(name)
        if shadow is None:
            return
        champion, challenger = self._pair(name, shadow)
        if challenger is None or slot is not champion:
            return  # a request that named another version: not the champion's traffic
        shadow.answered(server_id, results)
        if not mirrored:
            return
        pair = (challenger, slot.version, server_id, feeds, rows, results, champion_ms, source)
        if asyncio.get_running_loop() is self.loop:
            self._enqueue_mirror(name, slot, pair)
        else:  # answered on another HTTP loop: the mirror's queue is the main loop's
            self.loop.call_soon_threadsafe(self._enqueue_mirror, name, slot, pair)

    def _enqueue_mirror(self, name: str, slot: Slot, pair: tuple) -> None:
        queue, shadow = self._mirrors.get(name), self.shadows[name]
        if queue is None or queue.full() or slot.batcher.queued_rows > 0:
            shadow.dropped((slot.version, pair[0].version))
            return
        queue.put_nowait(pair)

    async def _mirror_worker(self, name: str) -> None:
        """One model's mirrored requests, one at a time, on its challenger's batcher."""
        queue, shadow = self._mirrors[name], self.shadows[name]
        while True:
            (
                challenger,
                champion_version,
                rid,
                feeds,
                rows,
                champion,
                champion_ms,
                source,
            ) = await queue.get()
            versions = (champion_version, challenger.version)
            started = time.perf_counter()
            try:
                answer = await asyncio.wait_for(
                    challenger.batcher.submit(feeds, rows), self.settings.request_timeout
                )
            except (QueueFull, BatcherClosed, RunTimedOut, asyncio.TimeoutError):
                shadow.dropped(versions)  # the server's load, not the challenger's fault
                continue
            except Exception as exc:  # noqa: BLE001 - the challenger failing is what the comparison counts
                log.warning(
                    "shadow: %s version %s failed request %s: %s",
                    name,
                    challenger.version,
                    rid,
                    clip(str(exc) or type(exc).__name__, 200),
                )
                shadow.error(versions)
                continue
            took = (time.perf_counter() - started) * 1e3
            digest = await asyncio.to_thread(
                input_digest, feeds
            )  # (a 602 KB image: ~1 ms of hashing, off the loop)
            shadow.pair(
                rid,
                champion,
                answer,
                champion_ms,
                took,
                (champion_version, challenger.version),
                digest,
                source,
            )

    def _pair(self, name: str, shadow: Shadow) -> tuple[Slot | None, Slot | None]:
        """(champion, challenger) served now, and the comparison set to that pairing (a new one starts afresh
        when either moved); (None, None) when there is nothing to compare."""
        model = self.repository.models.get(name)
        champion = model.default_slot() if model is not None else None
        challenger = self.challenger_slot(model) if champion is not None else None
        if challenger is None or challenger is champion:
            return None, None
        info = champion.model.info
        shadow.pairing(champion.version, challenger.version, info.decision, info.prediction)
        return champion, challenger

    def shadow(self, name: str) -> Shadow:
        """The comparison of `name`, paired with the versions served now; Refused 404 when there is none."""
        self.repository.model(name)  # a 404 naming the models for an unknown one
        shadow = self.shadows.get(name)
        if shadow is None:
            raise Refused(
                404,
                f"model '{name}' has no shadow comparison: start the server with --shadow FRACTION "
                f"and the model as models:/<name>@<alias> with an @{self.settings.shadow_alias}",
            )
        self._pair(name, shadow)
        return shadow

    # ---- lifecycle -----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lifespan(self, app=None):
        self.loop = asyncio.get_running_loop()
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
            log.info(
                "payload log: %.0f%% of requests to %s (at most %d bytes, files of %d)",
                self.payload_log.sample * 100,
                self.payload_log.directory,
                self.payload_log.max_bytes,
                self.payload_log.file_bytes,
            )
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
            self._listening.append(await start(self))
        for name in self.shadows:
            self._mirrors[name] = asyncio.Queue(SHADOW_QUEUE)
            self._mirror_tasks.append(
                asyncio.create_task(self._mirror_worker(name), name=f"shadow {name}")
            )
        # What start-up made (imports, MLflow's among them, the models) lives as long as the server: out of the
        # collector's sight, a full collection (a swap's close_slots, or the interpreter's own) scans only what
        # came since. It scanned ~300k objects in ~150 ms on the event loop, holding every in-flight request
        # that long at each alias move. A frozen model's memory still goes when it leaves: close drops its session.
        gc.freeze()
        # A request allocates a few hundred objects, almost none in cycles: the collector's youngest generation,
        # run every 700 allocations by default, ran every few requests for nothing (gc_collect_main in profiles).
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
            for task in self._mirror_tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            for task in self._followers:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await self.repository.close()
            self.shared_memory.close()
            if (
                self.payload_log is not None
            ):  # every request was answered: its records are all queued
                await asyncio.to_thread(self.payload_log.close, self.settings.graceful_timeout)
            self.executor.shutdown(wait=True)
            log.info("stopped")

    def begin_shutdown(self) -> None:
        """SIGTERM: report not ready at once (load balancers stop sending), and let queued requests run now
        instead of waiting out --max-delay-ms, so that the front ends' wait for in-flight requests ends with them
        answered, not cut at --graceful-timeout."""
        self._serving = False
        for _, slot in self.repository.slots():
            slot.batcher.flush()
        self._stop_front_ends()  # gRPC drains alongside HTTP, not after it

    def largest_row_bytes(self) -> int:
        """The bytes of one row of the largest-rowed model loaded now (Engine.row_bytes; 0 when none is loaded or
        none has rows of one size): how large a request's body is, for how many loops take them in
        (Settings.http_loops)."""
        return max((slot.model.engine.row_bytes for _, slot in self.repository.slots()), default=0)

    def layout(self, http_loops: int) -> str:
        """How this server is laid out over threads and cores, in one line for its log."""
        from serving.engine import usable_cpus

        parts = [
            f"HTTP on {http_loops} event loop{'s' if http_loops > 1 else ''}"
            + (" (threads, a socket each: SO_REUSEPORT)" if http_loops > 1 else "")
            + (
                f" (no model loaded at start has rows of {LARGE_ROW_BYTES >> 10} KiB or more: more loops "
                "would share the GIL for little; --http-threads N sets them)"
                if self.settings.http_threads is None and http_loops == 1 and usable_cpus() > 1
                else ""
            )
        ]
        for front_end in self._listening:
            parts.append(getattr(front_end, "layout", "gRPC"))
        engines = {slot.model.engine.threads for _, slot in self.repository.slots()}
        buffers = [
            slot.batcher.buffers
            for _, slot in self.repository.slots()
            if slot.batcher.buffers is not None
        ]
        parts.append(
            f"1 engine thread running every model's batches in turn (onnxruntime "
            f"{'/'.join(map(str, sorted(engines))) or '-'} intra-op threads)"
        )
        if buffers:
            b = buffers[0]
            parts.append(
                f"batch buffers of {b.capacity} rows, up to {b.count} a model version"
                + (", pinned" if b.pin else "")
            )
        return f"{'; '.join(parts)}; {usable_cpus()} CPUs usable"

    def _stop_front_ends(self) -> None:
        if not self._stopping:
            self._stopping = [
                asyncio.ensure_future(f.stop(self.settings.graceful_timeout))
                for f in self._listening
            ]

    def _announce(self) -> None:
        """Metrics of what is loaded now (after every load, unload and alias move)."""
        served = []
        for name, slot in self.repository.slots():
            model, info = slot.model, slot.model.info
            served.append(
                (
                    name,
                    info.version,
                    model.engine.provider,
                    info.source,
                    model.variant,
                    model.engine.options_text(),
                )
            )
            unsafe = [
                h for h, v in receipt_values(info).items() if v and not HEADER_SAFE.fullmatch(v)
            ]
            if unsafe:
                log.warning(
                    "%s version %s: not sending %s: the values are not 1 to 128 printable ASCII characters",
                    name,
                    info.version,
                    ", ".join(unsafe),
                )
        self.metrics.set_models(served)
        versions = {(name, slot.version) for name, slot in self.repository.slots()}
        self.drift = {
            key: window for key, window in self.drift.items() if key in versions
        }  # unloaded: gone
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

    async def warm_up_between_batches(self, model: LoadedModel) -> None:
        """A loaded version's warm-up, one run per batch size on the engine thread, queued between live
        batches: never two runs at once on the device (on a GPU, cuDNN picking algorithms for the new model
        while live traffic runs would time them on a busy device and slow the requests in flight). A live
        batch waits for at most one warm-up run."""
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        sizes = warm_up_sizes(model.engine, batch_cap(model, self.settings.max_batch_size))
        for n in sizes:
            if not await loop.run_in_executor(self.executor, warmed, model, (n,)):
                await self._warm_up_with_last_request(model)
                return
        log.info(
            "%s version %s: warm-up of %d batch sizes done in %.2f s",
            model.info.name,
            model.info.version,
            len(sizes),
            time.perf_counter() - started,
        )

    async def _warm_up_with_last_request(self, model: LoadedModel) -> None:
        """No size can be guessed for an input's other dynamic axis (a sequence length, an image size): a new
        version of a model that is serving runs the last request its model answered instead, so that the first
        requests after a swap do not pay for its allocations. Only a warm-up: its failure is said, not a refusal
        of the version (another version's request may hold values this one does not take)."""
        name, version = model.info.name, model.info.version
        feeds = self._last_request.get(name)
        if feeds is None or not fits(model.engine.inputs, feeds):
            log.info(
                "%s version %s: no warm-up: an input has a dynamic axis besides the batch axis, and no request "
                "answered yet fits this version",
                name,
                version,
            )
            return
        started = time.perf_counter()
        try:
            await asyncio.get_running_loop().run_in_executor(self.executor, model.engine.run, feeds)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            log.warning(
                "%s version %s: warm-up with the last request answered failed (serving it anyway): %s",
                name,
                version,
                clip(str(exc), 300),
            )
            return
        log.info(
            "%s version %s: warm-up with the last request answered (an input has a dynamic axis besides the "
            "batch axis) done in %.2f s",
            name,
            version,
            time.perf_counter() - started,
        )

    # ---- the one inference path ------------------------------------------------------------------
    def check_token(self, header: str) -> None:
        """An `Authorization` value (HTTP header or gRPC metadata) against the tokens, when any is set."""
        if not self._tokens:
            return
        scheme, _, token = header.partition(" ")
        given = token.strip().encode()
        # every token compared, in constant time each: which one matched (or none) takes no less time to find
        matched = [hmac.compare_digest(given, known) for known in self._tokens]
        if scheme.lower() != "bearer" or not any(matched):
            raise Refused(
                401,
                "missing or wrong bearer token: send 'Authorization: Bearer <token>'",
                {"WWW-Authenticate": "Bearer"},
            )

    def check_feedback_token(self, header: str) -> None:
        """Labels' credential (--feedback-token), never the inference token: whoever may ask for answers must not
        thereby decide which version becomes champion."""
        wanted = self.settings.feedback_token
        if wanted is None:
            if self._tokens:
                raise Refused(
                    403,
                    "this server takes no labels: start it with --feedback-token (env "
                    "TRAINSERVE_FEEDBACK_TOKEN), a token of their own, and send that one",
                )
            return  # no auth at all (a loopback server): labels as open as the rest
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), wanted.strip().encode()
        ):
            return
        if any(hmac.compare_digest(token.strip().encode(), known) for known in self._tokens):
            raise Refused(
                403, "labels need the feedback token (--feedback-token), not the inference token"
            )
        raise Refused(
            401,
            "missing or wrong bearer token: labels need 'Authorization: Bearer <the feedback token>'",
            {"WWW-Authenticate": "Bearer"},
        )

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

    def invocations_hint(self, slot: Slot) -> str:
        """On a server of several models, a refusal on /invocations says which one it serves and how to reach
        the others: a client sending another model's inputs would otherwise not know why they don't fit."""
        others = sorted(n for n in self.repository.models if n != slot.model.info.name)
        if not others:
            return ""
        return (
            f" (/invocations serves '{slot.model.info.name}', this server's default model; for "
            f"{', '.join(repr(n) for n in others)} POST /v2/models/{{name}}/infer, or start the server with "
            f"--default-model NAME)"
        )

    @staticmethod
    def decode_now(decode: Callable[[], Any]):
        """A protocol's decoder on its request, here and now. An exception the decoder did not foresee is still the
        client's malformed request: a 400."""
        try:
            return decode()
        except BadRequest:
            raise
        except (
            ValueError,
            TypeError,
            KeyError,
            IndexError,
            AttributeError,
            OverflowError,
            MemoryError,
        ) as exc:
            log.debug("a request the decoder did not foresee", exc_info=True)
            raise BadRequest(
                f"malformed request: {type(exc).__name__}: {clip(str(exc), 200)}"
            ) from None

    async def decode(self, decode: Callable[[], Any], size: int):
        """decode_now, in a thread for a big request (two at a time), inline for a small one."""
        if size <= BIG_BODY:
            return self.decode_now(decode)
        return await asyncio.to_thread(self.in_turn, self.decode_now, decode)

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
        request_id: str | None = None,
        arrival=None,
    ) -> Answer:
        """The one inference path (see the module's docstring): `request` is what the front end decoded for `slot`
        (.feeds, .rows, .request_id: None when the body has none); `request_id` the one its headers or metadata
        gave (checked); `arrival` the batcher's note that its body was on its way (Batcher.arriving), ended when it
        is queued. Refusals raise Refused or BadRequest, the receipt already on `exchange`."""
        rid = request_id
        if rid is None:
            given = getattr(request, "request_id", None)
            # an empty "id" is no id (perf_analyzer sends one): the request gets a fresh one
            rid = check_request_id(given, 'the "id" of the request') if given else new_request_id()
        exchange.answered_by(slot, rid)
        # The server's own id of this answer, whatever the client sent: what the shadow keeps its answers under,
        # so that a client can neither predict nor reuse another's (the receipt's X-Server-Request-Id).
        server_id = exchange.server_id = new_request_id()
        # What outlives the run (the payload log's record, the shadow's mirror) takes a copy of the inputs now: a
        # request received into a batch buffer has views of rows the next batch is received into.
        mirrored = (
            slot.model.info.name in self.shadows and random.random() < self.settings.shadow
        )  # the server's
        # draw, not the request id's hash: a client choosing its ids must not choose which requests judge a challenger
        feeds = owned(request.feeds) if self._keeps(slot, rid, mirrored) else request.feeds
        started = time.perf_counter()
        try:
            results, slot = await self.infer(
                slot, request.feeds, request.rows, follow_swap, arrival
            )
        except (Refused, BadRequest) as exc:
            slot.batcher.statistics.answered(False, exchange.started)
            self.log_payload(rid, endpoint, slot, feeds, None, exc.status, str(exc))
            raise
        except Exception:
            slot.batcher.statistics.answered(False, exchange.started)
            raise
        slot.batcher.statistics.answered(True, exchange.started)
        exchange.answered_by(
            slot, rid
        )  # the version that ran it, whatever the server serves by now
        if (
            slot.model.engine.other_dynamic_axes
        ):  # a new version's warm-up: no size to guess for zeros there
            # One row is enough to warm a version up; kept only for such models (it is a client's data; such a model
            # has no batch buffers: its feeds are its own).
            self._last_request[slot.model.info.name] = (
                {k: v[:1] for k, v in request.feeds.items()}
                if slot.model.engine.batchable
                else request.feeds
            )
        self.log_payload(rid, endpoint, slot, feeds, results)
        self.mirror(
            slot,
            server_id,
            feeds,
            request.rows,
            results,
            (time.perf_counter() - started) * 1e3,
            mirrored,
            exchange.source,
        )
        return Answer(slot, rid, request, answered(slot, request, results))

    def _keeps(self, slot: Slot, request_id: str, mirrored: bool) -> bool:
        """Whether the payload log or the shadow mirror will keep this request's inputs."""
        return mirrored or (self.payload_log is not None and self.payload_log.sampled(request_id))

    async def infer(
        self,
        slot: Slot,
        feeds: dict[str, np.ndarray],
        rows: int,
        follow_swap: bool = True,
        arrival=None,
    ) -> tuple[dict[str, np.ndarray], Slot]:
        """The outputs, and the slot whose model computed them: `slot`, or with `follow_swap` (the client
        named no version) the one a reload put in its place before the request could be queued."""
        lengths.check(
            slot.model.info.max_lengths, feeds, slot.model.info.name
        )  # a 400 naming the limit, not ORT's
        limit = self.settings.max_rows_per_request
        if rows > limit:
            raise Refused(
                400,
                f"the request has {rows} rows; this server takes at most {limit} per request "
                "(--max-rows-per-request): split it",
            )
        timeout = self.settings.request_timeout
        try:
            async with asyncio.timeout(
                timeout
            ):  # (wait_for would make a task of its own per request)
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
        except QueueFull as exc:
            raise Refused(503, f"{exc}; retry later", RETRY_AFTER) from None
        except BatcherClosed as exc:
            raise Refused(503, f"{exc}; retry later", RETRY_AFTER) from None

    async def _submit(
        self, slot: Slot, feeds: dict[str, np.ndarray], rows: int, follow_swap: bool, arrival=None
    ) -> tuple[dict[str, np.ndarray], Slot]:
        try:
            return await slot.batcher.submit(feeds, rows, arrival), slot
        except BatcherClosed:
            if arrival is not None:
                arrival.end()
            # A reload swapped the model between choosing this slot and queueing on it (decoding a big body,
            # or wait_for's task start, lies in between): the new model takes it if its inputs are the same.
            # Named a version: the same version's new slot (a reload of it). Unloaded meanwhile: a 404.
            name = slot.model.info.name
            model = self.repository.models.get(name)
            if model is None or not self._serving:
                raise
            current = model.default_slot() if follow_swap else model.slots.get(slot.version)
            if current is None:
                raise Refused(
                    404,
                    f"model '{name}' version {slot.version} was unloaded while the request "
                    f"waited ({model.state.lower()})",
                ) from None
            if current is slot or current.model.engine.inputs != slot.model.engine.inputs:
                raise
            return await current.batcher.submit(feeds, rows), current

    def log_payload(
        self,
        request_id: str,
        endpoint: str,
        slot: Slot,
        feeds: dict[str, np.ndarray],
        results: dict[str, np.ndarray] | None,
        status: int = 200,
        error: str | None = None,
    ) -> None:
        """Hand a request of the sample to the payload log (queued, never waited for)."""
        if self.payload_log is not None and self.payload_log.sampled(request_id):
            self.payload_log.submit(
                Record(
                    request_id,
                    time.time(),
                    endpoint,
                    status,
                    model_summary(slot.model.info),
                    feeds,
                    results,
                    error,
                )
            )


def answered(slot: Slot, request, results: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The outputs as the request asked for them: those asked as classes, their top K (serving/classification.py)."""
    model = slot.model
    return classify(
        results,
        getattr(request, "classification", None) or {},
        model.engine.batchable,
        model.info.labels_for,
    )


def owned(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A request's feeds as arrays of their own, for what keeps them past its run (the payload log, the shadow
    mirror): a request received into a batch buffer has views of rows the next batch reuses."""
    return {name: np.array(x) for name, x in feeds.items()}


def fits(specs, feeds: dict[str, np.ndarray]) -> bool:
    """The feeds are the inputs `specs` describe: the same names, dtypes and ranks, and every fixed axis's size."""
    return set(feeds) == {spec.name for spec in specs} and all(
        feeds[spec.name].dtype == spec.dtype and shape_fits(spec, feeds[spec.name].shape)
        for spec in specs
    )


def open_source(settings: Settings, source: Source, version: str | None = None) -> LoadedModel:
    """One model source on the provider and variant the settings ask (an alias pinned at `version` when given).
    A repository version directory is that version of its model."""
    s = settings
    name = (
        source.name or s.model_name
    )  # Settings.check: --model-name only beside a single unnamed --model
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

    Batch buckets (the CUDA provider's default): each bucket once, the size its session will only ever see.
    Other GPU: every size the batcher forms from requests (1 to max_batch_size): each new input shape costs the
    CUDA provider a cuDNN algorithm choice and allocations, and TensorRT an engine rebuild if the shape is
    outside the range it has seen, so none of that may land on a request. The largest first, then 1:
    TensorRT's profile then spans every size in between. A single request larger than max_batch_size runs
    alone at its own size, unwarmed (bound it with --max-rows-per-request).
    CPU: 1 and the largest; the CPU provider chooses no algorithm per shape, and the largest batch sizes
    its memory arena.
    """
    if engine.buckets:
        return engine.buckets
    if engine.provider in GPU_PROVIDERS:
        return (max_batch_size, *range(1, max_batch_size))
    return tuple(dict.fromkeys((1, max_batch_size)))


def warmed(model: LoadedModel, sizes: tuple[int, ...]) -> bool:
    """engine.warm_up at `sizes`; a run that shows the version's rows are not independent turned its batching off:
    said in one line naming it, and the warm-up goes on unbatched."""
    try:
        return model.engine.warm_up(sizes)
    except NotRowWise as exc:
        log.error("model '%s' version %s: warm-up: %s", model.info.name, model.info.version, exc)
        return model.engine.warm_up(sizes)


def batch_cap(model: LoadedModel, max_batch_size: int) -> int:
    """The most rows a run of this version gathers: --max-batch-size, or its config.pbtxt's max_batch_size when
    smaller."""
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
    """Every model the settings load at start, opened and warmed up (blocking, before the server starts).
    Raises the first failure: a server does not start half-loaded."""
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
