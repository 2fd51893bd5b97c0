"""Two machines that share no disk train one run, as a user runs it on real ones: one torchrun per
host (`--nnodes 2`, c10d rendezvous), checkpoints on an S3-compatible store, tracking on
`mlflow server` over PostgreSQL with its artifacts in S3; one node's worker killed mid-run and the
job resumed by torchrun's elastic restart; then consolidate, export, register, serve and verify,
each through the tracking server from a host that trained nothing of it.

The hosts are network namespaces (tests/hosts.py): own address, own empty working directory; their
names do not resolve, hence `--local-addr` and the c10d `is_host` setting. The services run in the
root namespace, bound to the bridge's address.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import TINY, cli_env, run_lineage

# the fixture
from hosts import hosts  # noqa: F401
from object_store import moto_s3
from services import mlflow_server, postgres

from serving import lineage

pytestmark = pytest.mark.slow

# each host has its own port space: no other session can hold it there
RDZV_PORT = 29400
# The digits MLP, a few steps: checkpoints at 6, 12 and 18, the worker on the second host killed at
# step 9.
TRAINING = [
    "model.name=mlp",
    "model.args={hidden: [32]}",
    "train.max_steps=18",
    "train.log_every=1",
    "train.eval_every=6",
    "checkpoint.every_n_steps=6",
    "train.device=cpu",
    # as many threads on every rank, hosts or not: the same float sums
    "train.threads_per_rank=1",
    "export.registered_model_name=digits-two-hosts",
]
KILLED_AT = 9


def torchrun_on(
    host,
    rendezvous: str,
    run_name: str,
    output_dir: str,
    tracking_uri: str,
    env: dict,
    is_host: bool,
):
    """The command a user types on each machine: the same on both but for --local-addr and
    is_host."""
    return host.popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            rendezvous,
            "--rdzv-id",
            run_name,
            "--local-addr",
            host.address,
            "--max-restarts",
            "1",
            *(["--rdzv-conf", "is_host=true"] if is_host else []),
            "-m",
            "pipeline.train",
            "--config",
            str(TINY),
            *TRAINING,
            f"train.run_name={run_name}",
            f"train.output_dir={output_dir}",
            f"tracking.tracking_uri={tracking_uri}",
        ],
        env=env,
        stdout=open(host.workdir / "torchrun.log", "w"),
        stderr=subprocess.STDOUT,
    )


@contextlib.contextmanager
def meanwhile(cmd: list[str], cwd, env: dict, log, timeout: float):
    """`cmd` running in the root namespace while the block runs; it must then exit 0 within
    `timeout`. Killed with its children (torchrun's workers) if the block fails."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(log, "w"),
        start_new_session=True,
    )
    try:
        yield proc
        assert proc.wait(timeout=timeout) == 0, f"{' '.join(cmd)}:\n{log.read_text()[-6000:]}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_all(procs: dict, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for host, proc in procs.items():
        try:
            proc.wait(timeout=max(1, deadline - time.monotonic()))
        except Exception:
            raise AssertionError(
                f"torchrun on {host.name} still running after {timeout} s:\n"
                + "\n".join(
                    f"--- {h.name}\n{(h.workdir / 'torchrun.log').read_text()[-5000:]}"
                    for h in procs
                )
            ) from None
    for host, proc in procs.items():
        assert proc.returncode == 0, (
            f"torchrun on {host.name} exited {proc.returncode}:\n"
            + "\n".join(
                f"--- {h.name}\n{(h.workdir / 'torchrun.log').read_text()[-6000:]}" for h in procs
            )
        )


def metric_history(client, run_id: str, key: str) -> dict[int, float]:
    history = client.get_metric_history(run_id, key)
    steps = [m.step for m in history]
    assert len(steps) == len(set(steps)), f"{key}: a step logged twice: {sorted(steps)}"
    return {m.step: m.value for m in history}


