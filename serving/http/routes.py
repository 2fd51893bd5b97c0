"""The HTTP routes: one table, and a plain function per route, `handler(server, request, exchange)
-> Response`.

    KServe V2   GET  /v2, /v2/health/live, /v2/health/ready GET  /v2/models/{name}[/versions/{v}],
                .../ready, .../config, .../stats; /v2/models/stats POST
                /v2/models/{name}[/versions/{v}]/infer
                     /v2/{system,cuda}sharedmemory[/region/{region}]/status|register|unregister (serving/shm.py)
    MLflow      POST /invocations; GET /ping, /health, /version
    Shadow      GET  /v2/models/{name}/shadow (--shadow); POST /v2/models/{name}/feedback (labels)
    Repository  POST /v2/repository/index, /v2/repository/models/{name}/load, .../unload
The extensions' operations (config, repository, statistics) are serving/extensions.py's, shared with
gRPC.
    Prometheus  GET  /metrics

A route that takes a body names where it goes (`body(server, request, exchange, length, chunked)`,
called when the head has arrived, after the token was checked): its checks that need no body run
there, so that a refused request costs no body, and an inference route picks its model version then
(a 404 before any byte of the body). Every route but the health checks needs the bearer token when
one is set. Inference refuses the content types a web page can send cross-site without a CORS
preflight (text/plain, forms). Everything else of the envelope (refusal -> status, receipt, metrics)
is the connection's (serving/http/connection.py), written once.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
import weakref
import zlib
from dataclasses import dataclass
from functools import partial
from typing import Awaitable, Callable

import numpy as np

import serving
from serving import codec, extensions, image_inputs
from serving.codec import BadRequest
from serving.core import Server, check_request_id, decode_now
from serving.envelope import Exchange, Refused, new_request_id
from serving.http import bodies
from serving.http.wire import JSON, Request, Response, json_response, too_large
from serving.repository import version_key

# What a web page can POST cross-site without a CORS preflight: never an inference request.
SIMPLE_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")
# labels in one feedback request
FEEDBACK_MAX = 10000
# A binary V2 request's last step (NaN/Inf over its arrays) runs on the event loop up to this many
# bytes: it costs ~25 us for a 602 KB image, less than a hop to a thread and back.
FINISH_INLINE_BYTES = 4 << 20
# a JSON body this small (shared-memory requests) is looked up among the headers seen
SEEN_BODY_BYTES = 4096
Handler = Callable[[Server, Request, Exchange], Awaitable[Response]]


# ---- bodies: where each route's body goes, and its checks made when the head arrived -------------


def content_encoding(request: Request) -> str:
    encoding = request.header("content-encoding", "identity").lower()
    if encoding not in ("identity", "gzip", "deflate"):
        raise Refused(
            415, f"Content-Encoding {encoding} is not supported; use gzip, deflate or none"
        )
    return encoding


def whole_body(server: Server, request: Request, exchange: Exchange, length: int, chunked: bool):
    content_encoding(request)
    return bodies.Chunked(server.settings.max_body_bytes) if chunked else bodies.Bytes(length)


def body_bytes(server: Server, request: Request) -> bytes:
    """The request's body, inflated when it came gzip- or deflate-encoded (bounded: a small
    compressed body must not inflate past the limit)."""
    data = request.body
    encoding = content_encoding(request)
    if encoding == "identity":
        return data
    limit = server.settings.max_body_bytes
    inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    try:
        data = inflater.decompress(data, limit + 1)
    except zlib.error as exc:
        raise Refused(400, f"the body is not valid {encoding} data: {exc}") from None
    if len(data) > limit:
        raise Refused(
            413, too_large(request.headers, f"more than {limit} bytes", limit, " once decompressed")
        )
    if not inflater.eof:
        raise Refused(400, f"the {encoding} body is truncated")
    return data


def request_id(request: Request) -> str | None:
    """The client's X-Request-Id, checked; None when it sent none."""
    given = request.headers.get("x-request-id")
    return None if given is None else check_request_id(given, "the X-Request-Id header")


