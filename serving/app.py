"""The HTTP front end: KServe V2 and MLflow's scoring protocol over HTTP, turned into calls of the server's
one inference path (serving/core.py) and its answers back into responses.

Routes (every one needs the bearer token when one is set, except the health checks):
    KServe V2   GET  /v2, /v2/health/live, /v2/health/ready
                GET  /v2/models/{name}[/versions/{v}], .../ready, .../config
                POST /v2/models/{name}[/versions/{v}]/infer
    MLflow      POST /invocations; GET /ping, /health, /version
    Shadow      GET  /v2/models/{name}/shadow (--shadow); POST /v2/models/{name}/feedback (labels)
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
import fnmatch
import logging
import re
import time
import uuid
import zlib
from functools import partial

import numpy as np
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

import serving
from serving import codec
from serving.codec import BadRequest
from serving.config import Settings
from serving.core import Call, Refused, Server, check_request_id
from serving.loader import LoadedModel, SourceError
from serving.payload_log import PayloadLog
from serving.repository import READY, RepositoryError, Slot, Source, off_loop, version_key

log = logging.getLogger("serving.app")
JSON = "application/json"
INDEX_MAX_AGE_S = 1.0  # the repository index reuses a directory scan this recent; a load always scans afresh
# What a web page can POST cross-site without a CORS preflight: never an inference request.
SIMPLE_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")
FEEDBACK_MAX = 10000  # labels in one feedback request


def check_origin(server: Server, request: Request) -> None:
    """Cross-site requests: a Host this server does not go by (DNS rebinding), a browser Origin not allowed."""
    host = request.headers.get("host", "")  # absent only without HTTP/1.1 (never from a browser)
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    if host and not any(fnmatch.fnmatchcase(name.lower(), pattern) for pattern in server._hosts):
        raise Refused(403, f"Host {host!r} is not one this server answers; add it with --allowed-hosts")
    origin = request.headers.get("origin")
    if origin is not None and origin.rstrip("/") not in server._origins:
        raise Refused(403, f"cross-site requests from {origin!r} are refused; allow an origin with "
                             "--allowed-origins")

def authorize(server: Server, request: Request) -> None:
    server.check_token(request.headers.get("authorization", ""))


async def read_body(server: Server, request: Request) -> bytes:
    limit = server.settings.max_body_bytes
    too_large = f"the body exceeds the limit of {limit} bytes (--max-body-bytes)"
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise Refused(413, too_large)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise Refused(413, too_large)
        chunks.append(chunk)
    data = b"".join(chunks)
    encoding = request.headers.get("content-encoding", "identity").lower()
    if encoding == "identity":
        return data
    if encoding not in ("gzip", "deflate"):
        raise Refused(415, f"Content-Encoding {encoding} is not supported; use gzip, deflate or none")
    # Bounded: a small compressed body must not inflate past the limit.
    inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    try:
        data = inflater.decompress(data, limit + 1)
    except zlib.error as exc:
        raise Refused(400, f"the body is not valid {encoding} data: {exc}") from None
    if len(data) > limit:
        raise Refused(413, too_large + " once decompressed")
    if not inflater.eof:
        raise Refused(400, f"the {encoding} body is truncated")
    return data


def error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(codec.dumps({"error": message}), status, headers=headers, media_type=JSON)


EXTENSIONS = ["binary_tensor_data", "model_configuration", "model_repository", "grpc"]


def create_app(settings: Settings, models: LoadedModel | list[tuple[Source, LoadedModel]],
               payload_log: PayloadLog | None = None) -> Starlette:
    """The ASGI app serving `models` (already loaded and warmed up: one LoadedModel, or (source, model) pairs),
    with an optional payload log (not yet started: the app's lifespan starts and closes it)."""
    front_ends = ()
    if settings.grpc_port is not None:  # KServe V2 over gRPC on its own port, started with the server
        from serving.grpc.service import start_grpc

        front_ends = (start_grpc,)
    server = Server(settings, models, payload_log, front_ends)

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
                    check_origin(server, request)
                    authorize(server, request)
                response = await handler(request)
            except Refused as exc:
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
            if alias in model.alias_errors:  # behind because its load failed: why, and that the old one serves
                parameters["alias"]["error"] = model.alias_errors[alias]
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
        named = "version" in request.path_params
        slot = _slot(request)  # 404 before reading a body for an unknown model
        receipt(request, slot, None)
        rid = request_id(request)
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type in SIMPLE_TYPES:
            raise Refused(415, f"Content-Type {content_type} is not taken for inference (a web page can send it "
                               "cross-site); send application/json, or application/octet-stream with binary data")
        data = await read_body(server, request)
        header_length = request.headers.get("inference-header-content-length")
        if header_length is not None:
            if not re.fullmatch(r"[0-9]{1,19}", header_length):
                raise Refused(400, f"Inference-Header-Content-Length must be a byte count, got {header_length!r:.40}")
            header_length = int(header_length)
        answer = await server.answer(Call(
            pick=lambda: _slot(request),  # again after the await: a reload may have swapped the model meanwhile
            follow_swap=not named, request_id=rid, size=len(data),
            endpoint="/v2/models/{name}" + ("/versions/{version}" if named else "") + "/infer",
            decode=lambda engine: codec.decode_v2(data, header_length, engine.inputs, engine.output_names,
                                                  server.limits),
            receipt=lambda slot, rid: receipt(request, slot, rid)))
        req, info, engine = answer.request, answer.slot.model.info, answer.slot.model.engine
        # The V2 "id": the body's when given (the protocol echoes it), else the request id of the headers.
        v2_id = answer.request_id if req.request_id is None else req.request_id
        body, json_length = codec.encode_v2(info.name, info.version, v2_id, answer.results, req.outputs,
                                            engine.outputs)
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
            raise Refused(415, f"Content-Type {content_type} is not supported; send application/json")
        data = await read_body(server, request)
        try:
            answer = await server.answer(Call(
                pick=server.invocations_slot, follow_swap=True, request_id=rid, endpoint="/invocations",
                size=len(data), decode=lambda engine: codec.decode_mlflow(data, engine.inputs, server.limits),
                receipt=lambda slot, rid: receipt(request, slot, rid)))
        except (BadRequest, Refused) as exc:
            if exc.status != 400:
                raise
            # Another model's inputs sent here: say which model /invocations serves and how to reach the others.
            raise Refused(400, f"{exc}{server.invocations_hint(server.invocations_slot())}") from None
        return Response(codec.encode_mlflow(answer.results, answer.request.records), media_type=JSON)

    # ---- the challenger on live traffic ----

    async def shadow(request: Request) -> Response:
        return json(server.shadow(request.path_params["name"]).report())

    async def feedback(request: Request) -> Response:
        """Labels that arrived later: {"labels": [{"id": "<X-Request-Id>", "target": ...}, ...]}, joined with
        what the champion and the challenger answered for those requests."""
        shadow = server.shadow(request.path_params["name"])
        parsed = codec.parse_json(await read_body(server, request))
        items = parsed.get("labels") if isinstance(parsed, dict) else None
        if not isinstance(items, list) or not items:
            raise Refused(400, 'the body must be {"labels": [{"id": "<the X-Request-Id of an answer>", "target": '
                               '<its true class index, mask or value>}, ...]}')
        if len(items) > FEEDBACK_MAX:
            raise Refused(413, f"{len(items)} labels in one request; send at most {FEEDBACK_MAX} at a time")
        labels = {}
        for i, item in enumerate(items):
            if not (isinstance(item, dict) and isinstance(item.get("id"), str) and "target" in item):
                raise Refused(400, f'labels[{i}] must be {{"id": "<request id>", "target": <value>}}, got '
                                   f"{codec.dumps(item)[:80]!r}")
            try:
                labels[item["id"]] = np.asarray(item["target"], dtype=np.float64)
            except (TypeError, ValueError):
                raise Refused(400, f"labels[{i}].target must be a number or a (nested) list of numbers") from None
        try:  # off the loop: thousands of per-pixel labels are real work
            joined = await asyncio.to_thread(shadow.feedback, labels)
        except ValueError as exc:
            raise Refused(400, str(exc)) from None
        return json(joined | {"report": await asyncio.to_thread(shadow.report)})

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
            raise Refused(400, f'"ready" must be true or false, got {only_ready!r:.40}')
        if settings.repository:  # models added to the directory since are listed (not loaded)
            try:
                await off_loop(partial(server.repository.add_repository_models, max_age=INDEX_MAX_AGE_S))
            except SourceError as exc:
                log.warning("reading --repository: %s", exc)
        rows = server.repository.index()
        return json([r for r in rows if r["state"] == READY] if only_ready else rows)

    def check_control() -> None:
        if settings.control() != "explicit":
            raise Refused(403, "loading and unloading models is off on this server; start it with "
                                 "--model-control explicit to allow it")

    async def repository_load(request: Request) -> Response:
        check_control()
        body = await control_body(request)
        parameters = body.get("parameters", {})
        if not isinstance(parameters, dict):
            raise Refused(400, '"parameters" must be a JSON object')
        if parameters:  # Triton's are `config` and `file:<path>`; answering 200 to ignore them would mislead
            raise Refused(400, f"load parameters {sorted(parameters)[:10]} are not taken: this server takes none; it "
                                 "loads a model only from its --model flags or --repository directory (with "
                                 "--version-policy), never from files, a config or options a client sends")
        name = request.path_params["name"]
        try:
            await server.repository.load(name)
        except RepositoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - a model that cannot be loaded: the client named it
            raise Refused(400, f"failed to load '{name}': {exc}") from None
        return json({})

    async def repository_unload(request: Request) -> Response:
        check_control()
        await control_body(request)
        await server.repository.unload(request.path_params["name"])
        return json({})

    async def control_body(request: Request) -> dict:
        """The optional JSON object of a repository request."""
        data = await read_body(server, request)
        if not data.strip():
            return {}
        parsed = codec.parse_json(data)
        if not isinstance(parsed, dict):
            raise Refused(400, "the body must be a JSON object (or empty)")
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
    add("/v2/models/{name}/shadow", shadow)
    add("/v2/models/{name}/feedback", feedback, methods=("POST",))
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
