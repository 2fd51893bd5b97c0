"""A registry version's bytes against its record: the server hashes the ONNX it loads and refuses
one whose sha256 is not the one the version records (lineage.SHA256); every receipt names the hash
of the bytes that computed it; `pipeline verify --server` compares those bytes, and says
"incomplete" when a link could not be checked. A real MLflow SQLite store, real server processes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import requests
from onnx import numpy_helper
from serving_fixtures import ROOT, ServerProcess, free_port, metric, tiny_model
from test_serving_receipts import affine_model, lineage_metadata

from pipeline import verify
from serving import lineage

pytestmark = pytest.mark.slow


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def stored_onnx(client, name: str, version: str) -> Path:
    model_id = client.get_model_version(name, version).source.removeprefix("models:/")
    return (
        Path(client.get_logged_model(model_id).artifact_location.removeprefix("file://"))
        / "model.onnx"
    )


def tamper(path: Path) -> None:
    """The review's tamper_onnx.py: one bias changed inside the stored file, its metadata (lineage)
    left alone."""
    model = onnx.load(str(path))
    for init in model.graph.initializer:
        if init.name == "b":
            init.CopyFrom(
                numpy_helper.from_array(numpy_helper.to_array(init) + np.float32(50), "b")
            )
    onnx.save(model, str(path))


@pytest.fixture
def registry(tmp_path):
    """'digits' v1 and v2, registered as `pipeline export` does (the stored file's sha256 as a
    version tag), @champion -> 1."""
    import mlflow

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        experiment = mlflow.create_experiment(
            "integrity", artifact_location=(tmp_path / "artifacts").as_uri()
        )
        for seed in (1, 2):
            path = tiny_model(tmp_path / f"v{seed}.onnx", seed=seed, name="tiny")
            with mlflow.start_run(experiment_id=experiment):
                mlflow.onnx.log_model(
                    onnx.load(str(path)),
                    name="model",
                    registered_model_name="digits",
                    pip_requirements=["onnxruntime"],
                )
        client = mlflow.MlflowClient()
        for version in ("1", "2"):
            client.set_model_version_tag(
                "digits",
                version,
                lineage.SHA256,
                json.dumps({"model.onnx": sha256(stored_onnx(client, "digits", version))}),
            )
        client.set_registered_model_alias("digits", "champion", "1")
    finally:
        mlflow.set_tracking_uri(previous)
    return {"MLFLOW_TRACKING_URI": uri}, client


def infer(url: str) -> requests.Response:
    x = np.full(64, 0.5).tolist()
    return requests.post(
        f"{url}/v2/models/digits/infer",
        timeout=30,
        json={"inputs": [{"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": x}]},
    )


def test_a_tampered_version_is_refused_and_the_old_one_keeps_serving(registry, tmp_path):
    """The review's M1: a registered model.onnx with a changed bias was served, and its receipts
    named the genuine weights. Here the alias moving to the tampered version fails to reload, naming
    both hashes; version 1 keeps serving; a fresh server of the tampered version does not start."""
    env, client = registry
    tamper(stored_onnx(client, "digits", "2"))
    with ServerProcess(
        "--model",
        "models:/digits@champion",
        "--reload-interval",
        "0.3",
        env=env,
        log_path=tmp_path / "server.log",
    ) as srv:
        r = infer(srv.url)
        assert r.status_code == 200 and r.headers["X-Model-Onnx-Sha256"] == sha256(
            stored_onnx(client, "digits", "1")
        )
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
        assert infer(srv.url).headers["X-Model-Version"] == "1"
        assert "the stored file was changed after export; refusing to serve it" in srv.log()
    fresh = subprocess.run(
        [
            sys.executable,
            "-m",
            "serving",
            "--model",
            "models:/digits/2",
            "--port",
            str(free_port()),
        ],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert fresh.returncode != 0 and "but the version records" in fresh.stderr, fresh.stderr[-2000:]


def test_verify_server_compares_the_bytes_served_not_their_claims(tmp_path):
    """`verify --server` printed ok for a server of a tampered file whose metadata names the genuine
    weights. Here it fails on the bytes' hash; against the genuine file it is ok."""
    # what the file claims: the weights it was exported from
    props = lineage_metadata(1, "run-1")
    genuine = affine_model(tmp_path / "genuine.onnx", 1, props)
    tags = {lineage.SHA256: json.dumps({"model.onnx": sha256(genuine)})}
    forged = tmp_path / "forged.onnx"
    forged.write_bytes(genuine.read_bytes())
    tamper(forged)
    for path, want in ((genuine, "ok"), (forged, "FAIL")):
        with ServerProcess("--model", f"digits={path}", log_path=tmp_path / "server.log") as srv:
            links: list = []
            verify.server_link(srv.url, "digits", "1", tags, props, "", links.append)
        assert [link.status for link in links] == [want], links
        if want == "FAIL":
            assert f"serves ONNX bytes with sha256 {sha256(forged)[:16]}" in links[0].detail, links