def header_length(request: Request) -> int | None:
    value = request.headers.get("inference-header-content-length")
    if value is None:
        return None
    if not re.fullmatch(r"[0-9]{1,19}", value):
        raise Refused(
            400, f"Inference-Header-Content-Length must be a byte count, got {value!r:.40}"
        )
    return int(value)


def v2_body(server: Server, request: Request, exchange: Exchange, length: int, chunked: bool):
    """A V2 inference request: its version (404 before the body), id, content type and header length
    checked; a binary request's body straight into its arrays (bodies.V2Binary)."""
    # The receipt from here on: the version, then the header's id (else the body's, or a fresh one).
    slot = exchange.slot = server.model_slot(request.params["name"], request.params.get("version"))
    exchange.request_id = request_id(request)
    content_type = request.header("content-type").split(";")[0].strip().lower()
    # an image file, for a version that takes them
    if image_inputs.is_image(content_type):
        image_inputs.takes_files(slot, content_type)
        return whole_body(server, request, exchange, length, chunked)
    if content_type in SIMPLE_TYPES:
        raise Refused(
            415,
            f"Content-Type {content_type} is not taken for inference (a web page can send it "
            "cross-site); send application/json, or application/octet-stream with binary data",
        )
    json_length = header_length(request)
    # A batch about to run waits for it a little (Batcher).
    request.arrival = arrival = slot.batcher.arriving()
    engine, inputs = slot.model.engine, image_inputs.request_inputs(slot.model)
    # Straight into the arrays the request runs in: for inputs of a fixed size an element (BYTES
    # ones are read from the whole body, element by element: codec.decode_v2).
    if (
        json_length is not None
        and not chunked
        and 0 < json_length <= length
        and content_encoding(request) == "identity"
        and not any(codec.is_bytes(s) for s in inputs)
    ):
        return bodies.V2Binary(
            json_length,
            length,
            inputs,
            engine.output_names,
            server.limits,
            place=partial(slot.batcher.place, arrival),
            seen=_seen_headers(engine),
            model=slot.model.info.name,
        )
    return whole_body(server, request, exchange, length, chunked)


# engine -> its V2 headers already checked
_SEEN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _seen_headers(engine) -> dict:
    seen = _SEEN.get(engine)
    if seen is None:
        seen = _SEEN[engine] = {}
    return seen


def invocations_body(
    server: Server, request: Request, exchange: Exchange, length: int, chunked: bool
):
    # The receipt: MLflow's body has no id, so the header's or a fresh one is the request's.
    slot = server.invocations_slot()
    exchange.slot, exchange.request_id = slot, request_id(request) or new_request_id()
    content_type = request.header("content-type", JSON).split(";")[0].strip().lower()
    # an image file, for a version that takes them
    if image_inputs.is_image(content_type):
        image_inputs.takes_files(slot, content_type)
    elif content_type != JSON:
        raise Refused(
            415,
            f"Content-Type {content_type} is not supported; send application/json"
            + (
                f", or an image file as {', '.join(sorted(image_inputs.CONTENT_TYPES))}"
                if slot.model.images is not None
                else ""
            ),
        )
    return whole_body(server, request, exchange, length, chunked)


# ---- KServe V2 -----------------------------------------------------------------------------------


async def v2_server(server: Server, request: Request, exchange: Exchange) -> Response:
    return json_response(
        {
            "name": "trainserve",
            "version": serving.__version__,
            "extensions": extensions.extensions(server),
        }
    )


async def live(server: Server, request: Request, exchange: Exchange) -> Response:
    return json_response({"live": True})


async def ready(server: Server, request: Request, exchange: Exchange) -> Response:
    return json_response({"ready": server.ready}, 200 if server.ready else 503)


def _slot(server: Server, request: Request):
    return server.model_slot(request.params["name"], request.params.get("version"))


