"""One server, many models, two protocols: a real `python -m serving` process with a model
repository and a named --model, reached with unmodified tritonclient.http and tritonclient.grpc
clients.

The server: `--repository` holding tiny/1, tiny/2, tiny/3 (three versions of an image classifier,
the latest two loaded) and heavy/1 (not loaded at start: --load-model tiny), plus
`--model mixed=...`, a model with two inputs of two dtypes as a user's own model has; a token; gRPC
on a second port.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import requests
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from onnx import TensorProto, helper, numpy_helper
from serving_fixtures import (
    ROOT,
    ServerProcess,
    free_port,
    heavy_model,
    metric,
    run_onnx,
    tiny_model,
    two_input_model,
)
from tritonclient.utils import InferenceServerException

TOKEN = "repo-token"
# lower case: gRPC metadata keys must be
AUTH = {"authorization": f"Bearer {TOKEN}"}


def auth() -> dict[str, str]:
    """A fresh copy for each call: tritonclient.http adds its own headers to the dict it is
    given."""
    return dict(AUTH)


def big_model(path: Path, megabytes: int = 64) -> Path:
    """`ids` INT64 [batch] -> `vectors` [batch, 8]: rows of a 64 MiB embedding table, memory that
    loading takes and unloading must give back (a Gather of an input: onnxruntime cannot fold the
    table away)."""
    table = (
        np.random.default_rng(0).normal(size=(megabytes * (1 << 20) // 32, 8)).astype(np.float32)
    )
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["vectors"], axis=0)],
        "big",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch"])],
        [helper.make_tensor_value_info("vectors", TensorProto.FLOAT, ["batch", 8])],
        [numpy_helper.from_array(table, "table")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("repository")
    for version in (1, 2, 3):
        (root / "tiny" / str(version)).mkdir(parents=True)
        tiny_model(root / "tiny" / str(version) / "model.onnx", seed=version)
    (root / "heavy" / "1").mkdir(parents=True)
    heavy_model(root / "heavy" / "1" / "model.onnx")
    (root / "big" / "1").mkdir(parents=True)
    big_model(root / "big" / "1" / "model.onnx")
    # skipped with a warning, never served
    (root / "not a name").mkdir()
    mixed = two_input_model(tmp_path_factory.mktemp("own") / "mixed.onnx")
    return root, mixed


@pytest.fixture(scope="module")
def server(repo, tmp_path_factory):
    root, mixed = repo
    grpc_port = free_port()
    log = tmp_path_factory.mktemp("log") / "server.log"
    with ServerProcess(
        "--repository",
        str(root),
        "--load-model",
        "tiny",
        "--version-policy",
        "latest:2",
        "--model",
        f"mixed={mixed}",
        "--grpc-port",
        str(grpc_port),
        "--threads",
        "1",
        env={"TRAINSERVE_AUTH_TOKEN": TOKEN},
        log_path=log,
    ) as proc:
        proc.grpc = f"127.0.0.1:{grpc_port}"
        yield proc


def images(n: int = 3, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((n, 1, 8, 8), dtype=np.float32)


def mixed_inputs(module):
    features = np.arange(12, dtype=np.float32).reshape(3, 4)
    code = np.array([1, 2, 3], dtype=np.int64)
    a = module.InferInput("features", [3, 4], "FP32")
    a.set_data_from_numpy(features)
    b = module.InferInput("code", [3], "INT64")
    b.set_data_from_numpy(code)
    return [a, b], features + code[:, None]


def test_two_models_side_by_side_over_http_and_grpc_with_unmodified_triton_clients(server, repo):
    root, _ = repo
    http = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    grpc = triton_grpc.InferenceServerClient(server.grpc)
    x = images()
    for module, client in ((triton_http, http), (triton_grpc, grpc)):
        image = module.InferInput("input", list(x.shape), "FP32")
        image.set_data_from_numpy(x)
        # No version: the highest loaded (3); a version: that one.
        for version, want in (("", 3), ("2", 2), ("3", 3)):
            got = client.infer("tiny", [image], model_version=version, headers=auth()).as_numpy(
                "probabilities"
            )
            reference = run_onnx(root / "tiny" / str(want) / "model.onnx", x)["probabilities"]
            np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-6)
        inputs, want = mixed_inputs(module)
        result = client.infer("mixed", inputs, headers=auth(), request_id="req-42")
        np.testing.assert_allclose(result.as_numpy("output"), want)
        assert (
            result.get_response(**({"as_json": True} if module is triton_grpc else {}))["id"]
            == "req-42"
        )
        assert client.is_model_ready("tiny", headers=auth()) and client.is_model_ready(
            "mixed", headers=auth()
        )
        # health: no token
        assert client.is_server_ready() and client.is_server_live()
    # 64 KiB of data: decoded in a thread, as a big HTTP body is
    big = images(256, seed=3)
    image = triton_grpc.InferInput("input", list(big.shape), "FP32")
    image.set_data_from_numpy(big)
    np.testing.assert_allclose(
        grpc.infer("tiny", [image], headers=auth()).as_numpy("probabilities"),
        run_onnx(root / "tiny" / "3" / "model.onnx", big)["probabilities"],
        rtol=1e-5,
        atol=1e-6,
    )
    metadata = grpc.get_model_metadata("tiny", headers=auth(), as_json=True)
    assert metadata["versions"] == ["2", "3"] and metadata["inputs"][0]["shape"] == [
        "-1",
        "1",
        "8",
        "8",
    ]
    assert grpc.get_server_metadata(headers=auth(), as_json=True)["name"] == "trainserve"
    # Version 1 exists in the repository, but the policy (latest:2) did not load it.
    with pytest.raises(InferenceServerException) as refused:
        grpc.infer("tiny", [image], model_version="1", headers=auth())
    assert (
        refused.value.status() == "StatusCode.NOT_FOUND"
        and "no version 1 loaded (loaded: 2, 3)" in str(refused.value)
    )
    # /invocations serves the first --model, with the receipt naming it.
    response = requests.post(
        server.url + "/invocations",
        headers=auth(),
        json={"inputs": {"features": [[0.0] * 4], "code": [5]}},
    )
    assert response.status_code == 200 and response.json()["predictions"] == {"output": [[5.0] * 4]}
    assert response.headers["X-Model-Name"] == "mixed"


def test_grpc_answers_client_mistakes_with_their_status_never_internal(server):
    grpc = triton_grpc.InferenceServerClient(server.grpc)
    x = triton_grpc.InferInput("input", [1, 1, 8, 8], "FP32")
    x.set_data_from_numpy(images(1))
    wrong = triton_grpc.InferInput("input", [1, 1, 4, 8], "FP32")
    wrong.set_data_from_numpy(np.zeros((1, 1, 4, 8), np.float32))
    # 300 rows: over the server's 256
    huge = triton_grpc.InferInput("input", [300, 1, 8, 8], "FP32")
    huge.set_data_from_numpy(np.zeros((300, 1, 8, 8), np.float32))
    cases = [
        (dict(model_name="tiny", inputs=[x]), "UNAUTHENTICATED", "bearer token"),
        (dict(model_name="nope", inputs=[x], headers=auth()), "NOT_FOUND", "unknown model 'nope'"),
        (dict(model_name="heavy", inputs=[x], headers=auth()), "NOT_FOUND", "load it with POST"),
        (
            dict(model_name="tiny", inputs=[wrong], headers=auth()),
            "INVALID_ARGUMENT",
            "does not fit",
        ),
        (dict(model_name="tiny", inputs=[huge], headers=auth()), "INVALID_ARGUMENT", "300 rows"),
    ]
    for kwargs, status, words in cases:
        with pytest.raises(InferenceServerException) as refused:
            grpc.infer(**kwargs)
        assert (
            refused.value.status() == f"StatusCode.{status}" and words in refused.value.message()
        ), (kwargs, refused.value)
    # Bytes that are not a ModelInferRequest: INVALID_ARGUMENT from our parse, not INTERNAL from
    # grpc's.
    import grpc as grpc_lib

    with grpc_lib.insecure_channel(server.grpc) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc_lib.RpcError) as raw:
            call(b"\xff\xff\xff", metadata=(("authorization", f"Bearer {TOKEN}"),))
    assert raw.value.code() == grpc_lib.StatusCode.INVALID_ARGUMENT
    text = requests.get(server.url + "/metrics", headers=auth()).text
    assert (
        metric(text, "trainserve_requests_total", route="grpc ModelInfer", status="INTERNAL") == 0
    )
    # labelled by the model once known
    assert (
        metric(
            text,
            "trainserve_requests_total",
            route="grpc ModelInfer",
            status="INVALID_ARGUMENT",
            model="tiny",
            version="3",
        )
        >= 2
    )
    assert (
        metric(
            text,
            "trainserve_requests_total",
            route="grpc ModelInfer",
            status="INVALID_ARGUMENT",
            model="",
        )
        == 1
    )


def tiny_request(**fields) -> bytes:
    """A serialized ModelInferRequest of one image for `tiny` (our schema: what any gRPC client
    sends)."""
    from serving.grpc import schema

    request = schema.ModelInferRequest(model_name="tiny", **fields)
    request.inputs.add(name="input", datatype="FP32", shape=[1, 1, 8, 8])
    request.raw_input_contents.append(images(1).tobytes())
    return request.SerializeToString()


def test_grpc_receipt_comes_back_as_initial_metadata(server, repo):
    """What a client learns of the version that answered a unary ModelInfer: the receipt as initial
    metadata."""
    import grpc as grpc_lib

    from serving.grpc import schema

    with grpc_lib.insecure_channel(server.grpc) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        body, call = infer.with_call(
            tiny_request(model_version="2", id="receipt-1"), metadata=tuple(AUTH.items())
        )
    receipt = dict(call.initial_metadata())
    assert schema.ModelInferResponse.FromString(body).id == "receipt-1"
    assert receipt["x-request-id"] == "receipt-1" and receipt["x-model-name"] == "tiny"
    assert receipt["x-model-version"] == "2" and len(receipt["x-model-onnx-sha256"]) == 64


def test_a_grpc_stream_answers_every_request_in_order_and_a_refused_one_does_not_end_it(
    server, repo
):
    """ModelStreamInfer with tritonclient's own streaming API: requests for two models and two
    versions, two refused among them, then more than the server's window of 128 at once; each
    answered in the order sent, with its receipt in the answer's parameters; a refusal is an error
    for that request only."""
    import queue

    from serving.grpc.service import STREAM_WINDOW

    root, _ = repo
    answers: queue.Queue = queue.Queue()
    client = triton_grpc.InferenceServerClient(server.grpc)
    client.start_stream(lambda result, error: answers.put((result, error)), headers=auth())
    x = images(2)
    image = triton_grpc.InferInput("input", list(x.shape), "FP32")
    image.set_data_from_numpy(x)
    wrong = triton_grpc.InferInput("input", [1, 1, 4, 8], "FP32")
    wrong.set_data_from_numpy(np.zeros((1, 1, 4, 8), np.float32))
    inputs, mixed_want = mixed_inputs(triton_grpc)
    sent = [
        ("tiny", "", [image], "a"),
        ("tiny", "2", [image], "b"),
        ("mixed", "", inputs, "c"),
        ("tiny", "", [wrong], "d"),
        ("nope", "", [image], "e"),
        ("tiny", "", [image], "f"),
    ]
    sent += [("tiny", "2", [image], f"n{i}") for i in range(STREAM_WINDOW + 72)]
    for model, version, given, rid in sent:
        client.async_stream_infer(model, given, model_version=version, request_id=rid)
    got = [answers.get(timeout=60) for _ in sent]
    client.stop_stream()

    errors = {rid: error for (_, _, _, rid), (_, error) in zip(sent, got) if error is not None}
    assert set(errors) == {"d", "e"}, errors
    assert str(errors["d"]).startswith(
        "INVALID_ARGUMENT: input 'input': shape [1, 1, 4, 8] does not fit"
    )
    assert str(errors["e"]).startswith("NOT_FOUND: unknown model 'nope'")
    answered = [
        (rid, result) for (_, _, _, rid), (result, error) in zip(sent, got) if error is None
    ]
    assert [rid for rid, _ in answered] == ["a", "b", "c", "f"] + [
        f"n{i}" for i in range(STREAM_WINDOW + 72)
    ]
    want = {v: run_onnx(root / "tiny" / v / "model.onnx", x)["probabilities"] for v in ("2", "3")}
    for rid, result in answered:
        response = result.get_response(as_json=True)
        receipt = {k: v["string_param"] for k, v in response["parameters"].items()}
        assert response["id"] == receipt["x-request-id"] == rid
        if rid == "c":
            assert receipt["x-model-name"] == "mixed"
            np.testing.assert_allclose(result.as_numpy("output"), mixed_want)
            continue
        version = "3" if rid in ("a", "f") else "2"
        assert (receipt["x-model-name"], receipt["x-model-version"], response["model_version"]) == (
            "tiny",
            version,
            version,
        )
        assert len(receipt["x-model-onnx-sha256"]) == 64
        np.testing.assert_allclose(
            result.as_numpy("probabilities"), want[version], rtol=1e-5, atol=1e-6
        )

    text = requests.get(server.url + "/metrics", headers=auth()).text
    route = "grpc ModelStreamInfer"
    assert (
        metric(
            text, "trainserve_requests_total", route=route, status="OK", model="tiny", version="2"
        )
        >= STREAM_WINDOW + 73
    )
    assert (
        metric(
            text, "trainserve_requests_total", route=route, status="INVALID_ARGUMENT", model="tiny"
        )
        == 1
    )
    assert metric(text, "trainserve_requests_total", route=route, status="NOT_FOUND", model="") == 1


def test_a_grpc_stream_without_the_token_is_refused_and_a_malformed_message_refuses_only_itself(
    server,
):
    import grpc as grpc_lib

    from serving.grpc import schema

    good = tiny_request(id="good")
    with grpc_lib.insecure_channel(server.grpc) as channel:
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        with pytest.raises(grpc_lib.RpcError) as refused:
            list(stream(iter([good])))
        assert refused.value.code() == grpc_lib.StatusCode.UNAUTHENTICATED
        answers = [
            schema.ModelStreamInferResponse.FromString(b)
            for b in stream(iter([b"\xff\xff\xff", good]), metadata=tuple(AUTH.items()))
        ]
    assert answers[0].error_message.startswith(
        "INVALID_ARGUMENT: the message is not a valid inference.ModelInferRequest"
    )
    assert not answers[1].error_message and answers[1].infer_response.id == "good"
    assert answers[1].infer_response.parameters["x-model-name"].string_param == "tiny"


def test_a_stream_reads_no_more_than_its_window_and_sigterm_answers_what_was_read_then_ends_it(
    tmp_path,
):
    """200 requests on one stream while a batch waits for rows (--max-delay-ms 20 s): the server
    reads 128 (the window) and no more. SIGTERM: those 128 are answered at once (the partial batch
    stops waiting), then the stream ends UNAVAILABLE ("send the rest elsewhere") and the server
    exits without waiting out the graceful timeout (before: 30 s, then every call cut, CANCELLED,
    the read requests unanswered)."""
    import queue
    import signal
    import time

    from serving.grpc.service import STREAM_WINDOW

    model = tiny_model(tmp_path / "tiny.onnx")
    grpc_port = free_port()
    with ServerProcess(
        "--model",
        f"tiny={model}",
        "--grpc-port",
        str(grpc_port),
        "--max-delay-ms",
        "20000",
        "--max-batch-size",
        "256",
        "--graceful-timeout",
        "30",
        log_path=tmp_path / "server.log",
    ) as srv:
        answers: queue.Queue = queue.Queue()
        client = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        client.start_stream(lambda result, error: answers.put((result, error)))
        x = images(1)
        image = triton_grpc.InferInput("input", list(x.shape), "FP32")
        image.set_data_from_numpy(x)
        # a partial batch: it would wait 20 s for more rows
        for i in range(STREAM_WINDOW + 72):
            client.async_stream_infer("tiny", [image], request_id=f"s{i}")

        def queued() -> float:
            return metric(
                requests.get(srv.url + "/metrics").text, "trainserve_queue_rows", model="tiny"
            )

        deadline = time.monotonic() + 10
        while queued() < STREAM_WINDOW and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        # read, waiting in the batcher; the rest not read
        assert queued() == STREAM_WINDOW
        started = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        got = [answers.get(timeout=20) for _ in range(STREAM_WINDOW + 1)]
        assert srv.proc.wait(20) == 0
        took = time.monotonic() - started
        client.stop_stream()
    assert [r.get_response(as_json=True)["id"] for r, error in got[:-1] if error is None] == [
        f"s{i}" for i in range(STREAM_WINDOW)
    ]
    result, error = got[-1]
    assert (
        result is None
        and error.status() == "StatusCode.UNAVAILABLE"
        and "shutting down" in error.message()
    ), error
    assert took < 10, (
        f"the server took {took:.1f} s to stop with a stream open ({srv.log()[-2000:]})"
    )


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_repository_api_loads_and_unloads_a_model_and_gives_its_memory_back(server):
    http = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    index = {
        (r["name"], r.get("version", "")): r["state"]
        for r in http.get_model_repository_index(headers=auth())
    }
    assert index == {
        ("big", ""): "UNAVAILABLE",
        ("heavy", ""): "UNAVAILABLE",
        ("mixed", "1"): "READY",
        ("tiny", "2"): "READY",
        ("tiny", "3"): "READY",
    }
    # Loading is guarded by the token, takes only names this server knows, and never client files.
    assert requests.post(server.url + "/v2/repository/models/heavy/load").status_code == 401
    assert (
        requests.post(server.url + "/v2/repository/models/nope/load", headers=auth()).status_code
        == 404
    )
    refused = requests.post(
        server.url + "/v2/repository/models/heavy/load",
        headers=auth(),
        json={"parameters": {"file:1/model.onnx": "AAAA"}},
    )
    assert refused.status_code == 400 and "never from files" in refused.json()["error"]

    # returns once loaded and warmed up
    http.load_model("heavy", headers=auth())
    assert http.is_model_ready("heavy", headers=auth())
    x = triton_http.InferInput("input", [2, 1, 28, 28], "FP32")
    x.set_data_from_numpy(np.zeros((2, 1, 28, 28), np.float32))
    assert http.infer("heavy", [x], headers=auth()).as_numpy("probabilities").shape == (2, 10)
    assert (
        metric(
            requests.get(server.url + "/metrics", headers=auth()).text,
            "trainserve_inference_duration_seconds_count",
            model="heavy",
        )
        >= 1
    )
    http.unload_model("heavy", headers=auth())
    assert not requests.get(server.url + "/v2/models/heavy/ready", headers=auth()).ok
    text = requests.get(server.url + "/metrics", headers=auth()).text
    # no stale series
    assert metric(text, "trainserve_inference_duration_seconds_count", model="heavy") == 0
    with pytest.raises(InferenceServerException, match="unloaded"):
        http.infer("heavy", [x], headers=auth())
    rows = [r for r in http.get_model_repository_index(headers=auth()) if r["name"] == "heavy"]
    assert rows == [{"name": "heavy", "version": "", "state": "UNAVAILABLE", "reason": "unloaded"}]

    # Memory: a 64 MiB model, loaded and unloaded; the process gives back what the load took.
    pid = server.proc.pid
    before = rss_mib(pid)
    http.load_model("big", headers=auth())
    loaded = rss_mib(pid)
    y = triton_http.InferInput("ids", [2], "INT64")
    y.set_data_from_numpy(np.array([0, 7], np.int64))
    http.infer("big", [y], headers=auth())
    http.unload_model("big", headers=auth())
    after = rss_mib(pid)
    print(f"RSS MiB: before load {before:.0f}, loaded {loaded:.0f}, after unload {after:.0f}")
    assert loaded - before > 50, (before, loaded)
    assert after - before < 0.25 * (loaded - before), (before, loaded, after)


def test_every_series_is_labelled_by_model_and_version_with_queue_and_compute_time(server):
    http = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    inputs, _ = mixed_inputs(triton_http)
    http.infer("mixed", inputs, headers=auth())
    x = triton_http.InferInput("input", [1, 1, 8, 8], "FP32")
    x.set_data_from_numpy(images(1))
    http.infer("tiny", [x], model_version="2", headers=auth())
    text = requests.get(server.url + "/metrics", headers=auth()).text
    for model, version in (("mixed", "1"), ("tiny", "2")):
        labels = dict(model=model, version=version)
        assert metric(text, "trainserve_requests_total", status="200", **labels) >= 1, labels
        assert metric(text, "trainserve_queue_duration_seconds_count", **labels) >= 1, labels
        assert metric(text, "trainserve_inference_duration_seconds_count", **labels) >= 1, labels
        assert metric(text, "trainserve_batch_size_count", **labels) >= 1, labels
    assert metric(text, "trainserve_model_info", name="tiny", version="3") == 1
    assert metric(text, "trainserve_queue_rows", model="tiny", version="2") == 0
    assert requests.get(server.url + "/v2", headers=auth()).json()["extensions"] == [
        "binary_tensor_data",
        "classification",
        "model_configuration",
        "model_repository",
        "statistics",
        "system_shared_memory",
        "grpc",
    ]


def test_bad_model_flags_stop_the_server_with_a_message_naming_the_fix(tmp_path, repo):
    root, mixed = repo
    cases = [
        (["--model", "bad name=x.onnx"], "is not a model name"),
        (
            ["--model", f"a={mixed}", "--model", f"b={mixed}", "--model-name", "c"],
            "name each as --model NAME=URI",
        ),
        (["--model", str(mixed), "--load-model", "tiny"], "--load-model applies to --repository"),
        (["--repository", str(root), "--version-policy", "newest"], "expected latest:N"),
        (
            ["--repository", str(root), "--load-model", "nope"],
            "--load-model nope: not a model of --repository",
        ),
        (["--repository", str(tmp_path / "missing")], "not a directory"),
        (["--model", f"tiny={mixed}", "--repository", str(root)], "also a model of --repository"),
        (["--model", f"a={mixed}", "--default-model", "b"], "--default-model b: no such model"),
        (["--model", f"a={mixed}", "--model", f"a={mixed}"], "are both version 1"),
        (
            ["--model", str(mixed), "--model-control", "always"],
            "--model-control must be none or explicit",
        ),
    ]
    for args, words in cases:
        proc = subprocess.run(
            [sys.executable, "-m", "serving", "--port", str(free_port()), *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2 and words in proc.stderr, (args, proc.stderr[-2000:])


def test_a_server_with_nothing_loaded_is_not_ready_until_a_model_is(repo, tmp_path):
    root, _ = repo
    with ServerProcess(
        "--repository",
        str(root),
        "--load-model",
        "",
        "--version-policy",
        "latest:1",
        log_path=tmp_path / "log",
        wait_ready=False,
    ) as srv:
        assert requests.get(srv.url + "/v2/health/ready").status_code == 503
        assert requests.post(srv.url + "/v2/repository/models/tiny/load").status_code == 200
        assert requests.get(srv.url + "/v2/health/ready").status_code == 200
        assert requests.get(srv.url + "/v2/models/tiny").json()["versions"] == ["3"]


def test_without_a_repository_clients_cannot_load_or_unload(repo, tmp_path):
    _, mixed = repo
    with ServerProcess("--model", f"mixed={mixed}", log_path=tmp_path / "log") as srv:
        for action in ("load", "unload"):
            refused = requests.post(f"{srv.url}/v2/repository/models/mixed/{action}")
            assert (
                refused.status_code == 403 and "--model-control explicit" in refused.json()["error"]
            )
        assert requests.post(srv.url + "/v2/repository/index").json() == [
            {"name": "mixed", "version": "1", "state": "READY", "reason": ""}
        ]


def test_a_load_of_a_name_no_model_has_is_not_found_in_tritons_words_too(server):
    """A name that could be a model's but is not (one starting with '.' too: a hidden directory,
    never a model, but no path) is not found, saying so in Triton's words (its clients look for
    them)."""
    grpc = triton_grpc.InferenceServerClient(server.grpc)
    for name in ("model123", "model..1", "...", "..my_model", ".hidden"):
        with pytest.raises(InferenceServerException) as refused:
            grpc.load_model(name, headers=auth())
        assert "StatusCode.NOT_FOUND" in str(refused.value), (name, refused.value)
        said = refused.value.message()
        assert said.startswith("failed to poll from model repository: no model"), (name, said)
        assert "path traversal" not in said
    refused = requests.post(f"{server.url}/v2/repository/models/..my_model/load", headers=auth())
    assert refused.status_code == 404, refused.text
    assert "a name starting with '.' is a hidden directory" in refused.json()["error"]


def test_a_load_of_a_name_that_is_empty_or_a_path_is_refused_saying_so(server):
    """Names a model directory can't have: refused before the repository is read, in Triton's words
    too (its clients look for them) and with the rule."""
    grpc = triton_grpc.InferenceServerClient(server.grpc)
    cases = {
        "": "Model name cannot be empty. Please enter a valid name to deploy.",
        " \t\n": "Model name cannot be empty. Please enter a valid name to deploy.",
        "../etc": "'../etc': model name must not contain path traversal characters",
        "model/": "'model/': model name must not contain path traversal characters",
        " ..": "' ..': model name must not contain path traversal characters",
        "bad name": "'bad name' is not a model name (a model name is a letter or digit",
    }
    for name, said in cases.items():
        with pytest.raises(InferenceServerException) as refused:
            grpc.load_model(name, headers=auth())
        assert "StatusCode.INVALID_ARGUMENT" in str(refused.value), refused.value
        assert said in refused.value.message(), (name, refused.value.message())
    refused = requests.post(f"{server.url}/v2/repository/models/bad%20name/load", headers=auth())
    assert refused.status_code == 400 and "is not a model name" in refused.json()["error"]
