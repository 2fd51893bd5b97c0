"""After deployment, as a user lives it: a deliberately worse retrain becomes @challenger; a server
with --shadow 1.0 answers every client from the champion while it judges the challenger on the same
traffic, rejects it, and labels posted later give both models' live accuracy; drift stays low for
real digits and rises for shifted ones; a retrain as good as the champion agrees on every request,
is judged `promote` once the labeller's labels say it is as accurate, and `pipeline promote` moves
the alias. Real torchrun training, a real MLflow registry, a real server, real HTTP clients."""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest
import requests
from conftest import REPO, mlflow_client, run_cli
from serving_fixtures import ServerProcess

from serving import lineage

pytestmark = pytest.mark.slow

MLP = [
    "--config",
    str(REPO / "configs/digits_resnet18.yaml"),
    "--nproc-per-node",
    "1",
    "model.component=pipeline.models:mlp",
    "model.args={}",
    "export.registered_model_name=mlp-digits",
    "tracking.system_metrics=false",
]
NAME = "mlp-digits"


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """v1: a good MLP (@champion); v2: the same trained for 2 steps only (@challenger: worse, not
    promoted)."""
    workdir = tmp_path_factory.mktemp("live")
    run_cli(["run", *MLP, "train.epochs=3", "train.run_name=good"], cwd=workdir)
    worse = run_cli(
        [
            "run",
            *MLP,
            "train.max_steps=2",
            # maybe below the baseline: kept
            "train.run_name=worse",
            "export.allow_below_baseline=true",
        ],
        cwd=workdir,
    )
    assert "mlp-digits v2 is @challenger" in worse.stderr, worse.stderr[-2000:]
    return workdir


def digits(shift_sigmas: float = 0.0, count: int = 300):
    """Real validation digits (the split training used), as float32 images, and their labels;
    shifted by a multiple of the pixels' standard deviation when asked."""
    from pipeline.datasets.digits import digits as load

    val = load()["val"]
    x = np.stack([np.asarray(val[i][0]) for i in range(len(val))]).astype(np.float32)
    y = np.array([int(val[i][1]) for i in range(len(val))])
    index = np.arange(count) % len(y)
    return x[index] + shift_sigmas * x.std(), y[index]


def ask(url: str, image: np.ndarray, request_id: str) -> requests.Response:
    body = {
        "inputs": [
            {
                "name": "input",
                "shape": [1, *image.shape],
                "datatype": "FP32",
                "data": image.reshape(-1).tolist(),
            }
        ]
    }
    answer = requests.post(
        f"{url}/v2/models/{NAME}/infer", json=body, headers={"X-Request-Id": request_id}, timeout=30
    )
    assert answer.status_code == 200, answer.text
    return answer