async def model_metadata(server: Server, request: Request, exchange: Exchange) -> Response:
    slot = _slot(server, request)
    model = server.repository.models[slot.model.info.name]
    engine, info = slot.model.engine, slot.model.info
    body = {
        "name": info.name,
        "versions": sorted(model.slots, key=version_key),
        "platform": "onnxruntime_onnx",
        "inputs": [
            {"name": s.name, "datatype": s.datatype, "shape": list(s.shape)}
            for s in image_inputs.request_inputs(slot.model)
        ],
        "outputs": [
            {"name": s.name, "datatype": s.datatype, "shape": list(s.shape)} for s in engine.outputs
        ],
    }
    if "version" in request.params:
        body["versions"] = [info.version]
    parameters = {"labels": list(info.labels)} if info.labels is not None else {}
    # the version's lineage, from the file's metadata
    parameters.update(info.lineage)
    parameters["source"] = info.source
    # what its image input is: what a file becomes, and how to send one
    if slot.model.images is not None:
        parameters["image_input"] = slot.model.images.describe()
    # the longest inputs it was exported for: longer ones get a 400
    if info.max_lengths:
        parameters["max_lengths"] = {
            name: {str(a): n for a, n in axes.items()} for name, axes in info.max_lengths.items()
        }
    alias = slot.source.alias
    # following an alias: what it names, and whether served
    if alias is not None and server.settings.reload_interval:
        named = model.alias_versions.get(alias, info.version)
        parameters["alias"] = {"source": alias, "version": named, "behind": model.behind(alias)}
        # behind because its load failed: why, and that the old one serves
        if alias in model.alias_errors:
            parameters["alias"]["error"] = model.alias_errors[alias]
    body["parameters"] = parameters
    return json_response(body)


async def model_ready(server: Server, request: Request, exchange: Exchange) -> Response:
    name = request.params["name"]
    model = server.repository.models.get(name)
    if model is None or "version" in request.params:
        # the 404, worded as for every other model route
        _slot(server, request)
    ok = server.model_ready(model)
    return json_response({"name": name, "ready": ok}, 200 if ok else 503)


async def model_config(server: Server, request: Request, exchange: Exchange) -> Response:
    return json_response(
        extensions.model_config(server, request.params["name"], request.params.get("version"))
    )


async def model_stats(server: Server, request: Request, exchange: Exchange) -> Response:
    return json_response(
        extensions.statistics(server, request.params.get("name"), request.params.get("version"))
    )


async def v2_infer(server: Server, request: Request, exchange: Exchange) -> Response:
    # The shared memory regions the request names are held until it ends (serving/shm.py: Use).
    regions = server.shared_memory.use(request.header("authorization"), request.params["name"])
    try:
        return await _v2_infer(server, request, exchange, regions)
    finally:
        regions.close()


async def _v2_infer(server: Server, request: Request, exchange: Exchange, regions) -> Response:
    slot, named = exchange.slot, "version" in request.params
    engine = slot.model.engine
    body, shared = request.body, regions.read
    if isinstance(body, bodies.V2Binary) and body.binary_bytes <= FINISH_INLINE_BYTES:
        decoded = decode_now(partial(body.finish, shared))
        request.arrival.checked, request.arrival.filled = body.checked, body.placed
    elif isinstance(body, bodies.V2Binary):
        decoded = await server.decode(partial(body.finish, shared), body.length)
    elif image_inputs.is_image(
        content_type := request.header("content-type").split(";")[0].strip().lower()
    ):
        decoded = image_inputs.file_request(slot, body_bytes(server, request), content_type)
    else:
        data = body_bytes(server, request)
        decoded = await server.decode(
            partial(
                codec.decode_v2,
                data,
                header_length(request),
                image_inputs.request_inputs(slot.model),
                engine.output_names,
                server.limits,
                shared,
                _seen_headers(engine) if len(data) <= SEEN_BODY_BYTES else None,
                partial(slot.batcher.place, request.arrival),
                model=slot.model.info.name,
            ),
            len(data),
        )
    regions.hold(decoded.output_refs)
    answer = await server.answer(
        slot,
        decoded,
        exchange,
        follow_swap=not named,
        endpoint="/v2/models/{name}" + ("/versions/{version}" if named else "") + "/infer",
        arrival=request.arrival,
    )
    info, engine = answer.slot.model.info, answer.slot.model.engine
    # The V2 "id": the body's when given (the protocol echoes it), else the request's.
    v2_id = answer.request_id if decoded.request_id is None else decoded.request_id
    placed = regions.write(decoded.output_refs, answer.results) if decoded.output_refs else None
    payload, json_length = codec.encode_v2(
        info.name, info.version, v2_id, answer.results, decoded.outputs, engine.outputs, placed
    )
    if json_length is None:
        return Response(200, payload)
    return Response(
        200,
        payload,
        "application/octet-stream",
        {"Inference-Header-Content-Length": str(json_length)},
    )


