"""The HTTP app: turns requests into arrays for the batcher, and results back into responses.

Routes (every one needs the bearer token when one is set, except the health checks):
    KServe V2   GET  /v2, /v2/health/live, /v2/health/ready
                GET  /v2/models/{name}[/versions/{v}], .../ready, .../config
                POST /v2/models/{name}[/versions/{v}]/infer
    MLflow      POST /invocations; GET /ping, /health, /version
    Prometheus  GET  /metrics

The served model and its batcher live together in a `Slot`. A reload builds a new slot and swaps
the reference in one assignment on the event loop; requests that already hold the old slot finish
on the old model, whose batcher is then drained and dropped. A reload that fails is tried again with
backoff, and /metrics and /v2/models/{name} say when the server is behind its alias.

Every inference response (V2 JSON or binary, /invocations; errors too once the model is known) carries a
receipt: X-Request-Id (the client's X-Request-Id, else the V2 body's "id", else a fresh one) and the
X-Model-Name, -Version, -Run-Id and -Weights-Sha256 of the model that ran it: the slot the request was
queued on, never "the current model" at answer time, which a reload may have changed meanwhile. When a
payload log is on, a sample of requests is handed to it (serving/payload_log.py) without waiting.

Every client mistake is a 4xx, checked before work where a limit applies: a client that goes away
mid-upload is a 499 (nginx's code; nothing is sent), never a 500 or a traceback. Bodies over 64 KiB
are decoded in a thread (two at a time), not on the event loop. Cross-site requests: Host is checked
against the loopback names when bound to loopback (DNS rebinding), a request carrying a browser
Origin not in --allowed-origins gets 403, and inference refuses the content types a web page can send
without a preflight (text/plain, forms). Health checks skip auth and these checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import hmac
import logging
import re
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

import serving
from serving.console import clip
from serving import codec, lengths
from serving.batcher import Batcher, BatcherClosed, QueueFull, RunTimedOut
from serving.codec import BadRequest, Limits
from serving.config import Settings
from serving.engine import GPU_PROVIDERS, ModelInputError
from serving.loader import LoadedModel, ModelInfo, SourceError, load_model
from serving.metrics import Metrics
from serving.payload_log import PayloadLog, Record
from serving.repository import (
    HEADER_SAFE,
    READY,
    Model,
    Repository,
    RepositoryError,
    Slot,
    Source,
    off_loop,
    receipt_values,
    version_key,
)

log = logging.getLogger("serving.app")
JSON = "application/json"
RETRY_AFTER = {"Retry-After": "1"}
BIG_BODY = 64 * 1024  # decoded in a thread above this
INDEX_MAX_AGE_S = 1.0  # the repository index reuses a directory scan this recent; a load always scans afresh
# What a web page can POST cross-site without a CORS preflight: never an inference request.
SIMPLE_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")


class HTTPError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers


def model_summary(info: ModelInfo) -> dict:
    """The model as a payload record names it."""
    return {"name": info.name, "version": info.version, "run_id": info.lineage.get("run_id"),
            "weights_sha256": info.lineage.get("weights_sha256"), "onnx_sha256": info.lineage.get("onnx_sha256"),
            "source": info.resolved_source}  # `pipeline trace` follows this, not the served name


def check_request_id(value: str, where: str) -> str:
    """A client's request id, which is echoed in a header: 1 to 128 printable ASCII characters."""
    if not HEADER_SAFE.fullmatch(value):
        raise HTTPError(400, f"{where} must be 1 to 128 printable ASCII characters (it is echoed in the "
                             f"X-Request-Id response header), got {value!r:.60}")
    return value


