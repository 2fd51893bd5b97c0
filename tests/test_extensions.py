"""The V2 extensions beside inference, alike over HTTP and gRPC, as Triton's protocol documents
define them: model configuration, the model repository (index, load, unload) and statistics
(docs/protocol/extension_{model_configuration,model_repository,statistics}.md of
triton-inference-server). A real `python -m serving` process per gRPC engine (grpc's C++ server
where it is built, and grpc.aio), a token, reached with unmodified tritonclient.http and
tritonclient.grpc clients.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from google.protobuf import json_format
from serving_fixtures import ServerProcess, free_port, gather_model, heavy_model, tiny_model
from tritonclient.utils import InferenceServerException

from serving.grpc import native, schema

TOKEN = "ext-token"
NUMBERS = {"count", "ns", "last_inference", "inference_count", "execution_count", "batch_size"}
METHOD = "/inference.GRPCInferenceService/"


def auth() -> dict[str, str]:
    # a fresh dict each call: tritonclient.http adds its own headers to the one it is given
    return {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module", params=["native", "aio"])
def server(request, tmp_path_factory):
    if request.param == "native" and not native.available():
        pytest.skip(native.WHY_NOT)
    root = tmp_path_factory.mktemp(f"repository-{request.param}")
    for version in (1, 2):
        (root / "tiny" / str(version)).mkdir(parents=True)
        tiny_model(root / "tiny" / str(version) / "model.onnx", seed=version)
    (root / "heavy" / "1").mkdir(parents=True)
    heavy_model(root / "heavy" / "1" / "model.onnx")
    (root / "gather" / "1").mkdir(parents=True)
    gather_model(root / "gather" / "1" / "model.onnx")
    port = free_port()
    with ServerProcess(
        "--repository",
        str(root),
        "--load-model",
        "tiny,gather",
        "--version-policy",
        "all",
        "--grpc-port",
        str(port),
        "--grpc-engine",
        request.param,
        env={"TRAINSERVE_AUTH_TOKEN": TOKEN},
        log_path=tmp_path_factory.mktemp("log") / "server.log",
    ) as srv:
        srv.grpc = f"127.0.0.1:{port}"
        srv.http_client = triton_http.InferenceServerClient(srv.url.removeprefix("http://"))
        srv.grpc_client = triton_grpc.InferenceServerClient(srv.grpc)
        yield srv


def refused(call, *args, **kwargs) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        call(*args, **kwargs)
    return caught.value


def test_grpc_lists_the_extensions_http_lists(server):
    over_http = requests.get(server.url + "/v2", headers=auth()).json()["extensions"]
    over_grpc = server.grpc_client.get_server_metadata(headers=auth(), as_json=True)["extensions"]
    assert over_grpc == over_http
    assert {"model_configuration", "model_repository", "statistics", "grpc"} <= set(over_http)


def test_grpc_model_config_is_the_http_config_and_needs_the_token(server):
    for version in ("", "1"):
        path = "/v2/models/tiny" + (f"/versions/{version}" if version else "") + "/config"
        over_http = requests.get(server.url + path, headers=auth()).json()
        config = server.grpc_client.get_model_config(
            "tiny", model_version=version, headers=auth(), as_json=True
        )["config"]
        # (protobuf's JSON writes int64s as strings and leaves zero values out)
        assert config["name"] == over_http["name"] == "tiny"
        assert config["platform"] == over_http["platform"]
        assert config["backend"] == over_http["backend"]
        assert config.get("max_batch_size", 0) == over_http["max_batch_size"]
        for field in ("input", "output"):
            assert [
                {
                    "name": t["name"],
                    "data_type": t["data_type"],
                    "dims": [int(d) for d in t["dims"]],
                }
                for t in config[field]
            ] == over_http[field]
    assert "UNAUTHENTICATED" in refused(server.grpc_client.get_model_config, "tiny").status()
    missing = refused(server.grpc_client.get_model_config, "nope", headers=auth())
    assert missing.status() == "StatusCode.NOT_FOUND" and "nope" in missing.message()


def test_grpc_repository_index_load_and_unload_as_over_http(server):
    client = server.grpc_client
    over_http = requests.post(server.url + "/v2/repository/index", headers=auth()).json()
    over_grpc = client.get_model_repository_index(headers=auth(), as_json=True)["models"]
    assert [
        {k: r.get(k, "") for k in ("name", "version", "state", "reason")} for r in over_grpc
    ] == [{k: r.get(k, "") for k in ("name", "version", "state", "reason")} for r in over_http]
    ready = client.get_model_repository_index(headers=auth(), as_json=True)
    assert ("heavy", "UNAVAILABLE") in {(r["name"], r["state"]) for r in ready["models"]}

    assert "UNAUTHENTICATED" in refused(client.load_model, "heavy").status()
    assert refused(client.load_model, "nope", headers=auth()).status() == "StatusCode.NOT_FOUND"
    files = refused(client.load_model, "heavy", headers=auth(), files={"file:1/model.onnx": b"x"})
    assert files.status() == "StatusCode.INVALID_ARGUMENT" and "never from files" in files.message()
    assert not client.is_model_ready("heavy", headers=auth())

    # returns once loaded and warmed up
    client.load_model("heavy", headers=auth())
    assert client.is_model_ready("heavy", headers=auth())
    assert requests.get(server.url + "/v2/models/heavy/ready", headers=auth()).ok
    client.unload_model("heavy", headers=auth())
    assert not client.is_model_ready("heavy", headers=auth())
    rows = [
        r
        for r in requests.post(server.url + "/v2/repository/index", headers=auth()).json()
        if r["name"] == "heavy"
    ]
    assert rows == [{"name": "heavy", "version": "", "state": "UNAVAILABLE", "reason": "unloaded"}]


def stats_of(server, protocol: str, name: str = "", version: str = "") -> dict:
    """{(name, version): model_stat} as the extension reports it, over `protocol`, numbers as
    ints."""
    if protocol == "http":
        path = "/v2/models" + (f"/{name}" if name else "")
        path += (f"/versions/{version}" if version else "") + "/stats"
        response = requests.get(server.url + path, headers=auth())
        assert response.status_code == 200, response.text
        found = response.json()["model_stats"]
    else:
        message = server.grpc_client.get_inference_statistics(
            name, model_version=version, headers=auth()
        )
        # (protobuf's JSON leaves zero values out and writes 64-bit integers as strings)
        found = json_format.MessageToDict(
            message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )["model_stats"]

    def ints(value, key=""):
        if isinstance(value, dict):
            return {k: ints(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [ints(v) for v in value]
        return int(value) if key in NUMBERS else value

    return {(s["name"], s["version"]): ints(s) for s in found}


def duration(stat: dict, phase: str) -> tuple[int, int]:
    figure = stat.get("inference_stats", {}).get(phase, {})
    return figure.get("count", 0), figure.get("ns", 0)


def test_stats_routes_answer_every_model_one_model_and_one_version(server):
    every = stats_of(server, "http")
    assert set(every) == {("gather", "1"), ("tiny", "1"), ("tiny", "2")}
    assert set(stats_of(server, "http", "tiny")) == {("tiny", "1"), ("tiny", "2")}
    assert set(stats_of(server, "http", "tiny", "2")) == {("tiny", "2")}
    assert stats_of(server, "grpc").keys() == every.keys()
    assert set(stats_of(server, "grpc", "tiny", "1")) == {("tiny", "1")}
    # a model or version not loaded: 404 / NOT_FOUND; no token: 401 / UNAUTHENTICATED
    assert requests.get(server.url + "/v2/models/nope/stats", headers=auth()).status_code == 404
    assert (
        requests.get(server.url + "/v2/models/tiny/versions/9/stats", headers=auth()).status_code
        == 404
    )
    assert requests.get(server.url + "/v2/models/stats").status_code == 401
    missing = refused(server.grpc_client.get_inference_statistics, "heavy", headers=auth())
    assert missing.status() == "StatusCode.NOT_FOUND"
    assert "UNAUTHENTICATED" in refused(server.grpc_client.get_inference_statistics).status()


def test_statistics_count_requests_rows_runs_and_failures_over_both_protocols(server):
    before = stats_of(server, "http")
    x = np.random.default_rng(0).random((3, 1, 8, 8), dtype=np.float32)
    for module, client in ((triton_http, server.http_client), (triton_grpc, server.grpc_client)):
        image = module.InferInput("input", list(x.shape), "FP32")
        image.set_data_from_numpy(x)
        for _ in range(2):
            client.infer("tiny", [image], model_version="2", headers=auth())
        # an id past the embedding's 5 rows: onnxruntime refuses it in the run, a failed request
        ids = module.InferInput("ids", [2], "INT64")
        ids.set_data_from_numpy(np.array([1, 99], np.int64))
        assert refused(client.infer, "gather", [ids], headers=auth())
    after = stats_of(server, "grpc")
    assert after == stats_of(server, "http")

    tiny, was = after[("tiny", "2")], before[("tiny", "2")]
    # rows
    assert tiny["inference_count"] - was["inference_count"] == 4 * 3
    # requests sent one after another: a run each
    assert tiny["execution_count"] - was["execution_count"] == 4
    assert duration(tiny, "success")[0] - duration(was, "success")[0] == 4
    assert duration(tiny, "fail") == duration(was, "fail")
    for phase in ("queue", "compute_input", "compute_infer", "compute_output"):
        count, ns = duration(tiny, phase)
        assert count - duration(was, phase)[0] == 4, phase
        assert ns > duration(was, phase)[1], phase
    success_ns = duration(tiny, "success")[1] - duration(was, "success")[1]
    infer_ns = duration(tiny, "compute_infer")[1] - duration(was, "compute_infer")[1]
    # the run is part of each request's time
    assert 0 < infer_ns < success_ns
    sizes = {b["batch_size"]: b for b in tiny["batch_stats"]}
    assert 3 in sizes and sizes[3]["compute_infer"]["count"] >= 1
    assert sum(b["compute_infer"]["count"] for b in tiny["batch_stats"]) == tiny["execution_count"]
    # milliseconds since the epoch
    assert tiny["last_inference"] > 1.7e12
    # the other version ran nothing
    assert after[("tiny", "1")] == before[("tiny", "1")]

    gather, was = after[("gather", "1")], before[("gather", "1")]
    assert duration(gather, "fail")[0] - duration(was, "fail")[0] == 2
    assert duration(gather, "success") == duration(was, "success")
    # a failed run is no execution
    assert gather["execution_count"] == was["execution_count"]


def test_shared_memory_rpcs_answer_over_grpc_as_over_http(server):
    """The six RPCs, built in one loop: each reaches serving/shm.py with its own kind and fields,
    and answers what the same request answers over HTTP (an answer, or the same refusal)."""

    def over_grpc(channel, rpc: str, **fields) -> tuple[str, object]:
        request_class, response_class = schema.METHODS[rpc]
        call = channel.unary_unary(METHOD + rpc)
        try:
            body = call(
                request_class(**fields).SerializeToString(),
                metadata=tuple(auth().items()),
                timeout=10,
            )
        except grpc.RpcError as exc:
            return "refused", exc.details()
        response = response_class.FromString(body)
        return "ok", sorted(response.regions) if hasattr(response, "regions") else None

    def over_http(path: str, body: dict | None = None) -> tuple[str, object]:
        if body is None and path.endswith("/status"):
            response = requests.get(server.url + path, headers=auth())
        else:
            response = requests.post(server.url + path, headers=auth(), json=body)
        if response.status_code != 200:
            return "refused", response.json()["error"]
        found = response.json()
        return "ok", sorted(r["name"] for r in found) if isinstance(found, list) else None

    system = {"key": "/no-such-segment", "offset": 0, "byte_size": 64}
    cuda = {"raw_handle": b"\0" * 64, "device_id": 0, "byte_size": 64}
    with grpc.insecure_channel(server.grpc) as channel:
        for kind, fields in (("System", system), ("Cuda", cuda)):
            http = f"/v2/{kind.lower()}sharedmemory"
            body = dict(fields)
            if kind == "Cuda":
                body["raw_handle"] = {"b64": "AA" * 32}
                fields = dict(fields, raw_handle=bytes(48))
            pairs = [
                (over_grpc(channel, f"{kind}SharedMemoryStatus"), over_http(http + "/status")),
                (
                    over_grpc(channel, f"{kind}SharedMemoryRegister", name="r", **fields),
                    over_http(http + "/region/r/register", body),
                ),
                (
                    over_grpc(channel, f"{kind}SharedMemoryUnregister", name="nope"),
                    over_http(http + "/region/nope/unregister"),
                ),
            ]
            for grpc_outcome, http_outcome in pairs:
                assert grpc_outcome[0] == http_outcome[0], (kind, grpc_outcome, http_outcome)
                if grpc_outcome[0] == "refused":
                    # the same words, but for the fields' own spelling of the handle
                    assert grpc_outcome[1].split(":")[0] == http_outcome[1].split(":")[0]


def test_an_empty_request_id_is_no_id_as_perf_analyzer_sends_it(server):
    """perf_analyzer's JSON header carries `"id": ""`: the request is answered, with an id of its
    own."""
    body = {
        "id": "",
        "inputs": [{"name": "ids", "shape": [1], "datatype": "INT64", "data": [2]}],
    }
    response = requests.post(server.url + "/v2/models/gather/infer", headers=auth(), json=body)
    assert response.status_code == 200, response.text
    assert len(response.headers["X-Request-Id"]) == 32
    assert response.json()["outputs"][0]["data"] == [6.0, 7.0, 8.0]