# ---- MLflow scoring ------------------------------------------------------------------------------


async def invocations(server: Server, request: Request, exchange: Exchange) -> Response:
    slot = exchange.slot
    data = body_bytes(server, request)
    content_type = request.header("content-type").split(";")[0].strip().lower()
    try:
        if image_inputs.is_image(content_type):
            decoded = image_inputs.file_request(slot, data, content_type, classified=False)
        else:
            decoded = await server.decode(
                partial(codec.decode_mlflow, data, slot.model.engine.inputs, server.limits),
                len(data),
            )
        answer = await server.answer(
            slot, decoded, exchange, follow_swap=True, endpoint="/invocations"
        )
    except (BadRequest, Refused) as exc:
        if exc.status != 400:
            raise
        raise Refused(400, f"{exc}{invocations_hint(server, server.invocations_slot())}") from None
    if isinstance(decoded, image_inputs.FileRequest):
        return Response(200, image_inputs.invocations_answer(answer))
    return Response(200, codec.encode_mlflow(answer.results, answer.request.records))


def invocations_hint(server: Server, slot) -> str:
    """On a server of several models, a refusal on /invocations says which one it serves and how to
    reach the others: a client sending another model's inputs would otherwise not know why they
    don't fit."""
    others = sorted(n for n in server.repository.models if n != slot.model.info.name)
    if not others:
        return ""
    return (
        f" (/invocations serves '{slot.model.info.name}', this server's default model; for "
        f"{', '.join(repr(n) for n in others)} POST /v2/models/{{name}}/infer, or start the server "
        f"with --default-model NAME)"
    )


async def ping(server: Server, request: Request, exchange: Exchange) -> Response:
    return Response(200 if server.ready else 503, b"\n")


async def version(server: Server, request: Request, exchange: Exchange) -> Response:
    info = server.invocations_slot().model.info
    return json_response(
        {
            "server": "trainserve",
            "version": serving.__version__,
            "model_name": info.name,
            "model_version": info.version,
        }
    )


# ---- the challenger on live traffic --------------------------------------------------------------


async def shadow(server: Server, request: Request, exchange: Exchange) -> Response:
    return json_response(server.mirror.comparison(request.params["name"]).report())


async def feedback(server: Server, request: Request, exchange: Exchange) -> Response:
    """Labels that arrived later: {"labels": [{"id": "<X-Server-Request-Id>", "target": ...}, ...]},
    joined with what the champion and the challenger answered for those requests
    (serving/shadow.py)."""
    comparison = server.mirror.comparison(request.params["name"])
    parsed = codec.parse_json(body_bytes(server, request))
    items = parsed.get("labels") if isinstance(parsed, dict) else None
    if not isinstance(items, list) or not items:
        raise Refused(
            400,
            'the body must be {"labels": [{"id": "<the X-Server-Request-Id of an answer>", "target": '
            "<its true class index, mask or value>}, ...]}",
        )
    if len(items) > FEEDBACK_MAX:
        raise Refused(
            413, f"{len(items)} labels in one request; send at most {FEEDBACK_MAX} at a time"
        )
    labels = {}
    for i, item in enumerate(items):
        if not (isinstance(item, dict) and isinstance(item.get("id"), str) and "target" in item):
            raise Refused(
                400,
                f'labels[{i}] must be {{"id": "<X-Server-Request-Id>", "target": <value>}}, got '
                f"{codec.dumps(item)[:80]!r}",
            )
        try:
            labels[item["id"]] = np.asarray(item["target"], dtype=np.float64)
        except (TypeError, ValueError):
            raise Refused(
                400, f"labels[{i}].target must be a number or a (nested) list of numbers"
            ) from None
    # off the loop: thousands of per-pixel labels are real work
    try:
        joined = await asyncio.to_thread(comparison.feedback, labels)
    except ValueError as exc:
        raise Refused(400, str(exc)) from None
    return json_response(joined | {"report": await asyncio.to_thread(comparison.report)})


