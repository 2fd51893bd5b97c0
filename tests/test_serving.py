"""End-to-end tests of the server: a real `python -m serving` process on a free port, real HTTP.

The main server requires a bearer token (given through the environment, as users should), so every
client here sends it; health checks must work without.
"""

from __future__ import annotations

import gzip
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import tritonclient.http as triton
from serving_fixtures import ROOT, ServerProcess, heavy_model, metric, run_onnx, tiny_model
from tritonclient.utils import InferenceServerException

import serving.engine as serving_engine

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LABELS = ["zero", "one", "two"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("model") / "tiny.onnx", labels=LABELS)


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    with ServerProcess(
        "--model",
        str(model_path),
        "--max-body-bytes",
        "65536",
        "--max-rows-per-request",
        "64",
        env={"TRAINSERVE_AUTH_TOKEN": TOKEN},
        log_path=log,
    ) as proc:
        yield proc


@pytest.fixture
def http():
    with requests.Session() as s:
        s.headers.update(AUTH)
        yield s


def images(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((n, 1, 8, 8), dtype=np.float32)


def v2_json(x: np.ndarray, nested: bool = False) -> dict:
    data = x.tolist() if nested else x.ravel().tolist()
    return {
        "id": "req-1",
        "inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": data}],
    }


def assert_close(got, want):
    np.testing.assert_allclose(
        np.asarray(got, dtype=np.float32).reshape(want.shape), want, rtol=1e-5, atol=1e-6
    )


# ---- every endpoint ---------------------------------------------------------------------------


def test_health_endpoints_are_open_without_token(server):
    for path in ("/v2/health/live", "/v2/health/ready", "/ping", "/health"):
        assert requests.get(server.url + path).status_code == 200, path