class Server:
    """The state behind the routes (HTTP and gRPC): settings, the model repository, the engine thread, metrics."""

    def __init__(self, settings: Settings, models: LoadedModel | list[tuple[Source, LoadedModel]],
                 payload_log: PayloadLog | None = None):
        self.settings = settings
        # One thread runs every model run of every model: onnxruntime parallelizes inside a run, and two runs
        # at once on the same cores only fight. Each batcher queues at most one run on it at a time, so the
        # thread's FIFO order takes the models' runs in turn (see serving/repository.py).
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.metrics = Metrics(queue_rows=self._queued_rows)
        self.repository = Repository(partial(open_source, settings), self._batcher, self.warm_up_between_batches,
                                     directory=settings.repository, policy=settings.policy(),
                                     default_model=settings.default_model)
        self.repository.on_change = self._announce
        if isinstance(models, LoadedModel):  # one model, opened by the caller (tests, tools)
            models = [(settings.sources()[0] if settings.sources() else Source(models.info.source), models)]
        self.repository.place(models)
        self.repository.add_repository_models()  # the rest of the repository: listed, loadable, not loaded
        if settings.default_model is not None and settings.default_model not in self.repository.models:
            raise RepositoryError(f"--default-model {settings.default_model}: no such model (this server has "
                                  f"{self.repository.describe()})")
        self._serving = False  # between startup and shutdown
        self._token = settings.auth_token.encode() if settings.auth_token else None
        self._followers: list[asyncio.Task] = []
        self.limits = Limits(settings.max_rows_per_request, settings.max_body_bytes)
        self.decoding = asyncio.Semaphore(2)  # big bodies decoded at once: bounds their memory
        self._hosts = settings.host_patterns()
        self._origins = settings.origins()
        self.payload_log = payload_log  # started and closed with the server
        if payload_log is not None:
            self.metrics.watch_payload_log(payload_log.stats)
        self.grpc = None  # the gRPC server, when --grpc-port is given (started with the app)
        self._grpc_stopped: asyncio.Future | None = None

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
        return [(name, slot.version, slot.batcher.queued_rows) for name, slot in self.repository.slots()]

    def _batcher(self, model: LoadedModel) -> Batcher:
        s = self.settings
        name, version = model.info.name, model.info.version

        def observe(rows: int, seconds: float, waits: list[float]) -> None:
            self.metrics.observe_batch(name, version, rows, seconds, waits)

        return Batcher(model.engine.run, self.executor, max_batch_size=s.max_batch_size,
                       max_delay_ms=s.max_delay_ms, max_queue_rows=s.max_queue_rows,
                       merge=model.engine.batchable, on_batch=observe, run_timeout=s.run_timeout)

    # ---- lifecycle -----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette):
        self.repository.start()
        self._announce()
        for _, slot in self.repository.slots():
            info = slot.model.info
            log.info("serving %s version %s from %s on %s", info.name, info.version, info.source,
                     slot.model.engine.describe())
        if self.payload_log is not None:
            self.payload_log.start()
            log.info("payload log: %.0f%% of requests to %s (at most %d bytes, files of %d)",
                     self.payload_log.sample * 100, self.payload_log.directory, self.payload_log.max_bytes,
                     self.payload_log.file_bytes)
        if self.settings.reload_interval:
            self._followers = [asyncio.create_task(
                self.repository.follow(name, alias, self.settings.reload_interval, self._alias_event),
                name=f"follow {alias}") for name, alias in self.repository.aliases()]
        if self.settings.grpc_port is not None:
            from serving.grpc.service import start_grpc

            self.grpc = await start_grpc(self)
        self._serving = True
        try:
            yield
        finally:
            # uvicorn gets here after SIGTERM, once it stopped accepting and in-flight requests
            # were answered; drain what is still queued anyway.
            self._serving = False
            if self.grpc is not None:
                if self._grpc_stopped is None:
                    self._grpc_stopped = asyncio.ensure_future(self.grpc.stop(self.settings.graceful_timeout))
                await self._grpc_stopped
            for task in self._followers:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await self.repository.close()
            if self.payload_log is not None:  # every request was answered: its records are all queued
                await asyncio.to_thread(self.payload_log.close, self.settings.graceful_timeout)
            self.executor.shutdown(wait=True)
            log.info("stopped")

    def begin_shutdown(self) -> None:
        """SIGTERM: report not ready at once (load balancers stop sending), and let queued requests run now
        instead of waiting out --max-delay-ms, so that uvicorn's wait for in-flight requests ends with them
        answered, not cut at --graceful-timeout."""
        self._serving = False
        for _, slot in self.repository.slots():
            slot.batcher.flush()
        if self.grpc is not None and self._grpc_stopped is None:  # gRPC drains alongside HTTP, not after it
            self._grpc_stopped = asyncio.ensure_future(self.grpc.stop(self.settings.graceful_timeout))

    def _announce(self) -> None:
        """Metrics of what is loaded now (after every load, unload and alias move)."""
        served = []
        for name, slot in self.repository.slots():
            model, info = slot.model, slot.model.info
            served.append((name, info.version, model.engine.provider, info.source, model.variant,
                           model.engine.options_text()))
            unsafe = [h for h, v in receipt_values(info).items() if v and not HEADER_SAFE.fullmatch(v)]
            if unsafe:
                log.warning("%s version %s: not sending %s: the values are not 1 to 128 printable ASCII characters",
                            name, info.version, ", ".join(unsafe))
        self.metrics.set_models(served)
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
        sizes = warm_up_sizes(model.engine.provider, self.settings.max_batch_size)
        for n in sizes:
            if not await loop.run_in_executor(self.executor, model.engine.warm_up, (n,)):
                log.info("no warm-up: an input has a dynamic axis besides the batch axis")
                return
        log.info("%s version %s: warm-up of %d batch sizes done in %.2f s", model.info.name, model.info.version,
                 len(sizes), time.perf_counter() - started)

    # ---- helpers for routes --------------------------------------------------------------------

    def check_origin(self, request: Request) -> None:
        """Cross-site requests: a Host this server does not go by (DNS rebinding), a browser Origin not allowed."""
        host = request.headers.get("host", "")  # absent only without HTTP/1.1 (never from a browser)
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        if host and not any(fnmatch.fnmatchcase(name.lower(), pattern) for pattern in self._hosts):
            raise HTTPError(403, f"Host {host!r} is not one this server answers; add it with --allowed-hosts")
        origin = request.headers.get("origin")
        if origin is not None and origin.rstrip("/") not in self._origins:
            raise HTTPError(403, f"cross-site requests from {origin!r} are refused; allow an origin with "
                                 "--allowed-origins")

    def authorize(self, request: Request) -> None:
        self.check_token(request.headers.get("authorization", ""))

    def check_token(self, header: str) -> None:
        """An `Authorization` value (HTTP header or gRPC metadata) against the token, when one is set."""
        if self._token is None:
            return
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._token):
            raise HTTPError(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>'",
                            {"WWW-Authenticate": "Bearer"})

    def model_slot(self, name: str, version: str | None) -> Slot:
        try:
            return self.repository.slot(name, version)
        except RepositoryError as exc:
            raise HTTPError(exc.status, str(exc)) from None

    def invocations_slot(self) -> Slot:
        try:
            return self.repository.slot(self.repository.default_model().name, None)
        except RepositoryError as exc:
            raise HTTPError(exc.status, f"/invocations serves the default model: {exc}") from None

    def invocations_hint(self, slot: Slot) -> str:
        """On a server of several models, a refusal on /invocations says which one it serves and how to reach
        the others: a client sending another model's inputs would otherwise not know why they don't fit."""
        others = sorted(n for n in self.repository.models if n != slot.model.info.name)
        if not others:
            return ""
        return (f" (/invocations serves '{slot.model.info.name}', this server's default model; for "
                f"{', '.join(repr(n) for n in others)} POST /v2/models/{{name}}/infer, or start the server with "
                f"--default-model NAME)")

    async def body(self, request: Request) -> bytes:
        limit = self.settings.max_body_bytes
        too_large = f"the body exceeds the limit of {limit} bytes (--max-body-bytes)"
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise HTTPError(413, too_large)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPError(413, too_large)
            chunks.append(chunk)
        data = b"".join(chunks)
        encoding = request.headers.get("content-encoding", "identity").lower()
        if encoding == "identity":
            return data
        if encoding not in ("gzip", "deflate"):
            raise HTTPError(415, f"Content-Encoding {encoding} is not supported; use gzip, deflate or none")
        # Bounded: a small compressed body must not inflate past the limit.
        inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
        try:
            data = inflater.decompress(data, limit + 1)
        except zlib.error as exc:
            raise HTTPError(400, f"the body is not valid {encoding} data: {exc}") from None
        if len(data) > limit:
            raise HTTPError(413, too_large + " once decompressed")
        if not inflater.eof:
            raise HTTPError(400, f"the {encoding} body is truncated")
        return data

    async def decode(self, decoder, data: bytes, *args):
        """A codec decoder on the body: in a thread for a big body (two at a time), inline for a small one.
        An exception the decoder did not foresee is still the client's malformed request: a 400."""
        def safely():
            try:
                return decoder(data, *args)
            except BadRequest:
                raise
            except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, MemoryError) as exc:
                log.debug("a request the decoder did not foresee", exc_info=True)
                raise BadRequest(f"malformed request: {type(exc).__name__}: {clip(str(exc), 200)}") from None

        if len(data) <= BIG_BODY:
            return safely()
        async with self.decoding:
            return await asyncio.to_thread(safely)

    async def infer(self, slot: Slot, feeds: dict[str, np.ndarray], rows: int,
                    follow_swap: bool = True) -> tuple[dict[str, np.ndarray], Slot]:
        """The outputs, and the slot whose model computed them: `slot`, or with `follow_swap` (the client
        named no version) the one a reload put in its place before the request could be queued."""
        lengths.check(slot.model.info.max_lengths, feeds, slot.model.info.name)  # a 400 naming the limit, not ORT's
        limit = self.settings.max_rows_per_request
        if rows > limit:
            raise HTTPError(400, f"the request has {rows} rows; this server takes at most {limit} per request "
                                 "(--max-rows-per-request): split it")
        timeout = self.settings.request_timeout
        try:
            return await asyncio.wait_for(self._submit(slot, feeds, rows, follow_swap), timeout)
        except asyncio.TimeoutError:
            raise HTTPError(504, f"no answer within {timeout:g} s (--request-timeout); the server is overloaded or "
                                 "a model run is stuck") from None
        except RunTimedOut as exc:
            raise HTTPError(504, str(exc)) from None
        except ModelInputError as exc:
            raise HTTPError(400, str(exc)) from None
        except QueueFull as exc:
            raise HTTPError(503, f"{exc}; retry later", RETRY_AFTER) from None
        except BatcherClosed as exc:
            raise HTTPError(503, f"{exc}; retry later", RETRY_AFTER) from None

    async def _submit(self, slot: Slot, feeds: dict[str, np.ndarray], rows: int,
                      follow_swap: bool) -> tuple[dict[str, np.ndarray], Slot]:
        try:
            return await slot.batcher.submit(feeds, rows), slot
        except BatcherClosed:
            # A reload swapped the model between choosing this slot and queueing on it (decoding a big body,
            # or wait_for's task start, lies in between): the new model takes it if its inputs are the same.
            # Named a version: the same version's new slot (a reload of it). Unloaded meanwhile: a 404.
            name = slot.model.info.name
            model = self.repository.models.get(name)
            if model is None or not self._serving:
                raise
            current = model.default_slot() if follow_swap else model.slots.get(slot.version)
            if current is None:
                raise HTTPError(404, f"model '{name}' version {slot.version} was unloaded while the request "
                                     f"waited ({model.state.lower()})") from None
            if current is slot or current.model.engine.inputs != slot.model.engine.inputs:
                raise
            return await current.batcher.submit(feeds, rows), current

    def log_payload(self, request_id: str, endpoint: str, slot: Slot, feeds: dict[str, np.ndarray],
                    results: dict[str, np.ndarray] | None, status: int = 200, error: str | None = None) -> None:
        """Hand a request of the sample to the payload log (queued, never waited for)."""
        if self.payload_log is not None and self.payload_log.sampled(request_id):
            self.payload_log.submit(Record(request_id, time.time(), endpoint, status,
                                           model_summary(slot.model.info), feeds, results, error))