def test_two_hosts_train_one_run_resume_a_killed_worker_and_ship_it_through_the_tracking_server(
    # the fixture imported above
    hosts,  # noqa: F811
    tmp_path,
):
    started, phases = time.monotonic(), {}

    # seconds per stage, printed at the end (pytest -rP shows them)
    def phase(name: str) -> None:
        phases[name] = round(time.monotonic() - started - sum(phases.values()), 1)

    network = hosts(2)
    a, b = network.hosts
    with (
        postgres() as database,
        moto_s3(host=network.gateway, log_dir=tmp_path) as store,
        mlflow_server(
            database, f"{store.url}/mlflow", host=network.gateway, env=store.env, workdir=tmp_path
        ) as uri,
    ):
        phase("services")
        # What each host is given: where the store and the tracking server are, and which interface
        # gloo uses.
        env = cli_env({**store.env, "GLOO_SOCKET_IFNAME": a.interface, "MLFLOW_TRACKING_URI": uri})

        # The reference, trained meanwhile in the root namespace: two ranks on one machine, same
        # seed, never interrupted.
        local = tmp_path / "local"
        local.mkdir()
        with meanwhile(
            [
                sys.executable,
                "-m",
                "pipeline",
                "train",
                "--config",
                str(TINY),
                "--nproc-per-node",
                "2",
                *TRAINING,
                "train.run_name=local",
                f"train.output_dir={store.url}/local",
                f"tracking.tracking_uri={uri}",
            ],
            local,
            cli_env(store.env),
            local / "train.log",
            timeout=300,
        ):
            # Two hosts, one process each; the second host's worker is SIGKILLed at step 9 (its
            # agent lives on).
            rendezvous = f"{a.address}:{RDZV_PORT}"
            procs = {
                a: torchrun_on(
                    a, rendezvous, "two-hosts", f"{store.url}/two-hosts", uri, env, is_host=True
                ),
                b: torchrun_on(
                    b,
                    rendezvous,
                    "two-hosts",
                    f"{store.url}/two-hosts",
                    uri,
                    {**env, "TRAINSERVE_FAULT": f"step:{KILLED_AT}:1"},
                    is_host=False,
                ),
            }
            wait_all(procs, timeout=300)
        phase("training: two hosts, and the local reference meanwhile")
        log_b = (b.workdir / "torchrun.log").read_text()
        log_a = (a.workdir / "torchrun.log").read_text()
        assert (
            f"SIGKILL to rank 1 at step {KILLED_AT}" in log_b and "torchrun restart 1" in log_b
        ), log_b[-4000:]
        # Host A's agent restarted for the membership change (its own count stays 0): its rank
        # resumed with host B's in that same restart, not after a refusal of its own that spent its
        # restart.
        assert "resumed from" in log_a and "pipeline train: [rank0] error" not in log_a, log_a[
            -4000:
        ]

        import mlflow

        client = mlflow.MlflowClient(uri)
        runs = {
            r.info.run_name: r
            for r in client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
        }
        assert set(runs) == {"local", "two-hosts"}, set(runs)
        for run in runs.values():
            assert run.info.status == "FINISHED"
        # One run across the restart, each step logged once, the same curve as two ranks on one
        # machine.
        losses = {
            name: metric_history(client, run.info.run_id, "train/loss")
            for name, run in runs.items()
        }
        assert sorted(losses["two-hosts"]) == list(range(1, 19))
        assert losses["two-hosts"] == losses["local"]
        assert metric_history(
            client, runs["two-hosts"].info.run_id, "val/accuracy"
        ) == metric_history(client, runs["local"].info.run_id, "val/accuracy")
        # Every rank's shard reached the store, from the host that wrote it.
        keys = store.keys("two-hosts/")
        assert any(k.endswith("step_00000018/__0_0.distcp") for k in keys), keys
        assert any(k.endswith("step_00000018/__1_0.distcp") for k in keys), keys

        # A machine that trained nothing takes the run by its id, through the tracking server only.
        run_id = runs["two-hosts"].info.run_id
        b_env = {**env}
        # Meanwhile the local reference is consolidated too, to compare the final weights.
        with meanwhile(
            [
                sys.executable,
                "-m",
                "pipeline",
                "consolidate",
                "--run-id",
                runs["local"].info.run_id,
                "--latest",
            ],
            local,
            env,
            local / "consolidate.log",
            timeout=180,
        ):
            b.run(
                [sys.executable, "-m", "pipeline", "consolidate", "--run-id", run_id, "--latest"],
                env=b_env,
                timeout=180,
            )
            b.run(
                [sys.executable, "-m", "pipeline", "export", "--run-id", run_id],
                env=b_env,
                timeout=240,
            )
        phase("consolidate + export on B, consolidate the reference meanwhile")
        # Bit-exact: the resumed two-host run's final weights are the uninterrupted local run's.
        assert (
            run_lineage(runs["two-hosts"].info.run_id, client)["consolidated"]["sha256"]
            == run_lineage(runs["local"].info.run_id, client)["consolidated"]["sha256"]
        )
        version = client.get_model_version_by_alias("digits-two-hosts", "champion")
        assert version.run_id == run_id and version.tags[lineage.RUN_ID] == run_id

        # Served on host B from the registry alias, asked from host A; then the chain re-proved from
        # host A. On an address other than loopback the server starts only with a token
        # (TRAINSERVE_AUTH_TOKEN).
        token = {"TRAINSERVE_AUTH_TOKEN": "two-hosts-secret"}
        server = b.popen(
            [
                sys.executable,
                "-m",
                "serving",
                "--model",
                "models:/digits-two-hosts@champion",
                "--host",
                b.address,
                "--port",
                "8080",
            ],
            env={**b_env, **token},
            stdout=open(b.workdir / "serving.log", "w"),
            stderr=subprocess.STDOUT,
        )
        base = f"http://{b.address}:8080"
        ask = a.run(
            [sys.executable, "-c", READY_AND_ASK, base],
            env={**env, **token},
            timeout=120,
            check=False,
        )
        assert ask.returncode == 0, (
            ask.stderr[-3000:] + (b.workdir / "serving.log").read_text()[-3000:]
        )
        phase("serve + one request")
        answer = json.loads(ask.stdout)
        assert (
            answer["headers"]["x-model-run-id"] == run_id
            and answer["headers"]["x-model-version"] == version.version
        )
        verified = a.run(
            [
                sys.executable,
                "-m",
                "pipeline",
                "verify",
                "models:/digits-two-hosts@champion",
                "--server",
                base,
            ],
            env={**env, **token},
            timeout=240,
            check=False,
        )
        assert verified.returncode == 0, verified.stdout + verified.stderr[-3000:]
        assert re.search(r"^verified: models:/digits-two-hosts@champion", verified.stdout, re.M), (
            verified.stdout
        )
        phase("verify")
        server.terminate()
    print("seconds per phase:", phases)


# Run on host A: waits for the server on host B to be ready, sends one real 8x8 digit, prints
# headers + body.
READY_AND_ASK = """
import json, os, sys, time, requests
base = sys.argv[1]
for _ in range(240):
    try:
        if requests.get(base + "/v2/health/ready", timeout=1).ok:
            break
    except requests.RequestException:
        pass
    time.sleep(0.5)
else:
    sys.exit("server not ready")
from sklearn.datasets import load_digits
image = (load_digits().images[0] / 16.0).tolist()
reply = requests.post(base + "/invocations", json={"inputs": {"input": [[image]]}}, timeout=30,
                      headers={"Authorization": "Bearer " + os.environ["TRAINSERVE_AUTH_TOKEN"]})
reply.raise_for_status()
print(json.dumps({"headers": {k.lower(): v for k, v in reply.headers.items()}, "body": reply.json()}))
"""
