"""Run directories have one owner, state files survive crashes, checkpoints follow the timeline
being trained, and MLflow runs are never left RUNNING by a process that is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from conftest import (
    CPU1,
    TINY,
    checkpoint_meta,
    cli_env,
    copy_run,
    mlp_spec,
    only_run,
    run_cli,
)

from pipeline import checkpoint
from pipeline.checkpoint import run_dir
from pipeline.checkpoint import store as checkpoint_store
from pipeline.components.build import instantiate_model
from pipeline.config import load_config
from pipeline.train import default_run_name
from serving import lineage

HOLD = textwrap.dedent("""
    import sys, time
    from pipeline.checkpoint import run_dir
    run_dir.claim(sys.argv[1])
    print("claimed", flush=True)
    time.sleep(float(sys.argv[2]))
""")


def holder(directory, seconds: float = 60) -> subprocess.Popen:
    """Another process that owns `directory` until it is killed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory), str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
        env=cli_env(),
    )
    assert proc.stdout.readline().strip() == "claimed"
    return proc


def test_default_run_names_differ_even_within_one_second(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    names = {default_run_name(load_config(None)) for _ in range(20)}
    assert len(names) == 20 and all(n.startswith("resnet18-digits-") for n in names)


def test_a_run_directory_has_one_owner_and_a_dead_owner_lets_go(tmp_path):
    other = holder(tmp_path / "run")
    try:
        with pytest.raises(
            run_dir.RunDirBusy,
            match=f"is in use by pid {other.pid} on .* \\(-c .*run 60\\): wait for it",
        ):
            run_dir.claim(tmp_path / "run")
        assert run_dir.owner_of(tmp_path / "run")["pid"] == other.pid
    finally:
        other.kill()
        other.wait()
    # the kernel dropped the lock with the process: the next claim succeeds and learns who had it
    previous = run_dir.claim(tmp_path / "run")
    assert previous["pid"] == other.pid and run_dir.alive(previous) is False
    # this process holds it now
    assert run_dir.owner_of(tmp_path / "run") is None


def test_the_launchers_child_may_work_in_the_directory_its_launcher_owns(tmp_path):
    """`pipeline run` and `pipeline train --nproc-per-node` claim, then spawn torchrun, whose rank 0
    claims too."""
    run_dir.claim(tmp_path / "mine")
    child = subprocess.run(
        [sys.executable, "-c", HOLD, str(tmp_path / "mine"), "0"],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=60,
    )
    assert child.returncode == 0 and "claimed" in child.stdout, child.stderr


def test_a_re_save_of_a_step_never_leaves_the_step_without_a_checkpoint(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    spec = mlp_spec()
    model = instantiate_model(spec)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = checkpoint.save(root, 5, model, opt, checkpoint_meta(model, spec), CPU1, keep_last=2)
    inode = first.stat().st_ino
    # atomic exchange
    checkpoint.save(root, 5, model, opt, checkpoint_meta(model, spec), CPU1, keep_last=2)
    assert (
        sorted(p.name for p in root.iterdir()) == ["step_00000005"] and first.stat().st_ino != inode
    )
    # Where the filesystem can't exchange, a crash between the two renames leaves `.old-step_N`
    # alone:
    os.replace(first, root / ".old-step_00000005")
    assert checkpoint.latest(root) == root / ".old-step_00000005"
    checkpoint.load(checkpoint.latest(root), instantiate_model(spec), None, CPU1)
    from pipeline.checkpoint import layout

    monkeypatch.setattr(layout, "_exchange", lambda a, b: False)
    checkpoint.save(root, 5, model, opt, checkpoint_meta(model, spec), CPU1, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000005"]


@pytest.mark.slow
def test_a_resume_from_an_older_step_sets_the_later_timeline_aside(tmp_path):
    """keep_last=1 after a resume from step 6 of a run that reached 16: the new step 10 is kept (it
    was deleted: 16 sorts later), 12 and 16 move aside, and latest / the run's final checkpoint are
    step 10."""
    common = [
        "train",
        "--config",
        str(TINY),
        "model.name=mlp",
        "model.args={hidden: [16]}",
        "train.eval_every=0",
        "train.run_name=rewound",
        "tracking.system_metrics=false",
    ]
    run_cli(
        [*common, "train.max_steps=16", "checkpoint.every_n_steps=6", "checkpoint.keep_last=3"],
        cwd=tmp_path,
    )
    ckpts = tmp_path / "outputs/rewound/checkpoints"
    run_cli(
        [
            *common,
            "train.max_steps=10",
            "checkpoint.every_n_steps=0",
            "checkpoint.keep_last=1",
            "--resume",
            str(ckpts / "step_00000006"),
        ],
        cwd=tmp_path,
    )
    assert [p.name for p in checkpoint.list_complete(ckpts)] == ["step_00000010"]
    aside = list((tmp_path / "outputs/rewound/checkpoints.abandoned").iterdir())
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == [
        "step_00000012",
        "step_00000016",
    ]
    client, run = only_run(tmp_path, "tiny")
    assert run.data.tags[lineage.LATEST] == "step_00000010"
    # The run's artifacts hold step 16 (the first attempt's final upload) and step 10: a download
    # takes 10.
    found = checkpoint_store.resolve_resume(
        run.info.run_id, tmp_path / "elsewhere" / "checkpoints", CPU1
    )
    assert found.name == "step_00000010"


@pytest.mark.slow
def test_a_damaged_state_file_is_an_error_that_names_it(tmp_path):
    run = tmp_path / "outputs" / "broken"
    run.mkdir(parents=True)
    # what a full disk left behind with write_text
    (run / "mlflow_run.json").write_text("")
    proc = run_cli(
        ["run", "--config", str(TINY), "train.run_name=broken"], cwd=tmp_path, check=False
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (
        "pipeline run: error: outputs/broken/mlflow_run.json is damaged (JSONDecodeError"
        in proc.stderr
    )
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_second_run_in_a_live_run_directory_stops_naming_the_owner(tmp_path):
    """The review's sweep: two runs sharing a directory deleted each other's checkpoints."""
    first = subprocess.Popen(
        # each "checkpoint saved" line
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
            "train.run_name=busy",
            "tracking.system_metrics=false",
            "--verbose",
        ],
        cwd=tmp_path,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        # should the line never come
        watchdog = threading.Timer(180, lambda: os.killpg(first.pid, signal.SIGKILL))
        watchdog.start()
        for line in first.stdout:
            if "checkpoint saved" in line:
                break
        watchdog.cancel()
        for argv in (
            ["train", "--config", str(TINY), "--resume", "latest", "train.run_name=busy"],
            ["run", "--config", str(TINY), "train.run_name=busy"],
        ):
            second = run_cli(argv, cwd=tmp_path, check=False, timeout=120)
            assert second.returncode == 2, second.stderr[-2000:]
            assert "outputs/busy is in use by pid" in second.stderr, second.stderr[-2000:]
            # the owner's command
            assert "pipeline train --config" in second.stderr
    finally:
        os.killpg(first.pid, signal.SIGTERM)
        first.wait(timeout=90)
    assert first.returncode != 0
    # its checkpoints are intact
    assert [p.name for p in checkpoint.list_complete(tmp_path / "outputs/busy/checkpoints")]


@pytest.mark.slow
def test_a_rank_0_killed_under_a_plain_torchrun_is_closed_by_the_next_command(tmp_path):
    """No launcher to close the run: the next stage that finds it RUNNING with its owner gone
    does."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "pipeline.train",
        "--config",
        str(TINY),
        "train.run_name=orphan",
        "tracking.system_metrics=false",
    ]
    proc = subprocess.run(
        cmd,
        cwd=tmp_path,
        env=cli_env({"TRAINSERVE_FAULT": "step:8:0"}),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode != 0 and "SIGKILL to rank 0 at step 8" in proc.stderr
    _, run = only_run(tmp_path, "tiny")
    # what the review saw: nobody closes it
    assert run.info.status == "RUNNING"
    closed = run_cli(["consolidate", str(tmp_path / "outputs/orphan"), "--latest"], cwd=tmp_path)
    assert (
        "was left RUNNING by pid" in closed.stderr
        and "which is gone: marked FAILED" in closed.stderr
    )
    _, run = only_run(tmp_path, "tiny")
    assert (
        run.info.status == "FAILED"
        and lineage.read_stages(run.data.tags[lineage.STAGES])["train"] == "failed"
    )
    assert run.data.tags[lineage.PROCESS].startswith("gone: ")


@pytest.fixture
def finished(tiny_run, tmp_path):
    """A trained and consolidated run, FINISHED: a copy of the session's tiny run."""
    return copy_run(tiny_run, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["TERM", "KILL"])
def test_an_export_stopped_while_it_holds_the_training_run_never_leaves_it_running(finished, how):
    """Export reopens the FINISHED training run to log the model. SIGTERM: the stage closes it with
    its own status on the way out. SIGKILL: nothing runs, and the next command puts the status
    back."""
    workdir = finished.workdir
    fault = "stage_export:0:0" + (":TERM" if how == "TERM" else "")
    proc = run_cli(
        ["export", str(finished.run_dir / "consolidated")],
        cwd=workdir,
        env={"TRAINSERVE_FAULT": fault},
        check=False,
    )
    assert proc.returncode != 0
    client, run = only_run(workdir, "tiny")
    if how == "KILL":
        assert run.info.status == "RUNNING"
        run_cli(["consolidate", str(finished.run_dir), "--latest"], cwd=workdir)
        client, run = only_run(workdir, "tiny")
    # the training's own status, not FAILED, not RUNNING
    assert run.info.status == "FINISHED", how
    stages = lineage.read_stages(run.data.tags[lineage.STAGES])
    assert stages["export"] == "failed" and stages["train"] == "done", stages


@pytest.mark.parametrize(
    "component, args, stem",
    [
        ("timm:create_model", {"model_name": "resnet10t", "num_classes": 10}, "resnet10t-digits"),
        (
            "transformers:AutoModelForSequenceClassification.from_pretrained",
            {"pretrained_model_name_or_path": "/models/bert-tiny/"},
            "bert-tiny-digits",
        ),
        # nothing names the model: as written
        (
            "my_project.models:create_model",
            {"hidden": 8},
            "create-model-digits",
        ),
        # a class, not a factory
        (
            "pipeline.models:resnet18",
            {"name": "ignored"},
            "resnet18-digits",
        ),
    ],
)
def test_run_names_come_from_the_model_a_factory_builds_and_the_data(component, args, stem):
    """The review's `create-model-digits32-...` for timm's resnet10t: a run is named after its
    model."""
    cfg = load_config(None)
    cfg.model.component, cfg.model.args = component, args
    assert default_run_name(cfg).startswith(stem + "-")


def test_consolidate_and_export_respect_a_live_owner_of_the_run_directory(tmp_path, capsys):
    """The review: consolidate and export ignored the run-directory owner (only run and train took
    it), so they could rewrite consolidated/ and onnx/ under a live training's feet. Here both stop,
    naming the owner; once it is gone, consolidate goes ahead."""
    from pipeline.cli import main as pipeline_cli

    spec = mlp_spec()
    model = instantiate_model(spec)
    ckpt = checkpoint.save(
        tmp_path / "run" / "checkpoints",
        1,
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        checkpoint_meta(model, spec, config=load_config(TINY).model_dump(mode="json")),
        CPU1,
        keep_last=5,
    )
    # no owner record yet: nobody's directory
    assert pipeline_cli(["consolidate", str(ckpt), "--no-log"]) == 0
    capsys.readouterr()
    other = holder(tmp_path / "run")
    try:
        assert pipeline_cli(["consolidate", str(ckpt), "--no-log"]) == 2
        assert f"run is in use by pid {other.pid}" in capsys.readouterr().err
        assert (
            pipeline_cli(["export", str(tmp_path / "run" / "consolidated"), "--no-register"]) == 2
        )
        assert f"run is in use by pid {other.pid}" in capsys.readouterr().err
        assert not (tmp_path / "run" / "onnx").exists()
    finally:
        other.kill()
        other.wait()
    assert pipeline_cli(["consolidate", str(ckpt), "--no-log"]) == 0