def open_source(settings: Settings, source: Source, version: str | None = None) -> LoadedModel:
    """One model source on the provider and variant the settings ask (an alias pinned at `version` when given).
    A repository version directory is that version of its model."""
    s = settings
    name = source.name or s.model_name  # Settings.check: --model-name only beside a single unnamed --model
    return load_model(source.uri, device=s.device, threads=s.threads, name=name, version=version or source.version,
                      device_id=s.device_id, variant=s.variant, gpu=s.gpu_options())


def warm_up_sizes(provider: str, max_batch_size: int) -> tuple[int, ...]:
    """The batch sizes to run before serving.

    GPU: every size the batcher forms from requests (1 to max_batch_size): each new input shape costs the
    CUDA provider a cuDNN algorithm choice and allocations, and TensorRT an engine rebuild if the shape is
    outside the range it has seen, so none of that may land on a request. The largest first, then 1:
    TensorRT's profile then spans every size in between. A single request larger than max_batch_size runs
    alone at its own size, unwarmed (bound it with --max-rows-per-request).
    CPU: 1 and the largest; the CPU provider chooses no algorithm per shape, and the largest batch sizes
    its memory arena.
    """
    if provider in GPU_PROVIDERS:
        return (max_batch_size, *range(1, max_batch_size))
    return tuple(dict.fromkeys((1, max_batch_size)))


