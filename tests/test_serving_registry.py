"""Registry models: a real MLflow SQLite store in a temp dir, models logged with mlflow.onnx,
served as models:/name@alias, and a reload when the alias moves."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import requests
from serving_fixtures import ServerProcess, metric, run_onnx, tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """Two versions of 'digits' (different weights), alias 'champion' -> 1. Yields (env, paths, run
    ids)."""
    import mlflow

    tmp = tmp_path_factory.mktemp("registry")
    uri = f"sqlite:///{tmp}/mlflow.db"
    paths = [tiny_model(tmp / f"v{i}.onnx", seed=i, name="tiny") for i in (1, 2)]
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        experiment = mlflow.create_experiment(
            "serving-test", artifact_location=(tmp / "artifacts").as_uri()
        )
        runs = []
        for path in paths:
            with mlflow.start_run(experiment_id=experiment) as run:
                mlflow.onnx.log_model(
                    onnx.load(str(path)),
                    name="model",
                    registered_model_name="digits",
                    pip_requirements=["onnxruntime"],
                )
                runs.append(run.info.run_id)
        mlflow.MlflowClient().set_registered_model_alias("digits", "champion", "1")
    finally:
        mlflow.set_tracking_uri(previous)
    yield {"MLFLOW_TRACKING_URI": uri}, paths, runs


def infer(url: str, name: str, x: np.ndarray) -> dict:
    body = {
        "inputs": [
            {
                "name": "input",
                "shape": list(x.shape),
                "datatype": "FP32",
                "data": x.ravel().tolist(),
            }
        ]
    }
    r = requests.post(f"{url}/v2/models/{name}/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def probabilities(body: dict) -> np.ndarray:
    out = {o["name"]: o for o in body["outputs"]}["probabilities"]
    return np.asarray(out["data"], np.float32).reshape(out["shape"])


def test_alias_is_served_and_reloaded_when_it_moves(registry, tmp_path):
    import mlflow

    env, paths, _ = registry
    x = np.random.default_rng(5).random((2, 1, 8, 8), dtype=np.float32)
    want = [run_onnx(p, x)["probabilities"] for p in paths]
    assert not np.allclose(want[0], want[1])
    # A one-row request waits up to 10 s for a second row (a batch is 2); two-row requests run at
    # once.
    args = (
        "--model",
        "models:/digits@champion",
        "--reload-interval",
        "0.3",
        "--max-batch-size",
        "2",
        "--max-delay-ms",
        "10000",
    )
    with ServerProcess(*args, env=env, log_path=tmp_path / "log") as srv:
        meta = requests.get(srv.url + "/v2/models/digits").json()
        # the registered name, not the ONNX metadata's
        assert meta["versions"] == ["1"], meta
        body = infer(srv.url, "digits", x)
        assert body["model_version"] == "1"
        np.testing.assert_allclose(probabilities(body), want[0], rtol=1e-5, atol=1e-6)

        # A request waiting in the batch queue when the alias moves finishes on the old model: it
        # waits for a second row for 10 s, so only the swap (which drains the old batcher) can
        # release it early.
        held: list[dict] = []
        waiting = threading.Thread(target=lambda: held.append(infer(srv.url, "digits", x[:1])))
        waiting.start()
        time.sleep(0.2)
        started = time.monotonic()
        client = mlflow.MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
        client.set_registered_model_alias("digits", "champion", "2")
        waiting.join(30)
        assert held and held[0]["model_version"] == "1"
        assert time.monotonic() - started < 8, "released by its delay, not by the swap"
        assert (
            metric(requests.get(srv.url + "/metrics").text, "trainserve_model_reloads_total") == 1
        )
        np.testing.assert_allclose(probabilities(held[0]), want[0][:1], rtol=1e-5, atol=1e-6)

        deadline = time.monotonic() + 60
        while requests.get(srv.url + "/v2/models/digits").json()["versions"] != ["2"]:
            assert time.monotonic() < deadline, (
                "the server never switched to version 2:\n" + srv.log()
            )
            time.sleep(0.2)
        body = infer(srv.url, "digits", x)
        assert body["model_version"] == "2"
        np.testing.assert_allclose(probabilities(body), want[1], rtol=1e-5, atol=1e-6)
        text = requests.get(srv.url + "/metrics").text
        assert metric(text, "trainserve_model_reloads_total") == 1
        assert metric(text, "trainserve_model_info", name="digits", version="2") == 1
        assert srv.terminate() == 0


def test_version_and_run_sources(registry, tmp_path):
    env, paths, runs = registry
    x = np.random.default_rng(6).random((1, 1, 8, 8), dtype=np.float32)
    with ServerProcess("--model", "models:/digits/2", env=env, log_path=tmp_path / "a.log") as srv:
        body = infer(srv.url, "digits", x)
        assert body["model_version"] == "2"
        np.testing.assert_allclose(
            probabilities(body), run_onnx(paths[1], x)["probabilities"], rtol=1e-5
        )
    # a run artifact has no registered name: the ONNX metadata names it
    with ServerProcess(
        "--model", f"runs:/{runs[0]}/model", env=env, log_path=tmp_path / "b.log"
    ) as srv:
        body = infer(srv.url, "tiny", x)
        np.testing.assert_allclose(
            probabilities(body), run_onnx(paths[0], x)["probabilities"], rtol=1e-5
        )


def test_unknown_alias_fails_clearly(registry, tmp_path):
    import os
    import subprocess
    import sys

    from serving_fixtures import ROOT

    env, _, _ = registry
    r = subprocess.run(
        [sys.executable, "-m", "serving", "--model", "models:/digits@nope"],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert "digits has no alias @nope; its aliases: @champion" in r.stderr, r.stderr


def test_a_failed_reload_is_retried_and_shows_in_metrics(registry, tmp_path):
    """The alias moves to a version whose files can't be fetched for a while (the store away): the
    server keeps serving the old one, says it is behind, counts the failures, and loads it once it
    can."""
    import shutil

    import mlflow

    env, _, _ = registry
    client = mlflow.MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    client.set_registered_model_alias("digits", "champion", "1")
    model_id = client.get_model_version("digits", "2").source.removeprefix("models:/")
    files = Path(client.get_logged_model(model_id).artifact_location.removeprefix("file://"))
    aside = tmp_path / "aside"
    x = np.random.default_rng(7).random((1, 1, 8, 8), dtype=np.float32)
    with ServerProcess(
        "--model",
        "models:/digits@champion",
        "--reload-interval",
        "0.3",
        env=env,
        log_path=tmp_path / "log",
    ) as srv:
        # version 2's files are gone for now
        shutil.move(files, aside)
        try:
            client.set_registered_model_alias("digits", "champion", "2")
            deadline = time.monotonic() + 30
            while (
                metric(
                    requests.get(srv.url + "/metrics").text,
                    "trainserve_model_reload_failures_total",
                    version="2",
                )
                < 1
            ):
                assert time.monotonic() < deadline, srv.log()
                time.sleep(0.2)
            text = requests.get(srv.url + "/metrics").text
            assert metric(text, "trainserve_model_behind_alias") == 1
            assert metric(text, "trainserve_model_alias_info", version="2") == 1
            meta = requests.get(srv.url + "/v2/models/digits").json()
            alias = meta["parameters"]["alias"]
            assert meta["versions"] == ["1"] and {
                k: alias[k] for k in ("source", "version", "behind")
            } == {"source": "models:/digits@champion", "version": "2", "behind": True}, alias
            assert alias["error"].startswith("version 2 failed to load"), alias
            assert infer(srv.url, "digits", x)["model_version"] == "1"
        finally:
            shutil.move(aside, files)
        deadline = time.monotonic() + 60
        while requests.get(srv.url + "/v2/models/digits").json()["versions"] != ["2"]:
            assert time.monotonic() < deadline, (
                "the failed version was never tried again:\n" + srv.log()
            )
            time.sleep(0.2)
        assert metric(requests.get(srv.url + "/metrics").text, "trainserve_model_behind_alias") == 0
        assert (
            "error" not in requests.get(srv.url + "/v2/models/digits").json()["parameters"]["alias"]
        )
        assert infer(srv.url, "digits", x)["model_version"] == "2"


def test_every_alias_named_keeps_its_version_loaded_under_one_model_name(registry, tmp_path):
    # The version policy for registry models: `NAME=models:/m@a` repeated keeps the version behind
    # every alias loaded; the first alias named is the default. When both aliases name one version,
    # the other leaves.
    import mlflow

    env, paths, _ = registry
    client = mlflow.MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    client.set_registered_model_alias("digits", "gold", "1")
    client.set_registered_model_alias("digits", "silver", "2")
    x = np.random.default_rng(6).random((2, 1, 8, 8), dtype=np.float32)
    want = [run_onnx(p, x)["probabilities"] for p in paths]
    args = (
        "--model",
        "digits=models:/digits@gold",
        "--model",
        "digits=models:/digits@silver",
        "--reload-interval",
        "0.3",
    )
    with ServerProcess(*args, env=env, log_path=tmp_path / "log") as srv:
        assert requests.get(srv.url + "/v2/models/digits").json()["versions"] == ["1", "2"]
        # no version: the first alias's
        assert infer(srv.url, "digits", x)["model_version"] == "1"
        for version in ("1", "2"):
            body = infer(srv.url, f"digits/versions/{version}", x)
            np.testing.assert_allclose(
                probabilities(body), want[int(version) - 1], rtol=1e-5, atol=1e-6
            )
        client.set_registered_model_alias("digits", "silver", "1")
        deadline = time.monotonic() + 30
        while requests.get(srv.url + "/v2/models/digits").json()["versions"] != ["1"]:
            assert time.monotonic() < deadline, requests.get(srv.url + "/v2/models/digits").json()
            time.sleep(0.2)
        assert (
            requests.post(f"{srv.url}/v2/models/digits/versions/2/infer", json={}).status_code
            == 404
        )
        text = requests.get(srv.url + "/metrics").text
        assert (
            metric(
                text,
                "trainserve_model_alias_info",
                model="digits",
                alias="models:/digits@silver",
                version="1",
            )
            == 1
        )
        assert metric(text, "trainserve_model_reloads_total", model="digits") == 1
        # one copy of version 1, not a second load
        assert "which is loaded" in srv.log()
    # Two aliases naming one version at start: one copy, both served.
    with ServerProcess(*args, env=env, log_path=tmp_path / "log2") as srv:
        assert requests.get(srv.url + "/v2/models/digits").json()["versions"] == ["1"]
        assert infer(srv.url, "digits", x)["model_version"] == "1"


def test_a_killed_servers_download_is_removed_by_the_next_server_and_a_running_ones_kept(
    registry, tmp_path
):
    """SIGKILL leaves a server's model download in the temporary directory; the next server started
    there removes it, and leaves a running server's alone."""
    env, _, _ = registry
    downloads = tmp_path / "tmp"
    downloads.mkdir()
    env = {**env, "TMPDIR": str(downloads)}

    def of(server) -> list[Path]:
        return [p for p in downloads.iterdir() if f"-{server.proc.pid}-" in p.name]

    source = ("--model", "models:/digits@champion")
    with ServerProcess(*source, env=env, log_path=tmp_path / "a.log") as killed:
        with ServerProcess(*source, env=env, log_path=tmp_path / "b.log") as running:
            assert of(killed) and of(running), sorted(downloads.iterdir())
            killed.proc.kill()
            killed.proc.wait(10)
            assert of(killed)
            with ServerProcess(*source, env=env, log_path=tmp_path / "c.log") as third:
                assert not of(killed) and of(running) and of(third)
                assert "removed 1 model download(s) left by servers no longer running" in (
                    third.log()
                )
