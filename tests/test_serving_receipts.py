"""Prediction receipts: every inference answer names the request and the model version that computed
it (X-Request-Id, X-Model-Name/-Version/-Run-Id/-Weights-Sha256), /v2/models/{name} shows the
version's lineage, and across a hot reload the headers name the version that actually ran each
request.

A real `python -m serving` process, real HTTP. The model computes y = x @ [1, 2, 3, 4] + 1000 *
version, so an answer proves both which inputs and which version it came from."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import requests
from onnx import TensorProto, helper, numpy_helper
from serving_fixtures import ServerProcess, metric, tiny_model

from serving import lineage
from serving.lineage import Lineage

W = np.array([[1.0], [2.0], [3.0], [4.0]], np.float32)


def lineage_metadata(version: int, run_id: str) -> dict[str, str]:
    """What the exporter writes into the ONNX file (pipeline/export.py)."""
    return Lineage(
        run_id=run_id,
        step=str(100 * version),
        checkpoint=f"step_{100 * version:08d}",
        config_sha256=hashlib.sha256(f"config{version}".encode()).hexdigest(),
        weights_sha256=hashlib.sha256(f"weights{version}".encode()).hexdigest(),
        model="pipeline.models:mlp",
        data="pipeline.data:digits",
    ).metadata()


def affine_model(path: Path, version: int, metadata: dict[str, str] | None = None) -> Path:
    """`input` FP32 [batch, 4] -> `y` FP32 [batch, 1] = input @ W + 1000 * version, named
    'affine'."""
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["input", "W", "b"], ["y"])],
        "affine",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1])],
        [
            numpy_helper.from_array(W, "W"),
            numpy_helper.from_array(np.array([1000.0 * version], np.float32), "b"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    helper.set_model_props(model, {lineage.MODEL_NAME: "affine", **(metadata or {})})
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def expected(x: np.ndarray, version: int) -> np.ndarray:
    return x @ W + np.float32(1000 * version)


def inputs(rows: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random((rows, 4), dtype=np.float32)


def ask(
    http: requests.Session,
    url: str,
    kind: str,
    x: np.ndarray,
    *,
    model: str = "affine",
    header_id: str | None = None,
    body_id: str | None = None,
    path: str | None = None,
):
    """One inference request of `kind` (v2-json, v2-binary, invocations); returns (response, y or
    None, body)."""
    headers = {"X-Request-Id": header_id} if header_id is not None else {}
    if kind == "invocations":
        r = http.post(
            url + "/invocations", json={"inputs": x.tolist()}, headers=headers, timeout=30
        )
        if r.status_code != 200:
            return r, None, r.json()
        body = r.json()
        return r, np.asarray(body["predictions"]["y"], np.float32), body
    tensor = {"name": "input", "shape": list(x.shape), "datatype": "FP32"}
    request: dict = {"inputs": [tensor]}
    if body_id is not None:
        request["id"] = body_id
    target = url + (path or f"/v2/models/{model}/infer")
    if kind == "v2-json":
        tensor["data"] = x.ravel().tolist()
        r = http.post(target, json=request, headers=headers, timeout=30)
        if r.status_code != 200:
            return r, None, r.json()
        body = r.json()
        out = body["outputs"][0]
        return r, np.asarray(out["data"], np.float32).reshape(out["shape"]), body
    tensor["parameters"] = {"binary_data_size": x.nbytes}
    request["parameters"] = {"binary_data_output": True}
    head = json.dumps(request).encode()
    r = http.post(
        target,
        data=head + x.astype("<f4").tobytes(),
        timeout=30,
        headers={
            **headers,
            "Inference-Header-Content-Length": str(len(head)),
            "Content-Type": "application/octet-stream",
        },
    )
    if r.status_code != 200:
        return r, None, r.json()
    n = int(r.headers["Inference-Header-Content-Length"])
    body = json.loads(r.content[:n])
    return r, np.frombuffer(r.content[n:], "<f4").reshape(body["outputs"][0]["shape"]), body


def model_headers(r: requests.Response) -> dict[str, str]:
    return {
        k: r.headers.get(k)
        for k in ("X-Model-Name", "X-Model-Version", "X-Model-Run-Id", "X-Model-Weights-Sha256")
    }


KINDS = ("v2-json", "v2-binary", "invocations")


# ---- one file model: every endpoint, request ids, errors, lineage --------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("receipts")
    meta = lineage_metadata(1, "run-abc123")
    path = affine_model(tmp / "affine.onnx", 1, meta)
    with ServerProcess("--model", str(path), log_path=tmp / "server.log") as srv:
        yield srv, meta, path


def test_every_inference_answer_names_the_request_and_the_model(served):
    srv, meta, _ = served
    want_model = {
        "X-Model-Name": "affine",
        "X-Model-Version": "1",
        "X-Model-Run-Id": "run-abc123",
        "X-Model-Weights-Sha256": meta[lineage.WEIGHTS_SHA256],
    }
    x = inputs(3, seed=1)
    with requests.Session() as http:
        for kind in KINDS:
            # no id given: a fresh one, also the V2 body's "id"
            r, y, body = ask(http, srv.url, kind, x)
            assert r.status_code == 200 and model_headers(r) == want_model, (kind, r.headers)
            np.testing.assert_allclose(y, expected(x, 1), rtol=1e-6)
            rid = r.headers["X-Request-Id"]
            assert len(rid) == 32 and int(rid, 16) >= 0, rid
            if kind != "invocations":
                assert body["id"] == rid and body["model_version"] == "1"
            # the client's X-Request-Id
            r, _, body = ask(http, srv.url, kind, x, header_id="client-42")
            assert r.headers["X-Request-Id"] == "client-42" and model_headers(r) == want_model
            if kind != "invocations":
                assert body["id"] == "client-42"
        for kind in ("v2-json", "v2-binary"):
            # the V2 body's id names the request when no header does; both: the header, and the body
            # echoed
            r, _, body = ask(http, srv.url, kind, x, body_id="body-7")
            assert r.headers["X-Request-Id"] == "body-7" and body["id"] == "body-7"
            r, _, body = ask(http, srv.url, kind, x, header_id="hdr-1", body_id="body-8")
            assert r.headers["X-Request-Id"] == "hdr-1" and body["id"] == "body-8"
            r, _, _ = ask(
                http, srv.url, kind, x, path="/v2/models/affine/versions/1/infer", header_id="v-1"
            )
            assert (
                r.status_code == 200
                and r.headers["X-Request-Id"] == "v-1"
                and model_headers(r) == want_model
            )


def test_refusals_carry_the_receipt_and_bad_request_ids_are_named(served):
    srv, _, _ = served
    with requests.Session() as http:
        # a request the model refuses: still names the model and the request
        r = http.post(
            srv.url + "/v2/models/affine/infer",
            headers={"X-Request-Id": "bad-shape"},
            json={
                "inputs": [
                    {"name": "input", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}
                ]
            },
        )
        assert r.status_code == 400 and r.headers["X-Request-Id"] == "bad-shape"
        assert r.headers["X-Model-Version"] == "1" and r.headers["X-Model-Run-Id"] == "run-abc123"
        r = http.post(
            srv.url + "/invocations", headers={"X-Request-Id": "bad-inv"}, json={"inputs": [[1.0]]}
        )
        assert (
            r.status_code == 400
            and r.headers["X-Request-Id"] == "bad-inv"
            and r.headers["X-Model-Version"] == "1"
        )
        # ids that can't be echoed in a header
        for kind in KINDS:
            for bad in ("x" * 129, "caf\xe9"):
                r, _, body = ask(http, srv.url, kind, inputs(1, 0), header_id=bad)
                assert (
                    r.status_code == 400
                    and "X-Request-Id header must be 1 to 128 printable ASCII" in body["error"]
                )
                assert "X-Request-Id" not in r.headers
        for kind in ("v2-json", "v2-binary"):
            r, _, body = ask(http, srv.url, kind, inputs(1, 0), body_id="y" * 200)
            assert (
                r.status_code == 400 and 'the "id" of the request must be 1 to 128' in body["error"]
            ), body
        # no model resolved: nothing to name
        r = http.post(srv.url + "/v2/models/nope/infer", json={})
        assert r.status_code == 404 and "X-Model-Name" not in r.headers


def test_model_metadata_shows_the_lineage_of_the_served_file(served, tmp_path):
    srv, meta, path = served
    # the bytes loaded, not a claim of theirs
    want = {
        "run_id": "run-abc123",
        "checkpoint_step": "100",
        "checkpoint": "step_00000100",
        "config_sha256": meta[lineage.CONFIG_SHA256],
        "weights_sha256": meta[lineage.WEIGHTS_SHA256],
        "model_component": "pipeline.models:mlp",
        "data_component": "pipeline.data:digits",
        "source": str(path),
        "onnx_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
    }
    for url in ("/v2/models/affine", "/v2/models/affine/versions/1"):
        assert requests.get(srv.url + url).json()["parameters"] == want
    # A hand-made file carries no lineage: only the source, and no empty headers.
    bare = tiny_model(tmp_path / "bare.onnx")
    with ServerProcess("--model", str(bare), log_path=tmp_path / "bare.log") as other:
        assert requests.get(other.url + "/v2/models/tiny").json()["parameters"] == {
            "source": str(bare),
            "onnx_sha256": hashlib.sha256(bare.read_bytes()).hexdigest(),
        }
        x = np.zeros((1, 1, 8, 8), np.float32)
        r = requests.post(other.url + "/invocations", json={"inputs": x.tolist()})
        assert r.status_code == 200
        assert model_headers(r) == {
            "X-Model-Name": "tiny",
            "X-Model-Version": "1",
            "X-Model-Run-Id": None,
            "X-Model-Weights-Sha256": None,
        }


# ---- a hot reload ------------------------------------------------------------------------------


@pytest.fixture
def registry(tmp_path):
    """A real MLflow SQLite store: 'affine' versions 1 and 2, each from its own training run (the
    run id in the ONNX metadata, as the exporter writes it), alias 'live' -> 1."""
    import mlflow

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        experiment = mlflow.create_experiment(
            "receipts", artifact_location=(tmp_path / "artifacts").as_uri()
        )
        runs = {}
        for version in (1, 2):
            with mlflow.start_run(experiment_id=experiment) as run:
                runs[version] = run.info.run_id
                path = affine_model(
                    tmp_path / f"v{version}.onnx",
                    version,
                    lineage_metadata(version, run.info.run_id),
                )
                mlflow.onnx.log_model(
                    onnx.load(str(path)),
                    name="model",
                    registered_model_name="affine",
                    pip_requirements=["onnxruntime"],
                )
        client = mlflow.MlflowClient()
        client.set_registered_model_alias("affine", "live", "1")
    finally:
        mlflow.set_tracking_uri(previous)
    return {"MLFLOW_TRACKING_URI": uri}, runs, client


def check_answer(
    r: requests.Response, x: np.ndarray, y: np.ndarray, body: dict, runs: dict[int, str]
) -> int:
    """The version whose answer this is (its bias), checked against every header naming it."""
    version = round(float(np.min(y - x @ W)) / 1000)
    np.testing.assert_allclose(y, expected(x, version), rtol=1e-6)
    assert model_headers(r) == {
        "X-Model-Name": "affine",
        "X-Model-Version": str(version),
        "X-Model-Run-Id": runs[version],
        "X-Model-Weights-Sha256": lineage_metadata(version, runs[version])[lineage.WEIGHTS_SHA256],
    }
    if "model_version" in body:
        assert body["model_version"] == str(version)
    return version


@pytest.mark.slow
def test_headers_name_the_version_that_answered_across_a_hot_reload(registry, tmp_path):
    """Version 1, then 2 (with a request of version 1's queue answered after the swap), then 1 again
    under load. Headers, V2 bodies, payload records and the payload files logged to each version's
    training run all name the version whose numbers the answer carries."""
    import mlflow

    env, runs, client = registry
    payloads = tmp_path / "payloads"
    # A one-row request waits up to 10 s for a second row (a batch is 2 rows); two-row requests run
    # at once.
    args = (
        "--model",
        "models:/affine@live",
        "--reload-interval",
        "0.2",
        "--max-batch-size",
        "2",
        "--max-delay-ms",
        "10000",
        "--batching",
        # a hand-made model: its rows are independent, said here
        "affine=on",
        "--payload-log",
        str(payloads),
        "--payload-log-mlflow",
    )
    # (x, y, request id, version)
    answers: list[tuple[np.ndarray, np.ndarray, str, int]] = []
    with (
        ServerProcess(*args, env=env, log_path=tmp_path / "server.log") as srv,
        requests.Session() as http,
    ):
        for i, kind in enumerate(KINDS):
            x = inputs(2, seed=i)
            r, y, body = ask(http, srv.url, kind, x)
            assert r.status_code == 200 and check_answer(r, x, y, body, runs) == 1
            answers.append((x, y, r.headers["X-Request-Id"], 1))

        # A request queued on version 1 when the alias moves is answered by version 1 after the
        # swap, when the server serves version 2: its headers must name 1 (the model that ran it),
        # not the one serving now.
        held: list = []
        x_held = inputs(1, seed=10)
        waiting = threading.Thread(
            target=lambda: held.append(ask(requests, srv.url, "v2-json", x_held, header_id="held"))
        )
        waiting.start()
        deadline = time.monotonic() + 10
        while metric(http.get(srv.url + "/metrics").text, "trainserve_queue_rows") < 1:
            assert time.monotonic() < deadline, "the request never queued:\n" + srv.log()
            time.sleep(0.02)
        moved = time.monotonic()
        client.set_registered_model_alias("affine", "live", "2")
        waiting.join(30)
        assert time.monotonic() - moved < 8, "released by its delay, not by the swap"
        r, y, body = held[0]
        assert r.status_code == 200 and r.headers["X-Request-Id"] == "held"
        assert check_answer(r, x_held, y, body, runs) == 1
        # what serves now
        assert http.get(srv.url + "/v2/models/affine").json()["versions"] == ["2"]
        answers.append((x_held, y, "held", 1))

        # Requests in flight on every endpoint while the alias moves back: each labelled by its own
        # answer.
        stop = threading.Event()
        lock = threading.Lock()
        failures: list[str] = []

        def load(worker: int) -> None:
            with requests.Session() as session:
                n = 0
                while not stop.is_set():
                    kind, x = KINDS[n % 3], inputs(2, seed=1000 * worker + n)
                    r, y, body = ask(session, srv.url, kind, x)
                    n += 1
                    try:
                        assert r.status_code == 200, (r.status_code, body)
                        version = check_answer(r, x, y, body, runs)
                    except AssertionError as exc:
                        failures.append(f"{kind}: {exc}")
                        continue
                    with lock:
                        answers.append((x, y, r.headers["X-Request-Id"], version))

        workers = [threading.Thread(target=load, args=(w,)) for w in range(6)]
        for t in workers:
            t.start()
        try:
            time.sleep(0.3)
            client.set_registered_model_alias("affine", "live", "1")
            deadline = time.monotonic() + 30
            while http.get(srv.url + "/v2/models/affine").json()["versions"] != ["1"]:
                assert time.monotonic() < deadline, (
                    "the server never went back to version 1:\n" + srv.log()
                )
                time.sleep(0.05)
            time.sleep(0.3)
        finally:
            stop.set()
            for t in workers:
                t.join(30)
        assert not failures, failures[:5]
        assert metric(http.get(srv.url + "/metrics").text, "trainserve_model_reloads_total") == 2
        versions = [v for *_, v in answers]
        assert versions.count(2) > 0 and versions[-1] == 1, versions
        assert srv.terminate() == 0, srv.log()

    # The payload log (every request: sample 1) names the same versions as the headers, once per
    # request.
    records = [
        json.loads(line)
        for f in sorted(payloads.glob("payloads-*.jsonl"))
        for line in f.read_text().splitlines()
    ]
    by_id = {rec["request_id"]: rec for rec in records}
    assert len(by_id) == len(records) == len(answers)
    for x, y, rid, version in answers:
        rec = by_id[rid]
        assert rec["model"] == {
            "name": "affine",
            "version": str(version),
            "run_id": runs[version],
            "weights_sha256": lineage_metadata(version, runs[version])[lineage.WEIGHTS_SHA256],
            "onnx_sha256": rec["model"]["onnx_sha256"],
            "source": f"models:/affine/{version}",
        }
        assert len(rec["model"]["onnx_sha256"]) == 64
        np.testing.assert_array_equal(np.asarray(rec["outputs"]["y"]["data"], np.float32), y)
        np.testing.assert_array_equal(np.asarray(rec["inputs"]["input"]["data"], np.float32), x)
    # Each file went to the training run of the version that answered its requests (a file holds one
    # version).
    logged: dict[str, int] = {}
    for version, run_id in runs.items():
        local = Path(
            mlflow.artifacts.download_artifacts(
                run_id=run_id,
                artifact_path="payloads",
                dst_path=str(tmp_path / f"run{version}"),
                tracking_uri=env["MLFLOW_TRACKING_URI"],
            )
        )
        for f in local.glob("payloads-*.jsonl"):
            for line in f.read_text().splitlines():
                rid = json.loads(line)["request_id"]
                assert by_id[rid]["model"]["version"] == str(version) and rid not in logged
                logged[rid] = version
    assert len(logged) == len(answers)

    # `pipeline trace` walks the held request (answered by version 1 after the swap) back to version
    # 1's run.
    from conftest import run_cli

    traced = run_cli(
        [
            "trace",
            "held",
            "--payload-log",
            str(payloads),
            "--tracking-uri",
            env["MLFLOW_TRACKING_URI"],
        ],
        cwd=tmp_path,
    ).stdout
    assert (
        "model       affine v1, weights sha256 "
        + lineage_metadata(1, runs[1])[lineage.WEIGHTS_SHA256]
        in traced
    )
    assert f"run         {runs[1]} " in traced and "models:/affine/1" in traced, traced
    missing = run_cli(
        ["trace", "never-sent", "--payload-log", str(payloads)], cwd=tmp_path, check=False
    )
    assert (
        missing.returncode == 2 and "request never-sent is not in the payload log" in missing.stderr
    )