# ---- V2 repository extension ---------------------------------------------------------------------


def control_body(server: Server, request: Request) -> dict:
    """The optional JSON object of a repository request."""
    data = body_bytes(server, request)
    if not data.strip():
        return {}
    parsed = codec.parse_json(data)
    if not isinstance(parsed, dict):
        raise Refused(400, "the body must be a JSON object (or empty)")
    return parsed


async def repository_index(server: Server, request: Request, exchange: Exchange) -> Response:
    only_ready = control_body(server, request).get("ready", False)
    if not isinstance(only_ready, bool):
        raise Refused(400, f'"ready" must be true or false, got {only_ready!r:.40}')
    return json_response(await extensions.repository_index(server, only_ready))


async def repository_load(server: Server, request: Request, exchange: Exchange) -> Response:
    extensions.check_control(server)
    parameters = control_body(server, request).get("parameters", {})
    if not isinstance(parameters, dict):
        raise Refused(400, '"parameters" must be a JSON object')
    await extensions.repository_load(server, request.params["name"], parameters)
    return json_response({})


async def repository_unload(server: Server, request: Request, exchange: Exchange) -> Response:
    extensions.check_control(server)
    control_body(server, request)
    await extensions.repository_unload(server, request.params["name"])
    return json_response({})


async def metrics(server: Server, request: Request, exchange: Exchange) -> Response:
    return Response(200, server.metrics.render(), server.metrics.content_type)


# ---- V2 shared memory (serving/shm.py): system, and CUDA on a GPU --------------------------------


async def shm_status(kind: str, server: Server, request: Request, exchange: Exchange) -> Response:
    return json_response(
        server.shared_memory.status(
            request.header("authorization"), kind, request.params.get("region")
        )
    )


async def shm_register(kind: str, server: Server, request: Request, exchange: Exchange) -> Response:
    parsed = codec.parse_json(body_bytes(server, request) or b"null")
    name = request.params["region"]
    fields = (
        ("key", "offset", "byte_size")
        if kind == "system"
        else ("raw_handle", "device_id", "byte_size")
    )
    if not isinstance(parsed, dict) or not all(f in parsed for f in fields if f != "offset"):
        raise Refused(
            400,
            f"the body must be a JSON object {{{', '.join(repr(f) for f in fields)}}} (what "
            f"tritonclient's register_{kind}_shared_memory sends)",
        )
    numbers = {f: parsed.get(f, 0) for f in fields if f not in ("key", "raw_handle")}
    bad = [f for f, v in numbers.items() if not isinstance(v, int) or isinstance(v, bool)]
    if bad:
        raise Refused(400, f"{kind} shared memory region '{name}': {bad[0]} must be an integer")
    if kind == "system":
        server.shared_memory.register(
            request.header("authorization"),
            kind,
            name,
            key=parsed["key"],
            offset=numbers["offset"],
            byte_size=numbers["byte_size"],
        )
    else:
        handle = parsed["raw_handle"]
        try:
            raw = base64.b64decode(handle["b64"], validate=True)
        except (TypeError, KeyError, ValueError, binascii.Error):
            raise Refused(
                400,
                f"cuda shared memory region '{name}': raw_handle must be {{\"b64\": <the base64 "
                "of a cudaIpcMemHandle_t>}",
            ) from None
        server.shared_memory.register(
            request.header("authorization"),
            kind,
            name,
            raw_handle=raw,
            device_id=numbers["device_id"],
            byte_size=numbers["byte_size"],
        )
    return json_response({})


async def shm_unregister(
    kind: str, server: Server, request: Request, exchange: Exchange
) -> Response:
    server.shared_memory.unregister(
        request.header("authorization"), kind, request.params.get("region")
    )
    return json_response({})


