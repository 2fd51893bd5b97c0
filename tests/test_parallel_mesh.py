"""train.parallel: the device mesh's degrees. HSDP (FSDP2 on a 2-D mesh, dp_replicate x dp_shard) through real
torchrun launches of 4 processes: the losses agree with DDP's at the same global batch, a kill -9 resumes to
byte-identical weights, and consolidation gives the layout a DDP run's has. Tensor and pipeline degrees are
refused with the reason until they are built."""

from __future__ import annotations

import pytest
import torch

from pipeline import checkpoint
from pipeline.config import ConfigError, check_runtime, load_config

from conftest import TINY, mlflow_client, model_from_checkpoint, run_cli

STEPS = ["train.max_steps=16", "checkpoint.every_n_steps=6", "checkpoint.keep_last=3", "train.log_every=1",
         "train.eval_every=0", "model.name=mlp", "model.args={hidden: [64]}"]
HSDP = ["train.strategy=fsdp", "train.parallel.dp_replicate=2", "train.parallel.dp_shard=2"]


def torchrun(workdir, nproc, args, env=None, max_restarts=0):
    return run_cli(["train", "--config", str(TINY), "--nproc-per-node", str(nproc), f"--max-restarts={max_restarts}",
                    *STEPS, *args], cwd=workdir, env=env, timeout=600)


def losses(workdir, name):
    client = mlflow_client(workdir)
    run = client.search_runs([client.get_experiment_by_name("tiny").experiment_id],
                             filter_string=f"attributes.run_name = '{name}'")[0]
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}


def weights(workdir, name):
    return model_from_checkpoint(checkpoint.latest(workdir / "outputs" / name / "checkpoints")).state_dict()


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("hsdp")
    proc = torchrun(workdir, 4, [*HSDP, "train.run_name=hsdp"])
    assert "HSDP: 2 replicas x 2 shards" in proc.stderr
    return workdir


@pytest.mark.slow
def test_hsdp_2x2_agrees_with_ddp_and_consolidates_to_its_layout(hsdp):
    torchrun(hsdp, 2, ["train.run_name=ddp"])
    a, b = losses(hsdp, "ddp"), losses(hsdp, "hsdp")
    assert sorted(a) == sorted(b) == list(range(1, 17))
    for step in a:  # the same global batches (world-size-free order): equal up to the order of float sums
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), step
    # DCP keeps one copy of what the replicas share: each tensor's chunks are the 2 shards, not 4.
    ckpt = checkpoint.latest(hsdp / "outputs" / "hsdp" / "checkpoints")
    metadata = torch.distributed.checkpoint.FileSystemReader(str(ckpt)).read_metadata()
    assert len(metadata.state_dict_metadata["model.body.0.weight"].chunks) == 2
    consolidated = run_cli(["consolidate", str(hsdp / "outputs" / "hsdp")], cwd=hsdp)
    assert "consolidated 6 tensors" in consolidated.stderr
    mine, ddp = weights(hsdp, "hsdp"), weights(hsdp, "ddp")
    assert {k: v.shape for k, v in mine.items()} == {k: v.shape for k, v in ddp.items()}
    for key in mine:
        torch.testing.assert_close(mine[key], ddp[key], atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_a_kill_9_under_hsdp_resumes_to_byte_identical_weights(hsdp):
    proc = torchrun(hsdp, 4, [*HSDP, "train.run_name=hsdp_killed"], env={"TRAINSERVE_FAULT": "step:9:3"},
                    max_restarts=1)
    assert "SIGKILL to rank 3 at step 9" in proc.stderr and "torchrun restart 1" in proc.stderr
    assert "step_00000006" in proc.stderr
    a, b = weights(hsdp, "hsdp"), weights(hsdp, "hsdp_killed")
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("overrides, world, message", [
    (["train.parallel.tp=2"], 2, "train.parallel.tp=2: tensor parallelism is not built yet"),
    (["train.parallel.pp=2"], 2, "train.parallel.pp=2: pipeline parallelism is not built yet"),
    (["train.parallel.dp_replicate=2"], 4, "that is HSDP, set train.strategy=fsdp"),
    (["train.strategy=fsdp", "train.parallel.dp_replicate=2", "train.parallel.dp_shard=2"], 2,
     "dp_replicate 2 x dp_shard 2 x tp 1 x pp 1 = 4, but the world has 2 processes"),
    (["train.strategy=fsdp", "train.parallel.dp_replicate=3"], 4, "the world has 4 processes"),
])
def test_a_mesh_that_does_not_fit_the_world_is_named_before_anything_starts(overrides, world, message):
    cfg = load_config(str(TINY), overrides)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_runtime(cfg, world, cuda_available=False)
