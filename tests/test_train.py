"""The train stage as users run it: the CLI, real torchrun processes, a real MLflow store."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO, TINY, cli_env, only_run, run_cli, run_lineage

from pipeline.config import flatten, load_config
from serving import lineage

pytestmark = pytest.mark.slow


def metric_history(client, run, key):
    return [
        m.value
        for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
    ]


def test_demo_config_on_two_processes_reaches_95_percent_and_is_tracked(workdir):
    """The README's main job: 2 processes, digits, real MLflow store in the working directory."""
    run_cli(
        [
            "train",
            "--config",
            str(REPO / "configs/digits_resnet18.yaml"),
            "--nproc-per-node",
            "2",
            "train.run_name=demo",
        ],
        cwd=workdir,
    )
    client, run = only_run(workdir, "trainserve-digits")
    assert run.info.status == "FINISHED"
    accuracy = metric_history(client, run, "val/accuracy")
    assert accuracy[-1] >= 0.95, accuracy
    loss = metric_history(client, run, "train/loss")
    assert loss[-1] < 0.5 * loss[0], loss
    cfg = load_config(REPO / "configs/digits_resnet18.yaml", ["train.run_name=demo"])
    assert run.data.params["optim.lr"] == "0.1"
    # The config's keys, and the model's arguments as built: the data filled in num_classes and the
    # input stats.
    assert set(flatten(cfg)) <= set(run.data.params)
    assert (
        run.data.params["model.args.width"] == "0.5"
        and run.data.params["model.args.num_classes"] == "10"
    )
    for key in ("train/lr", "train/grad_norm", "train/samples_per_s", "val/loss"):
        assert key in run.data.metrics, key
    assert any(k.startswith("system/cpu") for k in run.data.metrics), sorted(run.data.metrics)
    tags = run.data.tags
    assert tags[lineage.SETUP] == "2 x cpu, ddp, fp32" and lineage.read_stages(
        tags[lineage.STAGES]
    ) == {"train": "done"}
    # bookkeeping gone with the process
    assert len(tags[lineage.GIT]) == 12 and lineage.PROCESS not in tags
    assert len([k for k in tags if k.startswith(lineage.PREFIX)]) <= 12, sorted(tags)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config", "confusion_matrix.png", "checkpoints"} <= artifacts
    # built-in components: nothing of the user's to keep
    assert "code" not in artifacts
    assert tags[lineage.MODEL] == "pipeline.models:resnet18"
    ckpts = [a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")]
    # The final checkpoint, and the best one when it is another (checkpoint.log_to_mlflow=last).
    best = f"checkpoints/{tags[lineage.BEST]}"
    record = run_lineage(run.info.run_id, client)["training"]
    assert (
        ckpts == sorted({best, "checkpoints/step_00000132"})
        and record["monitor"] == "val/accuracy (max)"
    )
    assert (
        record["best_value"] == pytest.approx(max(accuracy), abs=1e-6)
        and tags[lineage.LATEST] == "step_00000132"
    )
    files = {a.path.rsplit("/", 1)[-1] for a in client.list_artifacts(run.info.run_id, ckpts[0])}
    assert {".metadata", "COMPLETE", "trainserve.json", "__0_0.distcp", "__1_0.distcp"} <= files


def test_two_torchrun_nodes_rendezvous_over_c10d(workdir):
    """Multi-node as on a cluster, on one machine: two launchers, one process each, c10d on
    127.0.0.1."""
    from pipeline.tracking import free_port

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=trainserve-test",
        "-m",
        "pipeline.train",
        "--config",
        str(TINY),
        "train.run_name=multinode",
        "train.max_steps=4",
    ]
    nodes = [
        subprocess.Popen(
            cmd,
            cwd=workdir,
            env=cli_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        outs = [n.communicate(timeout=240)[0] for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(o[-3000:] for o in outs)
    joined = "\n".join(outs)
    assert "[rank0]" in joined and "[rank1]" in joined and "world size 2" in joined
    client, run = only_run(workdir, "tiny")
    assert run.info.status == "FINISHED" and run.data.tags[lineage.SETUP].startswith("2 x cpu")


def test_replica_check_catches_a_planted_divergence(workdir):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(REPO / "tests/scripts/plant_divergence.py"),
        ],
        cwd=workdir,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (
        proc.stdout.count(
            "caught: replicas diverged at step 2: 'head.weight' differs between ranks"
        )
        == 2
    )


def test_unreachable_tracking_server_fails_fast_before_training(workdir):
    start = time.monotonic()
    proc = run_cli(
        ["train", "--config", str(TINY), "tracking.tracking_uri=http://127.0.0.1:9"],
        cwd=workdir,
        check=False,
    )
    assert proc.returncode == 2
    assert "http://127.0.0.1:9 cannot be reached" in proc.stderr
    assert time.monotonic() - start < 60
    assert not (workdir / "outputs").exists() or not any((workdir / "outputs").rglob("COMPLETE"))


def test_diverging_training_stops_and_leaves_its_run_failed(workdir):
    proc = run_cli(
        ["train", "--config", str(TINY), "optim.lr=1e20", "train.run_name=boom"],
        cwd=workdir,
        check=False,
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "the training loss is nan" in proc.stderr
    _, run = only_run(workdir, "tiny")
    assert run.info.status == "FAILED"


@pytest.mark.parametrize("killed", [1, 0])
def test_a_rank_killed_without_restarts_leaves_the_run_failed_not_running(workdir, killed):
    """Rank 1 killed: torchrun SIGTERMs rank 0, which closes its run itself. Rank 0 killed (SIGKILL,
    like the OOM killer): it gets no chance to, and the launcher closes the run after torchrun."""
    proc = run_cli(
        ["train", "--config", str(TINY), "--nproc-per-node", "2", "train.run_name=killed"],
        cwd=workdir,
        env={"TRAINSERVE_FAULT": f"step:3:{killed}"},
        check=False,
    )
    assert proc.returncode != 0
    _, run = only_run(workdir, "tiny")
    assert run.info.status == "FAILED"
    assert lineage.read_stages(run.data.tags[lineage.STAGES])["train"] == "failed"
    closed_by_launcher = f"marked MLflow run {run.info.run_id} FAILED" in proc.stderr
    assert closed_by_launcher == (killed == 0), proc.stderr[-2000:]
    # Rank 0 that closed its run says so in the run directory, and the launcher then leaves the
    # store alone (opening it after torchrun took it 4.5 s, most of a failed launch's exit).
    record = json.loads(next((workdir / "outputs").rglob("mlflow_run.json")).read_text())
    assert record == (
        {"run_id": run.info.run_id, "ended": "FAILED"}
        if killed == 1
        else {"run_id": run.info.run_id}
    )
    if killed == 1:
        # The same run directory again, its rank 0 killed outright just as it reopens the run: the
        # record must not still say the run was ended, or the launcher would leave it RUNNING.
        proc = run_cli(
            ["train", "--config", str(TINY), "--nproc-per-node", "2", "train.run_name=killed"],
            cwd=workdir,
            env={"TRAINSERVE_FAULT": "run_reopened:0:0"},
            check=False,
        )
        assert proc.returncode != 0
        _, run = only_run(workdir, "tiny")
        assert run.info.status == "FAILED", proc.stderr[-2000:]
        assert f"marked MLflow run {run.info.run_id} FAILED" in proc.stderr, proc.stderr[-2000:]


def test_a_rank_whose_peer_died_stops_waiting_for_its_reason_at_torchruns_sigterm(
    tmp_path, monkeypatch
):
    """A rank whose collective failed waits for the peer's one line about bad input, but not once
    torchrun's SIGTERM came (ignored while the run is closed) with no line written: a peer killed
    outright says nothing, and each such failure (or restart) would wait out the whole wait."""
    import os
    import signal
    import threading

    from pipeline.distributed import launch
    from pipeline.tools import stopping

    monkeypatch.setenv(launch.ERROR_FILE, str(tmp_path / "error"))
    # (another test of this process may have had a SIGTERM noted)
    monkeypatch.setattr(stopping, "_received", False)
    previous = signal.getsignal(signal.SIGTERM)
    stopping.ignore_sigterm()
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        timer.start()
        started = time.monotonic()
        assert not launch.another_rank_said_why(wait=60)
        assert time.monotonic() - started < 10
        # A line written before the SIGTERM is still found.
        (tmp_path / "error.0").write_text("pipeline train: [rank1] error: ...\n")
        assert launch.another_rank_said_why(wait=60)
    finally:
        # the SIGTERM sent, or never sent, before the default handler is back
        timer.cancel()
        timer.join()
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("delay", [0.0, 0.02, 0.2])
def test_sigterms_raining_on_a_training_rank_never_leave_its_run_running(
    workdir, monkeypatch, delay
):
    """The race behind a red CI run: a peer dies, this rank's collective fails, and torchrun's
    SIGTERM lands while the run is being marked FAILED. Here SIGTERMs rain on an in-process
    `train.main` from `delay` seconds after its run appears until it returns; whatever they
    interrupt, the run ends FAILED and the stage exits 143."""
    import os
    import signal
    import threading

    from conftest import mlflow_client

    from pipeline import train

    monkeypatch.chdir(workdir)
    cfg = load_config(TINY, ["train.max_steps=400", "train.run_name=rained-on"])
    client = mlflow_client(workdir)
    stop = threading.Event()

    def rain():
        while not stop.is_set() and not client.search_runs(
            [e.experiment_id for e in client.search_experiments()] or ["0"]
        ):
            time.sleep(0.005)
        time.sleep(delay)
        while not stop.is_set():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.0005)

    previous, threads = signal.getsignal(signal.SIGTERM), torch.get_num_threads()
    # `main` puts back the handler it found when it returns, while SIGTERMs still rain: that one
    # must not be the default, which would kill pytest itself.
    signal.signal(signal.SIGTERM, lambda *_: None)
    rainer = threading.Thread(target=rain, daemon=True)
    rainer.start()
    try:
        with pytest.raises(SystemExit) as exited:
            train.main(cfg)
    finally:
        stop.set()
        rainer.join()
        signal.signal(signal.SIGTERM, previous)
        torch.set_num_threads(threads)
    assert exited.value.code == 143
    _, run = only_run(workdir, "tiny")
    assert run.info.status == "FAILED"
    assert lineage.read_stages(run.data.tags[lineage.STAGES])["train"] == "failed"


def test_the_cpu_training_loop_does_not_page_fault_every_step(workdir):
    """With glibc's defaults the demo's loop faulted ~380 pages in per step (freed gradients and
    activations handed back to the kernel, then touched again), 5-15% of its time on this
    machine."""
    import resource

    def child_faults(steps: int) -> int:
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
        run_cli(
            [
                "train",
                "--config",
                str(REPO / "configs/digits_resnet18.yaml"),
                f"train.max_steps={steps}",
                "train.eval_every=0",
                "train.log_every=20",
                "checkpoint.every_n_steps=0",
                "train.threads_per_rank=1",
                "tracking.system_metrics=false",
                f"train.run_name=faults{steps}",
            ],
            cwd=workdir,
        )
        return resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - before

    per_step = (child_faults(80) - child_faults(20)) / 60
    assert per_step < 100, f"{per_step:.0f} page faults per training step"


def test_sigterm_to_the_launcher_alone_stops_the_workers_and_fails_the_run(workdir):
    """`docker stop` (tini without -g) or a scheduler signals only `pipeline train`; torchrun and
    its workers must hear of it, stop, and leave the run FAILED, not orphaned and RUNNING."""
    import os
    import signal
    import subprocess
    import threading

    from conftest import cli_env

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline",
            "train",
            "--config",
            str(TINY),
            "--nproc-per-node",
            "2",
            "train.max_steps=100000",
            "train.run_name=stopped",
            "--verbose",
        ],
        cwd=workdir,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    # Should the awaited line never come, this kills the launcher's group instead of waiting out
    # 100000 steps.
    watchdog = threading.Timer(180, lambda: os.killpg(proc.pid, signal.SIGKILL))
    watchdog.start()
    try:
        # wait until training runs: its run exists and steps are logged
        for line in proc.stdout:
            if "checkpoint saved" in line:
                break
        else:
            raise AssertionError("training ended or was killed before its first checkpoint")
        # the launcher only, not its process group
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=90)[0]
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0, rest[-3000:]
    _, run = only_run(workdir, "tiny")
    assert run.info.status == "FAILED", rest[-3000:]
    assert subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True).stdout == b"", (
        "workers left behind"
    )