# ---- the table -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    method: str
    # the pattern, as the metrics name the route
    path: str
    handler: Handler
    # no token needed (health checks)
    open: bool = False
    # The feedback token, not the inference token (Auth.check_labels).
    labels: bool = False
    # where its body goes: (server, request, exchange, length, chunked) -> a body
    body: Callable | None = None
    # run on the server's own event loop (it changes what is loaded: the model locks live there)
    main: bool = False


def table() -> list[Route]:
    routes = [
        Route("GET", "/v2", v2_server),
        Route("GET", "/v2/health/live", live, open=True),
        Route("GET", "/v2/health/ready", ready, open=True),
        # before /v2/models/{name}: as in Triton, "stats" here is the statistics of every model
        Route("GET", "/v2/models/stats", model_stats),
    ]
    for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        routes += [
            Route("GET", prefix, model_metadata),
            Route("GET", prefix + "/ready", model_ready),
            Route("GET", prefix + "/config", model_config),
            Route("GET", prefix + "/stats", model_stats),
            Route("POST", prefix + "/infer", v2_infer, body=v2_body),
        ]
    routes += [
        Route("GET", "/v2/models/{name}/shadow", shadow),
        Route("POST", "/v2/models/{name}/feedback", feedback, body=whole_body, labels=True),
        Route("POST", "/v2/repository/index", repository_index, body=whole_body, main=True),
        Route(
            "POST", "/v2/repository/models/{name}/load", repository_load, body=whole_body, main=True
        ),
        Route(
            "POST",
            "/v2/repository/models/{name}/unload",
            repository_unload,
            body=whole_body,
            main=True,
        ),
        Route("POST", "/invocations", invocations, body=invocations_body),
        Route("GET", "/ping", ping, open=True),
        Route("GET", "/health", ping, open=True),
        Route("GET", "/version", version),
        Route("GET", "/metrics", metrics),
    ]
    for kind in ("system", "cuda"):
        for prefix in (f"/v2/{kind}sharedmemory", f"/v2/{kind}sharedmemory/region/{{region}}"):
            routes += [
                Route("GET", prefix + "/status", partial(shm_status, kind)),
                Route(
                    "POST", prefix + "/unregister", partial(shm_unregister, kind), body=whole_body
                ),
            ]
        routes.append(
            Route(
                "POST",
                f"/v2/{kind}sharedmemory/region/{{region}}/register",
                partial(shm_register, kind),
                body=whole_body,
            )
        )
    return routes


class Router:
    """Paths to routes: segments compared, `{param}` segments taken as parameters. HEAD is answered
    as GET."""

    def __init__(self, routes: list[Route]):
        self.routes = routes
        self._seen: dict[tuple[str, str], tuple] = {}
        self._by_length: dict[int, list[tuple[tuple[str, ...], Route]]] = {}
        for route in routes:
            segments = tuple(route.path.strip("/").split("/"))
            self._by_length.setdefault(len(segments), []).append((segments, route))

    def match(self, method: str, path: str) -> tuple[Route | None, dict[str, str], bool]:
        """(route, parameters, whether the path exists for another method); the paths clients repeat
        (one model's infer) are looked up once."""
        found = self._seen.get((method, path))
        if found is None:
            found = self._match(method, path)
            # paths name models: bounded, a client sending random ones can't grow it
            if len(self._seen) >= 4096:
                self._seen.clear()
            self._seen[(method, path)] = found
        # (the parameters are shared by the requests of one path: handlers only read them)
        return found

    def _match(self, method: str, path: str) -> tuple[Route | None, dict[str, str], bool]:
        wanted = "GET" if method == "HEAD" else method
        segments = path.strip("/").split("/") if path != "/" else [""]
        other_method = False
        for pattern, route in self._by_length.get(len(segments), ()):
            params = {}
            for want, got in zip(pattern, segments):
                if want[:1] == "{":
                    if not got:
                        break
                    params[want[1:-1]] = got
                elif want != got:
                    break
            else:
                if route.method == wanted:
                    return route, params, False
                other_method = True
        return None, {}, other_method