def test_metadata_endpoints(server, http):
    meta = http.get(server.url + "/v2").json()
    assert meta["name"] == "trainserve" and "binary_tensor_data" in meta["extensions"]
    model = http.get(server.url + "/v2/models/tiny").json()
    assert (
        model["name"] == "tiny"
        and model["versions"] == ["1"]
        and model["platform"] == "onnxruntime_onnx"
    )
    assert model["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 1, 8, 8]}]
    assert [o["name"] for o in model["outputs"]] == ["logits", "probabilities"]
    assert model["parameters"]["labels"] == LABELS
    assert http.get(server.url + "/v2/models/tiny/versions/1").json()["name"] == "tiny"
    assert http.get(server.url + "/v2/models/tiny/ready").json()["ready"] is True
    assert http.get(server.url + "/v2/models/tiny/versions/1/ready").status_code == 200
    assert http.get(server.url + "/v2/models/tiny/config").json()["max_batch_size"] == 32
    version = http.get(server.url + "/version").json()
    assert version["model_name"] == "tiny" and version["version"]
    text = http.get(server.url + "/metrics").text
    assert (
        metric(
            text, "trainserve_model_info", name="tiny", version="1", provider="CPUExecutionProvider"
        )
        == 1
    )


# ---- correct answers --------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("nested", [False, True])
def test_v2_json_infer_matches_onnxruntime(server, http, model_path, rows, nested):
    x = images(rows, seed=rows)
    want = run_onnx(model_path, x)
    r = http.post(server.url + "/v2/models/tiny/infer", json=v2_json(x, nested))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model_name"] == "tiny" and body["model_version"] == "1" and body["id"] == "req-1"
    outputs = {o["name"]: o for o in body["outputs"]}
    assert (
        outputs["probabilities"]["shape"] == [rows, 3]
        and outputs["probabilities"]["datatype"] == "FP32"
    )
    for name in ("logits", "probabilities"):
        assert_close(outputs[name]["data"], want[name])


def test_v2_versioned_infer_with_requested_output(server, http, model_path):
    x = images(2)
    body = {**v2_json(x), "outputs": [{"name": "logits"}]}
    r = http.post(server.url + "/v2/models/tiny/versions/1/infer", json=body)
    assert r.status_code == 200, r.text
    outputs = r.json()["outputs"]
    assert [o["name"] for o in outputs] == ["logits"]
    assert_close(outputs[0]["data"], run_onnx(model_path, x)["logits"])


@pytest.mark.parametrize("rows", [1, 7])
def test_tritonclient_binary_infer(server, model_path, rows):
    """tritonclient.http, unchanged: binary inputs, and binary outputs by default."""
    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        assert (
            client.is_server_live()
            and client.is_server_ready()
            and client.is_model_ready("tiny", headers=dict(AUTH))
        )
        assert client.get_model_metadata("tiny", headers=dict(AUTH))["inputs"][0]["shape"] == [
            -1,
            1,
            8,
            8,
        ]
        x = images(rows, seed=10 + rows)
        inp = triton.InferInput("input", list(x.shape), "FP32")
        # binary_data=True by default
        inp.set_data_from_numpy(x)
        result = client.infer("tiny", [inp], headers=dict(AUTH))
        want = run_onnx(model_path, x)
        np.testing.assert_allclose(
            result.as_numpy("probabilities"), want["probabilities"], rtol=1e-5, atol=1e-6
        )
        np.testing.assert_allclose(result.as_numpy("logits"), want["logits"], rtol=1e-5, atol=1e-6)
        # JSON outputs when asked, and gzip-compressed requests
        out = triton.InferRequestedOutput("logits", binary_data=False)
        result = client.infer(
            "tiny", [inp], outputs=[out], headers=dict(AUTH), request_compression_algorithm="gzip"
        )
        np.testing.assert_allclose(result.as_numpy("logits"), want["logits"], rtol=1e-5, atol=1e-6)
        # JSON input data
        inp.set_data_from_numpy(x, binary_data=False)
        result = client.infer("tiny", [inp], headers=dict(AUTH))
        np.testing.assert_allclose(result.as_numpy("logits"), want["logits"], rtol=1e-5, atol=1e-6)
    finally:
        client.close()


def test_invocations_every_format(server, http, model_path):
    x = images(3, seed=3)
    want = run_onnx(model_path, x)
    url = server.url + "/invocations"

    for body in (
        {"inputs": x.tolist()},
        {"inputs": {"input": x.tolist()}},
        {"instances": x.tolist()},
        {"instances": [{"input": row.tolist()} for row in x]},
    ):
        r = http.post(url, json=body)
        assert r.status_code == 200, (list(body), r.text)
        predictions = r.json()["predictions"]
        for name in ("logits", "probabilities"):
            assert_close(predictions[name], want[name])

    flat = x.reshape(3, -1)
    for body in (
        {"dataframe_split": {"columns": [f"p{i}" for i in range(64)], "data": flat.tolist()}},
        {"dataframe_split": {"columns": ["input"], "data": [[row.tolist()] for row in x]}},
        {"dataframe_records": [{f"p{i}": float(v) for i, v in enumerate(row)} for row in flat]},
        {"dataframe_records": [{"input": row.tolist()} for row in x]},
    ):
        r = http.post(url, json=body)
        assert r.status_code == 200, (list(body), r.text)
        rows = r.json()["predictions"]
        assert len(rows) == 3
        for name in ("logits", "probabilities"):
            assert_close([row[name] for row in rows], want[name])


# ---- bad input --------------------------------------------------------------------------------


def test_unknown_model_is_404(server, http):
    for method, path in (
        ("get", "/v2/models/nope"),
        ("get", "/v2/models/nope/ready"),
        ("post", "/v2/models/nope/infer"),
        ("post", "/v2/models/tiny/versions/9/infer"),
        ("get", "/no/such/path"),
    ):
        r = getattr(http, method)(server.url + path, json={})
        assert r.status_code == 404, path
        assert "error" in r.json()


def test_bad_requests_get_clear_4xx_and_server_keeps_serving(server, http):
    url = server.url + "/v2/models/tiny/infer"
    x = images(1)
    cases = {
        "bad shape": (v2_json(np.zeros((1, 1, 4, 8), np.float32)), 400, "expected [-1,1,8,8] FP32"),
        "bad rank": (v2_json(np.zeros((1, 64), np.float32)), 400, "expected [-1,1,8,8] FP32"),
        "bad dtype": (
            {"inputs": [{**v2_json(x)["inputs"][0], "datatype": "INT64"}]},
            400,
            "expected [-1,1,8,8] FP32",
        ),
        "count mismatch": (
            {"inputs": [{**v2_json(x)["inputs"][0], "data": [0.5] * 10}]},
            400,
            "needs 64 values",
        ),
        "not numbers": ({"inputs": [{**v2_json(x)["inputs"][0], "data": ["a"] * 64}]}, 400, "FP32"),
        "unknown input": (
            {"inputs": [{**v2_json(x)["inputs"][0], "name": "pixels"}]},
            400,
            "'input' [-1,1,8,8] FP32",
        ),
        "unknown output": ({**v2_json(x), "outputs": [{"name": "nope"}]}, 400, "logits"),
        "no inputs": ({"foo": 1}, 400, "inputs"),
        "too many rows": (v2_json(np.zeros((65, 1, 8, 8), np.float32)), 400, "at most 64"),
        "inf": (v2_json(np.full((1, 1, 8, 8), 1e39)), 400, "NaN or Inf"),
    }
    for case, (body, status, needle) in cases.items():
        r = http.post(url, json=body)
        assert r.status_code == status, (case, r.text)
        assert needle in r.json()["error"], (case, r.json())

    r = http.post(url, data=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    r = http.post(url, data=b"x" * 70_000)
    assert r.status_code == 413 and (
        "request body size of 70000 bytes exceeds the maximum allowed input size of 65536 bytes: "
        "send less, or start the server with a larger --max-body-bytes" in r.json()["error"]
    )
    # (Triton's words, which its clients look for: a JSON body is said to be one)
    r = http.post(url, data=b"x" * 70_000, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "request JSON size of 70000 bytes" in r.json()["error"]
    r = http.post(url, data=gzip.compress(b" " * 200_000), headers={"Content-Encoding": "gzip"})
    assert r.status_code == 413 and (
        "request body size of more than 65536 bytes once decompressed exceeds" in r.json()["error"]
    )
    # binary data that does not add up
    header = b'{"inputs":[{"name":"input","shape":[1,1,8,8],"datatype":"FP32","parameters":{"binary_data_size":256}}]}'
    r = http.post(
        url,
        data=header + b"\0" * 100,
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert r.status_code == 400 and "ends before" in r.json()["error"]
    # NaN through binary data
    nan = np.full((1, 1, 8, 8), np.nan, np.float32).tobytes()
    r = http.post(
        url, data=header + nan, headers={"Inference-Header-Content-Length": str(len(header))}
    )
    assert r.status_code == 400 and "NaN" in r.json()["error"]

    inv = server.url + "/invocations"
    assert http.post(inv, json={"inputs": [[1, 2, 3]]}).status_code == 400
    assert http.post(inv, json={"nope": []}).status_code == 400
    assert http.post(inv, data=b"a,b\n1,2", headers={"Content-Type": "text/csv"}).status_code == 415
    r = http.post(inv, json={"dataframe_split": {"columns": ["a"], "data": [[1.0]]}})
    assert r.status_code == 400 and "64 values" in r.json()["error"]

    # still serving, correctly
    r = http.post(url, json=v2_json(x))
    assert r.status_code == 200
    text = http.get(server.url + "/metrics").text
    assert (
        metric(text, "trainserve_requests_total", route="/v2/models/{name}/infer", status="400")
        >= 10
    )
    assert (
        metric(text, "trainserve_requests_total", route="/v2/models/{name}/infer", status="500")
        == 0
    )


def test_token_auth(server, http):
    url = server.url + "/v2/models/tiny/infer"
    body = v2_json(images(1))
    assert requests.post(url, json=body).status_code == 401
    r = requests.post(url, json=body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and "bearer token" in r.json()["error"]
    assert r.headers["WWW-Authenticate"] == "Bearer"
    assert (
        requests.post(server.url + "/invocations", json={"inputs": images(1).tolist()}).status_code
        == 401
    )
    assert requests.get(server.url + "/metrics").status_code == 401
    assert http.post(url, json=body).status_code == 200


def test_cli_refuses_bad_flags_and_missing_model(tmp_path):
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "serving", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    r = run("--model", str(tmp_path / "missing.onnx"), "--port", "1")
    assert r.returncode == 2 and "model file not found" in r.stderr
    r = run("--model", "s3://bucket/model.onnx")
    assert r.returncode == 2 and "models:/<name>@<alias>" in r.stderr
    r = run("--model", "x.onnx", "--reload-interval", "5")
    assert r.returncode == 2 and "alias" in r.stderr
    # A limit gRPC can't hold (its message sizes are C ints; 4 GiB wrapped to 0 and refused every
    # ModelInfer)
    r = run(
        "--model",
        str(tmp_path / "m.onnx"),
        "--grpc-port",
        "18121",
        "--max-body-bytes",
        str(4 << 30),
    )
    assert (
        r.returncode == 2 and "--max-body-bytes must be at most 2147483647 (2 GiB - 1" in r.stderr
    ), r.stderr
    if not serving_engine.cuda_device_present():
        r = run("--model", str(tiny_model(tmp_path / "m.onnx")), "--device", "cuda")
        assert r.returncode == 2 and "--device cuda asked for" in r.stderr


def test_log_says_once_which_provider_runs_and_no_cuda_noise(server):
    log = server.log()
    provider_lines = [line for line in log.splitlines() if "ExecutionProvider" in line]
    assert len(provider_lines) == 1, log
    if not serving_engine.cuda_device_present():
        assert "CPUExecutionProvider" in provider_lines[0]
        assert "cuda" not in log.lower().replace(provider_lines[0].lower(), ""), log


# ---- batching, queue limit, shutdown ----------------------------------------------------------


@pytest.mark.slow
def test_concurrent_requests_are_batched(tmp_path):
    path = heavy_model(tmp_path / "heavy.onnx")
    x = np.random.default_rng(0).random((1, 1, 28, 28), dtype=np.float32)
    want = run_onnx(path, x)["probabilities"]
    with ServerProcess(
        "--model", str(path), "--max-batch-size", "32", log_path=tmp_path / "log"
    ) as srv:

        def call(_):
            with requests.Session() as s:
                out = []
                for _ in range(4):
                    r = s.post(srv.url + "/invocations", json={"inputs": x.tolist()})
                    out.append((r.status_code, r.json()))
                return out

        with ThreadPoolExecutor(32) as pool:
            results = [item for batch in pool.map(call, range(32)) for item in batch]
        assert all(status == 200 for status, _ in results)
        for _, body in results:
            np.testing.assert_allclose(
                np.asarray(body["predictions"]["probabilities"], np.float32),
                want,
                rtol=1e-4,
                atol=1e-6,
            )
        text = requests.get(srv.url + "/metrics").text
    runs = metric(text, "trainserve_batch_size_count")
    rows = metric(text, "trainserve_batch_size_sum")
    single = metric(text, "trainserve_batch_size_bucket", le="1.0")
    # warm-up runs are not observed
    warm = 0
    assert rows == 128 + warm
    assert runs - single > 0, f"no batch larger than 1 in {runs} runs:\n{text}"
    # never above the limit
    assert metric(text, "trainserve_batch_size_bucket", le="32.0") == runs


@pytest.mark.slow
def test_sigterm_answers_requests_in_flight_and_queue_limit_gives_503(tmp_path, model_path):
    """Requests wait in the queue: a max delay of 60 s, far past the 10 s graceful timeout, holds
    the partial batch. SIGTERM must answer every one of them at once (the batch stops waiting when
    shutdown begins) and exit 0; before, they waited out the graceful timeout and were cut. One
    request beyond the queue's rows gets 503 + Retry-After."""
    args = (
        "--model",
        str(model_path),
        "--max-batch-size",
        "64",
        "--max-delay-ms",
        "60000",
        "--max-queue-rows",
        "8",
        "--max-rows-per-request",
        "8",
        "--graceful-timeout",
        "10",
    )
    with ServerProcess(*args, log_path=tmp_path / "log") as srv:
        x = images(1)
        results: list[int] = []
        lock = threading.Lock()

        def call():
            r = requests.post(srv.url + "/invocations", json={"inputs": x.tolist()}, timeout=60)
            with lock:
                results.append(r.status_code)

        threads = [threading.Thread(target=call) for _ in range(8)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while metric(requests.get(srv.url + "/metrics").text, "trainserve_queue_rows") < 8:
            assert time.monotonic() < deadline, "requests never queued"
            time.sleep(0.05)
        r = requests.post(srv.url + "/invocations", json={"inputs": x.tolist()})
        assert (
            r.status_code == 503
            and r.headers["Retry-After"] == "1"
            and "queue is full" in r.json()["error"]
        )

        stopped = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert srv.proc.wait(60) == 0, srv.log()
        assert results == [200] * 8, srv.log()
        assert time.monotonic() - stopped < 5, "the queued batch waited out the graceful timeout"
        with pytest.raises(requests.ConnectionError):
            requests.get(srv.url + "/v2/health/live", timeout=2)


@pytest.mark.parametrize("loops", ["1", "2"])
def test_server_refuses_a_busy_port(model_path, tmp_path, loops):
    # With several event loops too, whose sockets carry SO_REUSEPORT (so that the kernel spreads
    # connections over them), a second server on the port is refused, not let in beside them to take
    # a share of the connections.
    with ServerProcess(
        "--model", str(model_path), "--http-threads", loops, log_path=tmp_path / "a.log"
    ) as srv:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "serving",
                "--model",
                str(model_path),
                "--port",
                str(srv.port),
                "--http-threads",
                loops,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2 and r.stderr.splitlines() == [
            f"python -m serving: error: port {srv.port} on 127.0.0.1 is taken (Address already in use); choose "
            "another with --port (or --grpc-port)"
        ], r.stderr
        assert requests.get(srv.url + "/v2/health/live").status_code == 200


def test_tritonclient_error_is_readable(server):
    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        inp = triton.InferInput("input", [1, 1, 4, 4], "FP32")
        inp.set_data_from_numpy(np.zeros((1, 1, 4, 4), np.float32))
        with pytest.raises(InferenceServerException, match=r"expected \[-1,1,8,8\] FP32"):
            client.infer("tiny", [inp], headers=dict(AUTH))
    finally:
        client.close()


def test_ready_turns_503_if_the_engine_thread_dies(model_path):
    # In process: the server and its HTTP front end on a free port, asked with real HTTP. A server
    # whose engine thread has ended (what no model run can do: killed here with an asynchronous
    # SystemExit) must not tell a load balancer it is ready.
    import asyncio
    import ctypes

    from serving.config import Settings
    from serving.core import Server
    from serving.http.front_end import HttpFrontEnd
    from serving.loader import load_model

    server = Server(
        Settings(model=str(model_path)), load_model(str(model_path), device="cpu", threads=1)
    )
    http = HttpFrontEnd(server)

    async def main():
        async with server.lifespan():
            (host, port), *_ = await http.listen("127.0.0.1", 0)

            def get(path: str) -> int:
                return requests.get(f"http://{host}:{port}{path}", timeout=10).status_code

            loop = asyncio.get_running_loop()
            assert server.ready and await loop.run_in_executor(None, get, "/v2/health/ready") == 200
            thread = server.executor._thread
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(thread.ident), ctypes.py_object(SystemExit)
            )
            # wakes it: it dies on its next line of Python
            server.executor.submit(lambda: None)
            await loop.run_in_executor(None, thread.join, 5)
            statuses = [
                await loop.run_in_executor(None, get, p)
                for p in ("/v2/health/ready", "/v2/models/tiny/ready", "/ping")
            ]
            ready = server.ready
            http.stop_accepting()
            await http.drain(1)
            return ready, statuses

    ready, statuses = asyncio.run(main())
    assert not ready and statuses == [503, 503, 503]