def test_verify_is_incomplete_when_a_link_could_not_run(capsys):
    """The review: `verify` printed "verified" and exited 0 with weights, checkpoint and gates
    skipped."""
    links = [
        verify.Link("registry", "ok", ""),
        verify.Link("weights", "skip", "consolidated/ is gone"),
        verify.Link("gates", "skip", "no weights"),
    ]
    assert verify.verdict(links, "models:/m@a") == 3
    assert (
        capsys.readouterr().out.strip()
        == "INCOMPLETE: weights, gates could not be checked (see why above): models:/m@a"
    )
    assert verify.verdict(links[:1], "models:/m@a") == 0
    assert verify.verdict([*links, verify.Link("onnx", "FAIL", "")], "models:/m@a") == 1


def test_trace_follows_the_resolved_source_and_every_record_of_a_reused_id(registry, tmp_path):
    """The review's M3: `pipeline trace` took the served name for the registered one (so
    `--model other=models:/digits@champion` could not be traced, and a file served as `digits` was
    traced to the registry's digits), and of two requests sharing an X-Request-Id only the newest
    was found. Here the record names the pinned source, trace follows it, and both records of a
    reused id are traced."""
    from conftest import run_cli

    env, client = registry
    here = tiny_model(tmp_path / "local.onnx", seed=9)
    payloads = tmp_path / "payloads"
    with ServerProcess(
        "--model",
        "other=models:/digits@champion",
        "--model",
        f"digits={here}",
        "--payload-log",
        str(payloads),
        env=env,
        log_path=tmp_path / "server.log",
    ) as srv:
        x = np.full(64, 0.5).tolist()
        for name in ("other", "digits"):
            r = requests.post(
                f"{srv.url}/v2/models/{name}/infer",
                headers={"X-Request-Id": "reused"},
                timeout=30,
                json={
                    "inputs": [
                        {"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": x}
                    ]
                },
            )
            assert r.status_code == 200
        assert srv.terminate() == 0
    traced = run_cli(
        [
            "trace",
            "reused",
            "--payload-log",
            str(payloads),
            "--tracking-uri",
            env["MLFLOW_TRACKING_URI"],
        ],
        cwd=tmp_path,
    ).stdout
    assert "2 records carry request id reused" in traced, traced
    first, second = traced.split("request     reused")[1:]
    assert (
        "model       other v1" in first and "version     models:/digits/1 (@champion)" in first
    ), traced
    assert (
        "model       digits v1" in second
        and f"source      {here}: not a registry version" in second
    ), traced
    assert "models:/digits/1" not in second, traced


def test_a_version_recorded_before_the_lineage_contract_is_still_checked_and_a_file_it_does_not_list_refused(
    registry, tmp_path
):
    """A version registered by the export before `trainserve.sha256` (its file's hash in
    trainserve.onnx_sha256) is checked as before; a record that does not list the file served, or
    that can't be read, is refused, not served with a warning."""
    env, client = registry
    genuine = sha256(stored_onnx(client, "digits", "1"))
    # tags of version 1 -> what the server must say
    cases = {
        "legacy, wrong": ({"trainserve.onnx_sha256": "0" * 64}, "but the version records"),
        "record without the file": (
            {lineage.SHA256: json.dumps({"drift_reference.json": "0" * 64})},
            "is not among the files the version records",
        ),
        "record unreadable": ({lineage.SHA256: "[1, 2]"}, "is not a JSON object"),
    }
    try:
        client.delete_model_version_tag("digits", "1", lineage.SHA256)
        for name, (tags, said) in cases.items():
            for key in (lineage.SHA256, "trainserve.onnx_sha256"):
                with contextlib.suppress(Exception):
                    client.delete_model_version_tag("digits", "1", key)
            for key, value in tags.items():
                client.set_model_version_tag("digits", "1", key, value)
            run = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "serving",
                    "--model",
                    "models:/digits/1",
                    "--port",
                    str(free_port()),
                ],
                cwd=ROOT,
                env={**os.environ, **env},
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert run.returncode != 0 and said in run.stderr, (name, run.stderr[-2000:])
        client.delete_model_version_tag("digits", "1", lineage.SHA256)
        # legacy, right: served
        client.set_model_version_tag("digits", "1", "trainserve.onnx_sha256", genuine)
        with ServerProcess(
            "--model", "models:/digits/1", env=env, log_path=tmp_path / "legacy.log"
        ) as srv:
            assert infer(srv.url).status_code == 200 and "unchecked" not in srv.log()
    finally:
        with contextlib.suppress(Exception):
            client.delete_model_version_tag("digits", "1", "trainserve.onnx_sha256")
        client.set_model_version_tag(
            "digits", "1", lineage.SHA256, json.dumps({"model.onnx": genuine})
        )