def warm_up(model: LoadedModel, max_batch_size: int) -> None:
    """Run the model at the warm-up sizes (warm_up_sizes) before the server says it is ready."""
    started = time.perf_counter()
    sizes = warm_up_sizes(model.engine.provider, max_batch_size)
    if model.engine.warm_up(sizes):
        log.info("%s version %s: warm-up of %d batch sizes done in %.2f s", model.info.name, model.info.version,
                 len(sizes), time.perf_counter() - started)
    else:
        log.info("%s: no warm-up: an input has a dynamic axis besides the batch axis", model.info.name)


def open_models(settings: Settings) -> list[tuple[Source, LoadedModel]]:
    """Every model the settings load at start, opened and warmed up (blocking, before the server starts).
    Raises the first failure: a server does not start half-loaded."""
    repository = Repository(partial(open_source, settings), None, None, directory=settings.repository,
                            policy=settings.policy())
    opened = repository.open_at_start(settings.sources(), settings.load_model_names())
    try:
        for _, model in opened:
            warm_up(model, settings.max_batch_size)
    except BaseException:
        for _, model in opened:
            model.discard()
        raise
    return opened


def error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(codec.dumps({"error": message}), status, headers=headers, media_type=JSON)


EXTENSIONS = ["binary_tensor_data", "model_configuration", "model_repository", "grpc"]


