"""Best, not last: the best checkpoint is kept and taken downstream; early stopping stops every
rank."""

from __future__ import annotations

import json
import math
import re

import pytest
from conftest import TINY, only_run, run_cli, run_lineage

from pipeline.components.monitor import Monitor, build_monitor
from pipeline.config import CheckpointConfig, ConfigError, TrainConfig
from pipeline.tasks.classification import Classification
from pipeline.tasks.regression import Regression
from serving import lineage


def test_the_monitor_keeps_the_best_and_counts_evaluations_without_a_real_improvement():
    m = Monitor("rmse", "min", patience=2, min_delta=0.1)
    assert m.update({"rmse": 1.0}, 10)
    # better: the new best, but by less than min_delta
    assert m.update({"rmse": 0.95}, 20)
    assert (m.best_step, m.bad_evals, m.stopped) == (20, 1, "")
    # a NaN is never better
    assert not m.update({"rmse": float("nan")}, 30)
    assert m.best_step == 20 and m.stopped.startswith(
        "early stopping at step 30: val/rmse did not improve"
    )
    resumed = Monitor("rmse", "min", patience=2, min_delta=0.1)
    resumed.restore(m.state())
    assert resumed.state() == m.state()
    first_nan = Monitor("accuracy", "max", patience=3)
    assert not first_nan.update({"accuracy": float("nan")}, 1) and first_nan.best_step is None
    assert first_nan.update({"accuracy": 0.5}, 2) and (
        first_nan.best_step,
        first_nan.bad_evals,
    ) == (2, 0)
    other = Monitor("mae", "min")
    # another metric's record starts fresh
    other.restore(m.state())
    assert other.best_step is None


def test_the_monitored_metric_defaults_to_the_tasks_primary_and_a_wrong_name_is_named():
    train = TrainConfig()
    assert (
        build_monitor(CheckpointConfig(), train, Classification(None, 5, num_classes=10)).metric,
        build_monitor(CheckpointConfig(), train, Regression()).mode,
    ) == ("accuracy", "min")
    assert (
        build_monitor(
            CheckpointConfig(monitor="val/loss"), train, Classification(None, 5, num_classes=3)
        ).mode
        == "min"
    )
    with pytest.raises(ConfigError, match="checkpoint.mode=max"):
        build_monitor(CheckpointConfig(monitor="f1"), train, Regression())
    with pytest.raises(ConfigError, match="reports accuracy, loss"):
        Monitor("acc", "max").update({"accuracy": 0.5, "loss": 1.0}, 1)


def test_early_stopping_stops_both_ranks_at_the_same_step_and_the_best_survives_keep_last_1(
    workdir,
):
    patience, every = 2, 2
    proc = run_cli(
        [
            "train",
            "--config",
            str(TINY),
            "--nproc-per-node",
            "2",
            "train.run_name=es",
            f"train.eval_every={every}",
            "checkpoint.every_n_steps=0",
            "checkpoint.keep_last=1",
            "checkpoint.monitor=val/loss",
            f"train.early_stopping.patience={patience}",
            "train.max_steps=30",
        ],
        cwd=workdir,
    )
    client, run = only_run(workdir, "tiny")
    history = sorted(
        (m.step, m.value) for m in client.get_metric_history(run.info.run_id, "val/loss")
    )
    stopped_at = {
        int(s) for s in re.findall(r"\[rank[01]\].*early stopping at step (\d+)", proc.stderr)
    }
    ranks = set(re.findall(r"\[rank([01])\].*early stopping at step", proc.stderr))
    assert ranks == {"0", "1"} and len(stopped_at) == 1, proc.stderr[-3000:]
    last = stopped_at.pop()
    # What the rule says, from the logged history: the lowest loss so far, then `patience`
    # evaluations without it.
    best_step, best = min(((s, v) for s, v in history), key=lambda sv: (sv[1], sv[0]))
    assert last == best_step + patience * every < 30 and history[-1][0] == last

    ckpts = workdir / "outputs" / "es" / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == sorted(
        {f"step_{best_step:08d}", f"step_{last:08d}"}
    )
    record = json.loads((ckpts / "best.json").read_text())
    assert (record["step"], record["metric"], record["mode"]) == (best_step, "val/loss", "min")
    assert math.isclose(record["value"], best, rel_tol=1e-9)
    tags = client.get_run(run.info.run_id).data.tags
    assert tags[lineage.BEST] == f"step_{best_step:08d}"
    record = run_lineage(run.info.run_id, client)["training"]
    assert record["early_stopping"].startswith(
        f"early stopping at step {last}: val/loss did not improve"
    )
    assert (
        run.info.status == "FINISHED"
        and lineage.read_stages(tags[lineage.STAGES])["train"] == "done"
    )

    # Downstream takes the best unless told --latest, and says which.
    run_cli(["consolidate", str(workdir / "outputs" / "es"), "--no-log"], cwd=workdir)
    source = json.loads((workdir / "outputs/es/consolidated/model.json").read_text())["source"]
    assert (source["step"], source["best"]) == (best_step, True)
    assert math.isclose(source["val_metrics"]["loss"], best, rel_tol=1e-9)
    run_cli(["consolidate", str(workdir / "outputs" / "es"), "--latest", "--no-log"], cwd=workdir)
    assert (
        json.loads((workdir / "outputs/es/consolidated/model.json").read_text())["source"]["step"]
        == last
    )

    # A resume of the stopped run trains nothing more.
    again = run_cli(
        [
            "train",
            "--config",
            str(TINY),
            "train.run_name=es",
            "--resume",
            "latest",
            f"train.eval_every={every}",
            "checkpoint.every_n_steps=0",
            "checkpoint.keep_last=1",
            "checkpoint.monitor=val/loss",
            f"train.early_stopping.patience={patience}",
            "train.max_steps=30",
        ],
        cwd=workdir,
    )
    assert f"resumed from outputs/es/checkpoints/step_{last:08d} at step {last}" in again.stderr
    assert max(m.step for m in client.get_metric_history(run.info.run_id, "train/loss")) == last
    assert sorted(p.name for p in ckpts.glob("step_*")) == sorted(
        {f"step_{best_step:08d}", f"step_{last:08d}"}
    )


def test_export_says_which_checkpoint_its_weights_are():
    from pipeline.export import describe_source

    source = {
        "checkpoint": "/r/checkpoints/step_00000110",
        "step": 110,
        "best": True,
        "val_metrics": {"accuracy": 0.983287, "loss": 0.12},
    }
    assert (
        describe_source(source)
        == "the run's best checkpoint step_00000110 (step 110, val/accuracy 0.983287, val/loss 0.12)"
    )
    assert (
        describe_source({"checkpoint": "/r/checkpoints/step_00000132", "step": 132, "best": False})
        == "checkpoint step_00000132 (step 132)"
    )
