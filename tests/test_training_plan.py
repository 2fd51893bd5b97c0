"""What training works out once, before it starts, and when its periodic parts are due.

config.check_runtime returns the run's Plan: the mesh's degrees and the batch plan that train.main,
the loaders and the pipeline's build read. Saving, evaluating and logging each say when they are
due with `due(step, last)`."""

import dataclasses

import pytest
from conftest import CPU1, TINY

from pipeline.checkpoint.saver import Saver
from pipeline.config import ConfigError, check_runtime, load_config
from pipeline.plan import BatchPlan, Degrees, deal_batch
from pipeline.tools.every import Every
from pipeline.train import Learner, MetricsLog, Training


def plan_of(world: int, *overrides: str):
    return check_runtime(load_config(str(TINY), list(overrides)), world, cuda_available=False)


# --- the batch plan ------------------------------------------------------------------------------


def test_the_batch_is_dealt_over_the_data_parallel_ranks_and_the_accumulation_steps():
    plan = plan_of(
        8,
        "train.strategy=fsdp",
        "train.parallel.tp=2",
        "train.global_batch_size=96",
        "train.grad_accum_steps=3",
    )
    assert plan.degrees == Degrees(dp_replicate=1, dp_shard=4, tp=2, pp=1)
    assert plan.degrees.data_parallel == 4 and plan.degrees.needs_mesh
    # The two tensor-parallel ranks of a group read the same rows: the batch is dealt over 4.
    assert plan.batch == BatchPlan(rows=8, data_parallel=4, accumulation=3, microbatches=1)
    assert plan.batch.global_batch_size == 96 and plan.batch.rows_per_step == 24


def test_a_pipeline_cuts_each_read_into_micro_batches_and_divides_the_loss_by_every_piece():
    plan = plan_of(
        2,
        "train.parallel.pp=2",
        "train.global_batch_size=64",
        "train.grad_accum_steps=2",
        "train.parallel.pp_microbatches=8",
    )
    assert plan.degrees == Degrees(dp_replicate=1, dp_shard=1, tp=1, pp=2)
    assert (plan.batch.rows, plan.batch.micro_rows, plan.batch.pieces) == (32, 4, 16)
    # pp_microbatches=0 is twice the stages
    assert plan_of(2, "train.parallel.pp=2").batch.microbatches == 4


def test_without_a_pipeline_each_read_is_one_micro_batch_whatever_pp_microbatches_says():
    plan = plan_of(2, "train.parallel.pp_microbatches=8", "train.grad_accum_steps=2")
    assert plan.batch == BatchPlan(rows=8, data_parallel=2, accumulation=2, microbatches=1)
    assert plan.batch.pieces == 2 and not plan.degrees.needs_mesh


@pytest.mark.parametrize(
    "batch, accumulation, degrees, message",
    [
        (
            30,
            4,
            Degrees(1, 2, 1, 1),
            "train.global_batch_size=30 must divide by world size (2) x "
            "train.grad_accum_steps (4) = 8; try train.global_batch_size=24 or 32",
        ),
        # Smaller than one row a rank: the smallest batches that divide
        (
            5,
            1,
            Degrees(1, 8, 1, 1),
            "must divide by world size (8) x train.grad_accum_steps (1) = 8; "
            "try train.global_batch_size=8 or 16",
        ),
        (
            50,
            2,
            Degrees(1, 2, 2, 2),
            "must divide by the data-parallel ranks (2 = world size 8 / tp 2 / pp 2) x "
            "train.grad_accum_steps (2) = 4; try train.global_batch_size=48 or 52",
        ),
    ],
)
def test_a_batch_that_does_not_divide_is_refused_with_the_nearest_that_do(
    batch, accumulation, degrees, message
):
    with pytest.raises(ConfigError) as refused:
        deal_batch(batch, accumulation, degrees)
    assert message in str(refused.value)


def test_the_mesh_is_only_asked_for_beyond_data_parallelism_over_every_rank():
    assert not Degrees(1, 4, 1, 1).needs_mesh
    assert all(
        d.needs_mesh for d in (Degrees(2, 2, 1, 1), Degrees(1, 2, 2, 1), Degrees(1, 2, 1, 2))
    )
    assert list(Degrees(2, 3, 1, 1).named().items()) == [
        ("dp_replicate", 2),
        ("dp_shard", 3),
        ("tp", 1),
        ("pp", 1),
    ]


# --- when each part is due --------------------------------------------------------------------


def due_steps(part, steps: int = 10, last: int = 10) -> list[int]:
    return [step for step in range(1, steps + 1) if part.due(step, last=step == last)]


def test_a_period_of_0_is_due_only_at_the_last_step():
    assert due_steps(Every(0)) == [10]
    assert due_steps(Every(4)) == [4, 8, 10]
    # The last step is due whether or not it is a multiple
    assert due_steps(Every(5)) == [5, 10]


def test_the_saver_is_due_at_every_n_steps_and_the_last(tmp_path):
    assert due_steps(Saver(tmp_path, CPU1, keep_last=2, asynchronous=False, every=3)) == [
        3,
        6,
        9,
        10,
    ]
    # checkpoint.every_n_steps=0: only the last step (and, in the loop, each new best)
    assert due_steps(Saver(tmp_path, CPU1, keep_last=2, asynchronous=False)) == [10]
    # A run that stops early: its step is the last, whatever the period
    assert Saver(tmp_path, CPU1, keep_last=2, asynchronous=False, every=3).due(7, last=True)


def test_the_metrics_log_is_due_at_every_log_step_and_the_last():
    metrics_log = MetricsLog(CPU1, total_steps=10, start=0, every=4)
    try:
        assert due_steps(metrics_log) == [4, 8, 10]
    finally:
        metrics_log.close()


def test_the_run_and_its_learner_are_built_with_keywords_only():
    with pytest.raises(TypeError, match="positional"):
        Training(*[None] * len(dataclasses.fields(Training)))
    with pytest.raises(TypeError, match="positional"):
        Learner(*[None] * len(dataclasses.fields(Learner)))