def shadow_report(url: str, until, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        report = requests.get(f"{url}/v2/models/{NAME}/shadow", timeout=10).json()
        if until(report) or time.monotonic() > deadline:
            return report
        time.sleep(0.2)


def drift_of(url: str, version: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=10).text
    found = re.search(
        rf'trainserve_input_drift{{input="input",model="{NAME}",version="{version}"}} ([0-9.e+-]+)',
        text,
    )
    assert found, [line for line in text.splitlines() if "drift" in line]
    return float(found[1])


def test_a_worse_challenger_is_rejected_on_live_traffic_and_an_equal_one_promoted(
    registry, tmp_path
):
    workdir = registry
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{workdir / 'mlflow.db'}"}
    server = ServerProcess(
        "--model",
        f"models:/{NAME}@champion",
        "--shadow",
        "1.0",
        "--reload-interval",
        "1",
        "--shadow-min-pairs",
        "200",
        "--shadow-min-labels",
        "100",
        "--drift-window",
        "300",
        "--shadow-max-source-share",
        # (this test is the server's only client)
        "1",
        env=env,
        log_path=tmp_path / "server.log",
    )
    images, labels = digits()
    with server:
        # Every client is answered by the champion (v1), and its answers are right.
        correct, server_ids = 0, []
        for i, (image, label) in enumerate(zip(images, labels)):
            answer = ask(server.url, image, f"real-{i}")
            assert answer.headers["X-Model-Version"] == "1"
            server_ids.append(answer.headers["X-Server-Request-Id"])
            correct += int(np.argmax(answer.json()["outputs"][1]["data"]) == label)
        assert correct / len(labels) > 0.9
        report = shadow_report(server.url, lambda r: r["pairs"] + r["dropped"] >= 300)
        assert report["challenger_version"] == "2" and report["challenger_errors"] == 0
        # one client: few shed
        assert report["pairs"] >= 250 and report["pairs"] + report["dropped"] == 300, report
        assert report["agreement"] < 0.5 and report["verdict"] == "reject", report
        # (all from 127.0.0.1)
        assert report["sources"] == 1 and report["largest_source_share"] == 1.0, report
        assert (
            report["latency_ms"]["champion_p50"] > 0 and report["latency_ms"]["challenger_p50"] > 0
        )
        # Labels that arrive later, under the server's ids of the answers: both models' live
        # accuracy on the same requests.
        body = {"labels": [{"id": rid, "target": int(y)} for rid, y in zip(server_ids, labels)]}
        joined = requests.post(
            f"{server.url}/v2/models/{NAME}/feedback", json=body, timeout=30
        ).json()
        # the champion's answers are all kept
        assert joined["joined"] == 300 and joined["unknown"] == 0
        live = joined["report"]["live"]
        assert live["champion"]["accuracy"] > 0.9 > 0.5 > live["challenger"]["accuracy"]
        # (labels or not, agreement below the rule's floor rejects: labels can't outvote what every
        # request showed)
        assert "agreement" in joined["report"]["reason"] and joined["report"]["verdict"] == "reject"
        print(
            "worse challenger:",
            {
                k: joined["report"][k]
                for k in (
                    "pairs",
                    "dropped",
                    "agreement",
                    "latency_ms",
                    "live",
                    "verdict",
                    "reason",
                )
            },
        )
        metrics = requests.get(f"{server.url}/metrics", timeout=10).text
        assert (
            f'trainserve_shadow_verdict{{challenger_version="2",model="{NAME}",verdict="reject"}} 1.0'
            in metrics
        )
        refused = run_cli(["promote", NAME, "--server", server.url], cwd=workdir, check=False)
        assert refused.returncode == 1 and "the shadow verdict is reject" in refused.stderr

        # Drift: real validation digits look like the training split; digits brightened by 0.5 sigma
        # do not.
        calm = drift_of(server.url, "1")
        assert calm < 0.1, calm
        shifted, _ = digits(shift_sigmas=0.5)
        for i, image in enumerate(shifted):
            ask(server.url, image, f"shifted-{i}")
        moved = drift_of(server.url, "1")
        assert moved > 0.2 and moved > 3 * calm, (calm, moved)
        print(f"drift PSI: real validation digits {calm:.3f}, shifted by 0.5 sigma {moved:.3f}")

        # A retrain as good as the champion (the same run again: the same weights), kept as
        # @challenger by export.promote=if_better; the server follows the alias, judges it on new
        # traffic: agreement alone leaves it undecided, the labeller's labels promote it.
        run_cli(
            ["run", *MLP, "train.epochs=3", "train.run_name=again", "export.promote=if_better"],
            cwd=workdir,
        )
        report = shadow_report(server.url, lambda r: r["challenger_version"] == "3", timeout=30)
        assert report["challenger_version"] == "3", report
        again = [ask(server.url, image, f"again-{i}") for i, image in enumerate(images[:250])]
        report = shadow_report(server.url, lambda r: r["pairs"] + r["dropped"] >= 250)
        assert (
            report["pairs"] >= 200
            and report["agreement"] == 1.0
            and report["verdict"] == "undecided"
            and "promoting takes labels" in report["reason"]
        ), report
        body = {
            "labels": [
                {"id": answer.headers["X-Server-Request-Id"], "target": int(y)}
                for answer, y in zip(again, labels)
            ]
        }
        report = requests.post(
            f"{server.url}/v2/models/{NAME}/feedback", json=body, timeout=30
        ).json()["report"]
        assert report["verdict"] == "promote" and report["decided_by"] == "labels", report
        print(
            "equal challenger:",
            {k: report[k] for k in ("pairs", "dropped", "agreement", "verdict", "reason")},
        )
        promoted = run_cli(["promote", NAME, "--server", server.url], cwd=workdir)
        assert f"promoted {NAME} version 3 to @champion" in promoted.stdout
        assert re.search(
            r"judged on: \d+ distinct inputs paired, 0 repeats not counted, \d+ shed, from 1 client "
            r"address\(es\), the largest 100% of them",
            promoted.stdout,
        ), promoted.stdout
    client = mlflow_client(workdir)
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == "3"
    tags = client.get_model_version(NAME, "3").tags
    figures = json.loads(tags[lineage.SHADOW])
    assert (
        tags[lineage.SHADOW_VERDICT] == "promote"
        and figures["pairs"] >= 200
        and figures["agreement"] == 1.0
    )
    assert "@champion since `pipeline promote`: shadow verdict promote" in client.get_model_version(
        NAME, "3"
    ).description.replace("\\", "")
    log = (tmp_path / "server.log").read_text()
    assert f"drift: {NAME} version 1 input 'input': PSI" in log, log[-3000:]
