"""The HTTP app: turns requests into arrays for the batcher, and results back into responses.

Routes (every one needs the bearer token when one is set, except the health checks):
    KServe V2   GET  /v2, /v2/health/live, /v2/health/ready
                GET  /v2/models/{name}[/versions/{v}], .../ready, .../config
                POST /v2/models/{name}[/versions/{v}]/infer
    MLflow      POST /invocations; GET /ping, /health, /version
    Prometheus  GET  /metrics

The served model and its batcher live together in a `Slot`. A reload builds a new slot and swaps
the reference in one assignment on the event loop; requests that already hold the old slot finish
on the old model, whose batcher is then drained and dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import serving
from serving import codec
from serving.batcher import Batcher, BatcherClosed, QueueFull
from serving.codec import BadRequest
from serving.config import Settings
from serving.engine import EngineError
from serving.loader import LoadedModel, SourceError, alias_version, check_source, load_model
from serving.metrics import Metrics

log = logging.getLogger("serving.app")
JSON = "application/json"
RETRY_AFTER = {"Retry-After": "1"}


class HTTPError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers


@dataclass
class Slot:
    """A loaded model and the batcher in front of it: swapped as one."""
    model: LoadedModel
    batcher: Batcher


class Server:
    """The state behind the routes: settings, the current slot, the engine thread, metrics."""

    def __init__(self, settings: Settings, model: LoadedModel):
        self.settings = settings
        # One thread runs every model run: onnxruntime parallelizes inside a run, and two runs
        # at once on the same cores only fight (also across a reload's old and new model).
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.metrics = Metrics(queue_rows=lambda: self.slot.batcher.queued_rows)
        self.slot = Slot(model, self._batcher(model))
        self._serving = False  # between startup and shutdown
        self._token = settings.auth_token.encode() if settings.auth_token else None
        self._reloader: asyncio.Task | None = None

    @property
    def ready(self) -> bool:
        """Started, not shutting down, and the current batcher's loop is running."""
        return self._serving and self.slot.batcher.alive

    def _batcher(self, model: LoadedModel) -> Batcher:
        s = self.settings
        return Batcher(model.engine.run, self.executor, max_batch_size=s.max_batch_size,
                       max_delay_ms=s.max_delay_ms, max_queue_rows=s.max_queue_rows,
                       merge=model.engine.batchable, on_batch=self.metrics.observe_batch)

    # ---- lifecycle -----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette):
        self.slot.batcher.start()
        self._announce(self.slot.model)
        if self.settings.reload_interval:
            self._reloader = asyncio.create_task(self._reload_loop(), name="reloader")
        self._serving = True
        try:
            yield
        finally:
            # uvicorn gets here after SIGTERM, once it stopped accepting and in-flight requests
            # were answered; drain what is still queued anyway.
            self._serving = False
            if self._reloader is not None:
                self._reloader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._reloader
            await self.slot.batcher.close()
            self.executor.shutdown(wait=True)
            self.slot.model.discard()
            log.info("stopped")

    def _announce(self, model: LoadedModel) -> None:
        info = model.info
        log.info("serving %s version %s from %s on %s", info.name, info.version, info.source,
                 model.engine.describe())
        self.metrics.set_model(info.name, info.version, model.engine.provider, info.source)

    async def _reload_loop(self) -> None:
        s = self.settings
        broken = None  # a version that failed to load: not fetched again until the alias moves on
        while True:
            await asyncio.sleep(s.reload_interval)
            current = self.slot.model.info.version
            version = None
            try:
                version = await asyncio.to_thread(alias_version, s.model)
                if version in (current, broken):
                    continue
                log.info("alias %s moved from version %s to %s; loading it", s.model, current, version)
                model = await asyncio.to_thread(self._load_warm, version)
            except (SourceError, EngineError) as exc:  # the registry is away, the new file is bad
                log.warning("reload of %s failed; still serving version %s: %s", s.model, current, exc)
                broken = version
                continue
            except Exception:
                log.exception("reload of %s failed; still serving version %s", s.model, current)
                broken = version
                continue
            await self.swap(model)

    def _load_warm(self, version: str) -> LoadedModel:
        s = self.settings
        model = load_model(s.model, device=s.device, threads=s.threads, name=s.model_name, version=version,
                           device_id=s.device_id)
        warm_up(model, s.max_batch_size)
        return model

    async def swap(self, model: LoadedModel) -> None:
        old = self.slot
        new = Slot(model, self._batcher(model))
        new.batcher.start()
        self.slot = new  # from here on, requests go to the new model
        self.metrics.reloads.inc()
        self._announce(model)
        await old.batcher.close()  # requests already queued on the old model finish there
        old.model.discard()

    # ---- helpers for routes --------------------------------------------------------------------

    def authorize(self, request: Request) -> None:
        if self._token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._token):
            raise HTTPError(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>'",
                            {"WWW-Authenticate": "Bearer"})

    def model_slot(self, name: str, version: str | None) -> Slot:
        slot = self.slot
        info = slot.model.info
        if name != info.name or (version is not None and version != info.version):
            asked = f"'{name}'" + (f" version {version}" if version is not None else "")
            raise HTTPError(404, f"unknown model {asked}; this server serves '{info.name}' version {info.version}")
        return slot

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

    async def infer(self, slot: Slot, feeds: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
        limit = self.settings.max_rows_per_request
        if rows > limit:
            raise HTTPError(400, f"the request has {rows} rows; this server takes at most {limit} per request "
                                 "(--max-rows-per-request): split it")
        try:
            return await slot.batcher.submit(feeds, rows)
        except QueueFull as exc:
            raise HTTPError(503, f"{exc}; retry later", RETRY_AFTER) from None
        except BatcherClosed as exc:
            raise HTTPError(503, f"{exc}; retry later", RETRY_AFTER) from None


def warm_up(model: LoadedModel, max_batch_size: int) -> None:
    """Run the model at batch 1 and at the largest batch before the server says it is ready."""
    started = time.perf_counter()
    if model.engine.warm_up((1, max_batch_size)):
        log.info("warm-up done in %.2f s", time.perf_counter() - started)
    else:
        log.info("no warm-up: an input has a dynamic axis besides the batch axis")


def error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(codec.dumps({"error": message}), status, headers=headers, media_type=JSON)


def create_app(settings: Settings, model: LoadedModel) -> Starlette:
    """The ASGI app serving `model` (already loaded and warmed up)."""
    server = Server(settings, model)

    def endpoint(route: str, handler, open_: bool = False):
        """Wraps a handler with auth, error mapping and metrics: cheaper than middleware."""
        async def wrapped(request: Request) -> Response:
            started = time.perf_counter()
            try:
                if not open_:
                    server.authorize(request)
                response = await handler(request)
            except HTTPError as exc:
                response = error(exc.status, str(exc), exc.headers)
            except BadRequest as exc:
                response = error(exc.status, str(exc))
            except Exception as exc:
                log.exception("%s %s failed", request.method, request.url.path)
                response = error(500, f"internal error: {type(exc).__name__}: {exc}")
            server.metrics.observe_request(route, response.status_code, time.perf_counter() - started)
            return response
        return wrapped

    def json(obj, status: int = 200) -> Response:
        return Response(codec.dumps(obj), status, media_type=JSON)

    # ---- KServe V2 ----

    async def v2_server(request: Request) -> Response:
        return json({"name": "trainserve", "version": serving.__version__,
                     "extensions": ["binary_tensor_data", "model_configuration"]})

    async def live(request: Request) -> Response:
        return json({"live": True})

    async def ready(request: Request) -> Response:
        return json({"ready": server.ready}, 200 if server.ready else 503)

    def _slot(request: Request) -> Slot:
        return server.model_slot(request.path_params["name"], request.path_params.get("version"))

    async def model_metadata(request: Request) -> Response:
        slot = _slot(request)
        engine, info = slot.model.engine, slot.model.info
        body = {"name": info.name, "versions": [info.version], "platform": "onnxruntime_onnx",
                "inputs": [{"name": s.name, "datatype": s.datatype, "shape": list(s.shape)}
                           for s in engine.inputs],
                "outputs": [{"name": s.name, "datatype": s.datatype, "shape": list(s.shape)}
                            for s in engine.outputs]}
        if info.labels is not None:
            body["parameters"] = {"labels": list(info.labels)}
        return json(body)

    async def model_ready(request: Request) -> Response:
        slot = _slot(request)
        return json({"name": slot.model.info.name, "ready": server.ready}, 200 if server.ready else 503)

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

    async def v2_infer(request: Request) -> Response:
        _slot(request)  # 404 before reading a body for an unknown model
        data = await server.body(request)
        header_length = request.headers.get("inference-header-content-length")
        if header_length is not None:
            if not header_length.isdigit():
                raise HTTPError(400, f"Inference-Header-Content-Length must be a byte count, got {header_length!r}")
            header_length = int(header_length)
        slot = _slot(request)  # after the await: a reload may have swapped the model meanwhile
        engine = slot.model.engine
        req = codec.decode_v2(data, header_length, engine.inputs, engine.output_names)
        results = await server.infer(slot, req.feeds, req.rows)
        info = slot.model.info
        body, json_length = codec.encode_v2(info.name, info.version, req.request_id, results, req.outputs,
                                            engine.outputs)
        if json_length is None:
            return Response(body, media_type=JSON)
        return Response(body, media_type="application/octet-stream",
                        headers={"Inference-Header-Content-Length": str(json_length)})

    # ---- MLflow scoring ----

    async def invocations(request: Request) -> Response:
        content_type = request.headers.get("content-type", JSON).split(";")[0].strip().lower()
        if content_type != JSON:
            raise HTTPError(415, f"Content-Type {content_type} is not supported; send application/json")
        data = await server.body(request)
        slot = server.slot
        req = codec.decode_mlflow(data, slot.model.engine.inputs)
        results = await server.infer(slot, req.feeds, req.rows)
        return Response(codec.encode_mlflow(results, req.records), media_type=JSON)

    async def ping(request: Request) -> Response:
        return Response(b"\n", 200 if server.ready else 503, media_type=JSON)

    async def version(request: Request) -> Response:
        info = server.slot.model.info
        return json({"server": "trainserve", "version": serving.__version__, "model_name": info.name,
                     "model_version": info.version})

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
    if settings.reload_interval and check_source(settings.model) != "alias":
        raise ValueError(f"--reload-interval polls a registry alias; '{settings.model}' is not "
                         "models:/<name>@<alias>")
