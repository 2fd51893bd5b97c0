"""The repository API under the review's low findings: a symlink out of --repository is not
followed, load parameters the server does not take are refused, the index does not rescan the
directory on every call, and replaced versions leave no metric series behind. A real
`python -m serving` process over real HTTP."""

from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from serving_fixtures import ServerProcess, tiny_model

pytestmark = pytest.mark.slow

BODY = {
    "inputs": [{"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": [0.5] * 64}]
}


def repository(root, count: int, model):
    for i in range(count):
        (root / f"model-with-a-fairly-descriptive-name-{i:03d}" / "1").mkdir(parents=True)
        shutil.copy(
            model, root / f"model-with-a-fairly-descriptive-name-{i:03d}" / "1" / "model.onnx"
        )
    return root


def load(url: str, name: str, body: dict | None = None) -> requests.Response:
    return requests.post(f"{url}/v2/repository/models/{name}/load", json=body, timeout=60)


def test_symlinks_out_of_the_repository_and_unknown_load_parameters_are_refused(tmp_path):
    """The review: a symlink inside --repository pointing outside was followed and loaded; load
    parameters named `FILE:...` or `Config` were answered 200 and ignored."""
    outside = tiny_model(tmp_path / "outside.onnx")
    root = tmp_path / "repo"
    (root / "linked" / "1").mkdir(parents=True)
    (root / "linked" / "1" / "model.onnx").symlink_to(outside)
    (root / "elsewhere").symlink_to(tmp_path / "other", target_is_directory=True)
    (tmp_path / "other" / "1").mkdir(parents=True)
    shutil.copy(outside, tmp_path / "other" / "1" / "model.onnx")
    (root / "fine" / "1").mkdir(parents=True)
    shutil.copy(outside, root / "fine" / "1" / "model.onnx")
    with ServerProcess(
        "--repository", str(root), log_path=tmp_path / "server.log", wait_ready=False
    ) as srv:
        for name in ("linked", "elsewhere"):
            r = load(srv.url, name)
            assert r.status_code == 404 and f"no model '{name}'" in r.json()["error"], (
                name,
                r.text,
            )
        assert "leads outside --repository" in srv.log()
        for parameters in ({"FILE:1/model.onnx": "eA=="}, {"Config": "{}"}, {"unknown": 1}):
            r = load(srv.url, "fine", {"parameters": parameters})
            assert (
                r.status_code == 400
                and "this server takes none" in r.json()["error"]
                and repr(sorted(parameters)) in r.json()["error"]
            ), r.text
        assert load(srv.url, "fine").status_code == 200
        assert (
            requests.post(f"{srv.url}/v2/models/fine/infer", json=BODY, timeout=10).status_code
            == 200
        )


def test_the_index_reuses_a_recent_scan_and_still_sees_new_models(tmp_path):
    """The review: /v2/repository/index rescanned 300 models on every call: 1,000 calls took 20 s
    and held liveness off (p50 333 ms, max 3.9 s). Here 400 calls from 8 threads reuse a scan at
    most a second old; a model added to the directory is listed a second later, and loads at
    once."""
    model = tiny_model(tmp_path / "tiny.onnx")
    root = repository(tmp_path / "repo", 300, model)
    with ServerProcess(
        "--repository",
        str(root),
        "--load-model",
        "model-with-a-fairly-descriptive-name-000",
        log_path=tmp_path / "server.log",
    ) as srv:
        index = srv.url + "/v2/repository/index"
        assert len(requests.post(index, timeout=30).json()) == 300
        live: list[float] = []

        def call(_):
            return requests.post(index, timeout=30).status_code

        def probe():
            started = time.perf_counter()
            requests.get(srv.url + "/v2/health/live", timeout=30)
            live.append(time.perf_counter() - started)

        started = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            calls = pool.map(call, range(400))
            # while the calls run
            while len(live) < 20:
                probe()
                time.sleep(0.01)
            statuses = list(calls)
        took = time.perf_counter() - started
        print(f"400 index calls in {took:.2f} s; liveness max {max(live) * 1000:.0f} ms")
        assert statuses == [200] * 400 and max(live) < 0.5 and took < 4, (took, max(live))
        (root / "newcomer" / "1").mkdir(parents=True)
        shutil.copy(model, root / "newcomer" / "1" / "model.onnx")
        # a load reads the directory afresh
        assert load(srv.url, "newcomer").status_code == 200
        (root / "latecomer" / "1").mkdir(parents=True)
        shutil.copy(model, root / "latecomer" / "1" / "model.onnx")
        time.sleep(1.1)
        assert "latecomer" in {row["name"] for row in requests.post(index, timeout=30).json()}


def test_replaced_versions_leave_no_series(tmp_path):
    """The review: 19 replaced versions left 19x20 request and latency series in /metrics."""
    model = tiny_model(tmp_path / "tiny.onnx")
    root = tmp_path / "repo"
    with _grow(root, model) as srv:
        for version in range(2, 7):
            (root / "grow" / str(version)).mkdir()
            shutil.copy(model, root / "grow" / str(version) / "model.onnx")
            assert load(srv.url, "grow").status_code == 200
            assert (
                requests.post(f"{srv.url}/v2/models/grow/infer", json=BODY, timeout=10).status_code
                == 200
            )
        text = requests.get(srv.url + "/metrics", timeout=10).text
    versions = {
        line.split('version="')[1].split('"')[0]
        for line in text.splitlines()
        if 'model="grow"' in line and 'version="' in line and not line.startswith("#")
    }
    assert versions == {"6"}, versions


def _grow(root, model) -> ServerProcess:
    (root / "grow" / "1").mkdir(parents=True)
    shutil.copy(model, root / "grow" / "1" / "model.onnx")
    return ServerProcess(
        "--repository",
        str(root),
        "--load-model",
        "grow",
        "--version-policy",
        "latest:1",
        log_path=root.parent / "server.log",
    )