def create_app(settings: Settings, models: LoadedModel | list[tuple[Source, LoadedModel]],
               payload_log: PayloadLog | None = None) -> Starlette:
    """The ASGI app serving `models` (already loaded and warmed up: one LoadedModel, or (source, model) pairs),
    with an optional payload log (not yet started: the app's lifespan starts and closes it)."""
    server = Server(settings, models, payload_log)

    def client_error(request: Request, status: int, message: str) -> None:
        """A client's mistake, once, in our format (onnxruntime's own error line is switched off: see console)."""
        if 400 <= status < 500:
            log.warning("%s %s -> %d: %s", request.method, request.url.path, status, message)

    def endpoint(route: str, handler, open_: bool = False):
        """Wraps a handler with auth, error mapping and metrics: cheaper than middleware."""
        async def wrapped(request: Request) -> Response:
            started = time.perf_counter()
            try:
                if not open_:
                    server.check_origin(request)
                    server.authorize(request)
                response = await handler(request)
            except HTTPError as exc:
                response = error(exc.status, str(exc), exc.headers)
                client_error(request, exc.status, str(exc))
            except BadRequest as exc:  # RepositoryError too
                response = error(exc.status, str(exc))
                client_error(request, exc.status, str(exc))
            except ClientDisconnect:  # the client went away mid-upload: its event, not our error
                log.debug("%s %s: the client disconnected before its request arrived", request.method,
                          request.url.path)
                response = error(499, "client closed the request")
            except Exception as exc:
                log.exception("%s %s failed", request.method, request.url.path)
                response = error(500, f"internal error: {type(exc).__name__}: {exc}")
            receipt = getattr(request.state, "receipt", None)
            if receipt:  # an inference request: the model that answered, and the request's id
                response.headers.update(receipt)
            name, version = getattr(request.state, "model", ("", ""))
            server.metrics.observe_request(route, response.status_code, time.perf_counter() - started, name, version)
            return response
        return wrapped

    def json(obj, status: int = 200) -> Response:
        return Response(codec.dumps(obj), status, media_type=JSON)

    # ---- KServe V2 ----

    async def v2_server(request: Request) -> Response:
        extensions = [e for e in EXTENSIONS if e != "grpc" or settings.grpc_port is not None]
        return json({"name": "trainserve", "version": serving.__version__, "extensions": extensions})

    async def live(request: Request) -> Response:
        return json({"live": True})

    async def ready(request: Request) -> Response:
        return json({"ready": server.ready}, 200 if server.ready else 503)

    def _slot(request: Request) -> Slot:
        return server.model_slot(request.path_params["name"], request.path_params.get("version"))

    async def model_metadata(request: Request) -> Response:
        slot = _slot(request)
        model = server.repository.models[slot.model.info.name]
        engine, info = slot.model.engine, slot.model.info
        body = {"name": info.name, "versions": sorted(model.slots, key=version_key), "platform": "onnxruntime_onnx",
                "inputs": [{"name": s.name, "datatype": s.datatype, "shape": list(s.shape)}
                           for s in engine.inputs],
                "outputs": [{"name": s.name, "datatype": s.datatype, "shape": list(s.shape)}
                            for s in engine.outputs]}
        if "version" in request.path_params:
            body["versions"] = [info.version]
        parameters = {"labels": list(info.labels)} if info.labels is not None else {}
        parameters.update(info.lineage)  # the version's lineage, from the file's metadata
        parameters["source"] = info.source
        if info.max_lengths:  # the longest inputs it was exported for: longer ones get a 400
            parameters["max_lengths"] = {name: {str(a): n for a, n in axes.items()}
                                         for name, axes in info.max_lengths.items()}
        alias = slot.source.alias
        if alias is not None and settings.reload_interval:  # following an alias: what it names, and whether served
            named = model.alias_versions.get(alias, info.version)
            parameters["alias"] = {"source": alias, "version": named, "behind": model.behind(alias)}
        body["parameters"] = parameters
        return json(body)

    async def model_ready(request: Request) -> Response:
        name = request.path_params["name"]
        model = server.repository.models.get(name)
        if model is None:
            _slot(request)  # the 404, worded as for every other model route
        if "version" in request.path_params:
            _slot(request)
        ok = server.model_ready(model)
        return json({"name": name, "ready": ok}, 200 if ok else 503)

    async def model_config(request: Request) -> Response:
        slot = _slot(request)
        engine = slot.model.engine
        batched = engine.batchable

        def dims(s):
            return list(s.shape[1:] if batched else s.shape)

        return json({"name": slot.model.info.name, "platform": "onnxruntime_onnx", "backend": "onnxruntime",
                     "max_batch_size": settings.max_batch_size if batched else 0,
                     "input": [{"name": s.name, "data_type": f"TYPE_{s.datatype}", "dims": dims(s)}
                               for s in engine.inputs],
                     "output": [{"name": s.name, "data_type": f"TYPE_{s.datatype}", "dims": dims(s)}
                                for s in engine.outputs]})

    def request_id(request: Request) -> str | None:
        given = request.headers.get("x-request-id")
        return None if given is None else check_request_id(given, "the X-Request-Id header")

    def receipt(request: Request, slot: Slot, rid: str | None) -> None:
        """The headers of this request's answer, as far as known (also sent with an error)."""
        request.state.receipt = {**slot.headers, **({"X-Request-Id": rid} if rid is not None else {})}
        request.state.model = (slot.model.info.name, slot.version)

    async def v2_infer(request: Request) -> Response:
        slot = _slot(request)  # 404 before reading a body for an unknown model
        receipt(request, slot, None)
        rid = request_id(request)
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type in SIMPLE_TYPES:
            raise HTTPError(415, f"Content-Type {content_type} is not taken for inference (a web page can send it "
                                 "cross-site); send application/json, or application/octet-stream with binary data")
        data = await server.body(request)
        header_length = request.headers.get("inference-header-content-length")
        if header_length is not None:
            if not re.fullmatch(r"[0-9]{1,19}", header_length):
                raise HTTPError(400, f"Inference-Header-Content-Length must be a byte count, got {header_length!r:.40}")
            header_length = int(header_length)
        slot = _slot(request)  # after the await: a reload may have swapped the model meanwhile
        receipt(request, slot, rid)
        engine = slot.model.engine
        req = await server.decode(codec.decode_v2, data, header_length, engine.inputs, engine.output_names,
                                  server.limits)
        if rid is None:
            rid = check_request_id(req.request_id, 'the "id" of the request') if req.request_id is not None \
                else uuid.uuid4().hex
        receipt(request, slot, rid)
        endpoint = "/v2/models/{name}" + ("/versions/{version}" if "version" in request.path_params else "") + "/infer"
        try:
            results, slot = await server.infer(slot, req.feeds, req.rows, "version" not in request.path_params)
        except HTTPError as exc:
            server.log_payload(rid, endpoint, slot, req.feeds, None, exc.status, str(exc))
            raise
        receipt(request, slot, rid)  # the model that ran it, whatever the server serves by now
        server.log_payload(rid, endpoint, slot, req.feeds, results)
        info, engine = slot.model.info, slot.model.engine
        # The V2 "id": the body's when given (the protocol echoes it), else the request id of the headers.
        v2_id = rid if req.request_id is None else req.request_id
        body, json_length = codec.encode_v2(info.name, info.version, v2_id, results, req.outputs, engine.outputs)
        if json_length is None:
            return Response(body, media_type=JSON)
        return Response(body, media_type="application/octet-stream",
                        headers={"Inference-Header-Content-Length": str(json_length)})

    # ---- MLflow scoring ----

    async def invocations(request: Request) -> Response:
        slot = server.invocations_slot()
        receipt(request, slot, None)
        rid = request_id(request) or uuid.uuid4().hex
        receipt(request, slot, rid)
        content_type = request.headers.get("content-type", JSON).split(";")[0].strip().lower()
        if content_type != JSON:
            raise HTTPError(415, f"Content-Type {content_type} is not supported; send application/json")
        data = await server.body(request)
        slot = server.invocations_slot()
        receipt(request, slot, rid)
        try:
            req = await server.decode(codec.decode_mlflow, data, slot.model.engine.inputs, server.limits)
        except BadRequest as exc:
            raise BadRequest(f"{exc}{server.invocations_hint(slot)}", exc.status) from None
        try:
            results, slot = await server.infer(slot, req.feeds, req.rows)
        except HTTPError as exc:
            server.log_payload(rid, "/invocations", slot, req.feeds, None, exc.status, str(exc))
            if exc.status == 400:
                raise HTTPError(400, f"{exc}{server.invocations_hint(slot)}", exc.headers) from None
            raise
        receipt(request, slot, rid)  # the model that ran it, whatever the server serves by now
        server.log_payload(rid, "/invocations", slot, req.feeds, results)
        return Response(codec.encode_mlflow(results, req.records), media_type=JSON)

    async def ping(request: Request) -> Response:
        return Response(b"\n", 200 if server.ready else 503, media_type=JSON)

    async def version(request: Request) -> Response:
        info = server.invocations_slot().model.info
        return json({"server": "trainserve", "version": serving.__version__, "model_name": info.name,
                     "model_version": info.version})

    # ---- V2 repository extension ----

    async def repository_index(request: Request) -> Response:
        body = await control_body(request)
        only_ready = body.get("ready", False)
        if not isinstance(only_ready, bool):
            raise HTTPError(400, f'"ready" must be true or false, got {only_ready!r:.40}')
        if settings.repository:  # models added to the directory since are listed (not loaded)
            try:
                await off_loop(partial(server.repository.add_repository_models, max_age=INDEX_MAX_AGE_S))
            except SourceError as exc:
                log.warning("reading --repository: %s", exc)
        rows = server.repository.index()
        return json([r for r in rows if r["state"] == READY] if only_ready else rows)

    def check_control() -> None:
        if settings.control() != "explicit":
            raise HTTPError(403, "loading and unloading models is off on this server; start it with "
                                 "--model-control explicit to allow it")

    async def repository_load(request: Request) -> Response:
        check_control()
        body = await control_body(request)
        parameters = body.get("parameters", {})
        if not isinstance(parameters, dict):
            raise HTTPError(400, '"parameters" must be a JSON object')
        if parameters:  # Triton's are `config` and `file:<path>`; answering 200 to ignore them would mislead
            raise HTTPError(400, f"load parameters {sorted(parameters)[:10]} are not taken: this server takes none; it "
                                 "loads a model only from its --model flags or --repository directory (with "
                                 "--version-policy), never from files, a config or options a client sends")
        name = request.path_params["name"]
        try:
            await server.repository.load(name)
        except RepositoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - a model that cannot be loaded: the client named it
            raise HTTPError(400, f"failed to load '{name}': {exc}") from None
        return json({})

    async def repository_unload(request: Request) -> Response:
        check_control()
        await control_body(request)
        await server.repository.unload(request.path_params["name"])
        return json({})

    async def control_body(request: Request) -> dict:
        """The optional JSON object of a repository request."""
        data = await server.body(request)
        if not data.strip():
            return {}
        parsed = codec.parse_json(data)
        if not isinstance(parsed, dict):
            raise HTTPError(400, "the body must be a JSON object (or empty)")
        return parsed

    async def metrics(request: Request) -> Response:
        return Response(server.metrics.render(), media_type=server.metrics.content_type)

    routes = []

    def add(path: str, handler, methods=("GET",), open_: bool = False) -> None:
        routes.append(Route(path, endpoint(path, handler, open_), methods=list(methods)))

    add("/v2", v2_server)
    add("/v2/health/live", live, open_=True)
    add("/v2/health/ready", ready, open_=True)
    for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        add(prefix, model_metadata)
        add(prefix + "/ready", model_ready)
        add(prefix + "/config", model_config)
        add(prefix + "/infer", v2_infer, methods=("POST",))
    add("/v2/repository/index", repository_index, methods=("POST",))
    add("/v2/repository/models/{name}/load", repository_load, methods=("POST",))
    add("/v2/repository/models/{name}/unload", repository_unload, methods=("POST",))
    add("/invocations", invocations, methods=("POST",))
    add("/ping", ping, open_=True)
    add("/health", ping, open_=True)
    add("/version", version)
    add("/metrics", metrics)

    async def not_routed(request: Request, exc) -> Response:
        # Paths and methods no route takes: the same {"error"} body as everything else.
        status = getattr(exc, "status_code", 404)
        server.metrics.observe_request("unmatched", status, 0.0)
        return error(status, f"{request.method} {request.url.path}: {getattr(exc, 'detail', 'not found')}; "
                             "see /v2 (KServe V2), /invocations (MLflow), /metrics")

    app = Starlette(routes=routes, lifespan=server.lifespan,
                    exception_handlers={404: not_routed, 405: not_routed})
    app.state.server = server
    return app


def check_reload(settings: Settings) -> None:
    """--reload-interval only makes sense for an alias; ValueError otherwise."""
    if settings.reload_interval and not any(source.alias for source in settings.sources()):
        given = ", ".join(s.uri for s in settings.sources()) or "none"
        raise ValueError(f"--reload-interval polls a registry alias; no --model is models:/<name>@<alias> "
                         f"(given: {given})")
