"""What each configuration of the launch table (tests/launches.py) claims, checked on its launch.

DDP's averaging and micro-batch accumulation give the 1-process update; FSDP2 shards hold different
slices and resume on another world size; HSDP (dp_replicate x dp_shard), pipeline parallelism (alone
and with data-parallel copies) and tensor parallelism agree with DDP at the same global batch and
consolidate to DDP's layout; pipeline and tensor-parallel runs go through every stage to a served
model; a kill -9 under HSDP resumes to byte-identical weights; bf16 autocast keeps fp32's accuracy;
a model with dict inputs resumes bit-exactly under bf16 and accumulation.

Elsewhere: a kill -9 under DDP, FSDP2, tensor and pipeline parallelism with dropout on
(test_exact_resume); fault handling that is not a configuration, such as crashes mid-save, SIGTERM
or a rank killed without restarts (test_checkpoints, test_train, test_run_directories,
test_streamed_data); refusals before anything starts (test_parallel_mesh)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import mlflow_client, model_from_checkpoint, run_cli, run_lineage
from launches import LAUNCHES
from safetensors.torch import load_file

from pipeline import checkpoint, consolidate
from serving import lineage
from serving.lineage import file_sha256

pytestmark = pytest.mark.slow


def assert_equal_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), (
            f"{key} differs: max |diff| {(a[key].double() - b[key].double()).abs().max()}"
        )


def assert_close_weights(a: dict, b: dict, atol: float, rtol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(
            a[key], b[key], atol=atol, rtol=rtol, msg=lambda m: f"{key}: {m}"
        )


def assert_agrees_with_ddp(
    launched, name: str, ddp: str, experiment: str, steps: int, adam_lr: float | None = None
) -> None:
    """Run `name`'s losses equal those of run `ddp` (the same global batches: the order is
    world-size-free) up to the order of float sums, and its weights have DDP's keys, shapes and
    (nearly) values. Under Adam (`adam_lr`), a weight moves by about the learning rate whatever its
    gradient's size, so a gradient near zero that sums to the other sign in another order moves it
    the other way: there, at most 1% of a tensor's elements may differ by more than 1e-4, and none
    by more than two steps."""
    a, b = launched.losses(ddp, experiment), launched.losses(name, experiment)
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), step
    mine, theirs = launched.weights(name), launched.weights(ddp)
    assert {k: v.shape for k, v in mine.items()} == {k: v.shape for k, v in theirs.items()}
    for key in mine:
        if adam_lr is None:
            torch.testing.assert_close(mine[key], theirs[key], atol=1e-5, rtol=1e-4)
            continue
        diff = (mine[key] - theirs[key]).abs()
        assert diff.max() <= 2 * adam_lr and (diff > 1e-4).float().mean() <= 0.01, (
            key,
            diff.max(),
            (diff > 1e-4).sum(),
        )


def assert_consolidates_to_the_trained_model(launched, name: str, tmp: Path) -> None:
    """Consolidation of the row's newest checkpoint (every shard, resharded into one model) gives
    the weights training resumes, under the model's own names: DDP's layout."""
    ckpt = checkpoint.latest(launched.workdir / "outputs" / name / "checkpoints")
    weights = load_file(str(consolidate.main(ckpt, output=tmp, log_to_mlflow=False)))
    assert_equal_weights(weights, model_from_checkpoint(ckpt).state_dict())


def assert_resumed_after_the_kill(proc, rank: int, resumed_from: str = "step_00000006") -> None:
    assert (
        f"SIGKILL to rank {rank} at step 9" in proc.stderr and "torchrun restart 1" in proc.stderr
    )
    assert "resumed from" in proc.stderr and resumed_from in proc.stderr, proc.stderr[-3000:]


def assert_every_stage_served(proc) -> None:
    """`pipeline run --serve-check` went through: the server's answer was the PyTorch model's."""
    assert "the server's answer equals the PyTorch model's" in proc.stdout, proc.stdout[-2000:]


def chunks(ckpt: Path, key: str) -> list:
    metadata = torch.distributed.checkpoint.FileSystemReader(str(ckpt)).read_metadata()
    return metadata.state_dict_metadata[key].chunks


def ddp_over_micro_batches_is_one_process(launched, tmp_path):
    one, two = launched("one").weights("one"), launched("ddp_accum").weights("ddp_accum")
    assert_close_weights(one, two, atol=2e-6, rtol=1e-5)
    # And the comparison can fail: the model before training is not close.
    from pipeline.components.build import ModelSpec, instantiate_model

    ckpt = checkpoint.latest(launched("one").workdir / "outputs/one/checkpoints")
    untrained = instantiate_model(ModelSpec(**checkpoint.read_meta(ckpt)["model"])).state_dict()
    assert not torch.allclose(one["head.weight"], untrained["head.weight"])


def one_process_reference(launched, tmp_path):
    run = launched("one").run("one", "tiny")
    # tests/configs/tiny.yaml logs every 2nd step.
    assert run.info.status == "FINISHED" and sorted(launched("one").losses("one", "tiny")) == [
        2,
        4,
        6,
        8,
    ]


def two_micro_batches_are_one_double_batch(launched, tmp_path):
    assert_close_weights(
        launched("one").weights("one"),
        launched("accum").weights("accum"),
        atol=2e-6,
        rtol=1e-5,
    )


def same_seed_same_losses_bit_for_bit(launched, tmp_path):
    assert_equal_weights(launched("one").weights("one"), launched("one_again").weights("one_again"))
    assert launched("one").losses("one", "tiny") == launched("one_again").losses(
        "one_again", "tiny"
    )


def ddp_checkpoint_resumes_on_one_process(launched, tmp_path):
    # The same global batches, so equal up to the order of floating-point sums.
    source = launched("ddp_accum")
    assert "at step 4" in launched("ddp_on_one").proc.stderr
    assert_close_weights(
        source.weights("ddp_accum"), source.weights("ddp_on_one"), atol=2e-6, rtol=1e-5
    )


def transformer_reference(launched, tmp_path):
    ran = launched("ddp")
    run = ran.run("ddp", "trainserve-digit-sequences")
    assert run.info.status == "FINISHED" and run.data.tags[lineage.SETUP].startswith("2 x cpu, ddp")
    assert sorted(ran.losses("ddp", "trainserve-digit-sequences")) == list(range(1, 21))


def hsdp_agrees_with_ddp_and_consolidates_to_its_layout(launched, tmp_path):
    ran = launched("hsdp")
    assert (
        "device mesh: 1 pipeline stages x 2 replicas x 2 shards x 1 tensor-parallel (HSDP)"
        in ran.proc.stderr
    )
    # DCP keeps one copy of what the replicas share: each tensor's chunks are the 2 shards, not 4.
    ckpt = checkpoint.latest(ran.workdir / "outputs/hsdp/checkpoints")
    assert len(chunks(ckpt, "model.head.weight")) == 2
    assert_agrees_with_ddp(ran, "hsdp", "ddp", "trainserve-digit-sequences", 20, adam_lr=3e-3)
    assert_consolidates_to_the_trained_model(ran, "hsdp", tmp_path / "consolidated")


def kill_9_under_hsdp_resumes_byte_identical(launched, tmp_path):
    ran = launched("hsdp_killed")
    assert_resumed_after_the_kill(ran.proc, 3)
    assert_equal_weights(ran.weights("hsdp"), ran.weights("hsdp_killed"))


def pipeline_parallel_agrees_with_ddp_through_every_stage(launched, tmp_path):
    ran = launched("pp")
    assert "pipeline stage 2 of 2: from encoder.layers.1" in ran.proc.stderr
    assert "1f1b schedule, 4 micro-batches of 16 rows" in ran.proc.stderr
    assert_every_stage_served(ran.proc)
    client = mlflow_client(ran.workdir)
    versions = client.search_model_versions("name = 'digit-sequences'")
    run = client.get_run(
        next(v.run_id for v in versions if client.get_run(v.run_id).info.run_name == "pp")
    )
    # The mesh, in the runs list of the UI.
    assert run.data.tags[lineage.SETUP] == "2 x cpu, ddp, pp 2, fp32"
    # Each stage wrote its own layers; DCP's index holds the whole model under the model's own
    # names.
    ckpt = checkpoint.latest(ran.workdir / "outputs/pp/checkpoints")
    stored = (
        torch.distributed.checkpoint.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    )
    assert {
        "model.embed.weight",
        "model.encoder.layers.1.linear1.weight",
        "model.head.bias",
    } <= set(stored)
    assert_agrees_with_ddp(ran, "pp", "ddp", "trainserve-digit-sequences", 20, adam_lr=3e-3)
    # Evaluation went through the stages too (padded to the traced batch): the same accuracy as
    # DDP's.
    accuracy = {
        name: ran.run(name, "trainserve-digit-sequences").data.metrics["val/accuracy"]
        for name in ("pp", "ddp")
    }
    assert accuracy["pp"] == pytest.approx(accuracy["ddp"], abs=1e-3)


def pipeline_checkpoint_resumes_under_ddp_where_it_stopped(launched, tmp_path):
    """Elastic: pp=2's step-12 checkpoint (each stage's shard, 1 data-parallel rank) resumed by 2
    DDP ranks that deal the data over 2: each stage's keys found, and steps 13-20 are those of the
    uninterrupted DDP run. (The resume continues the checkpoint's MLflow run, which then holds steps
    13-20 twice: pp's and DDP's.)"""
    ran = launched("pp_then_ddp")
    assert "at step 12" in ran.proc.stderr
    run = ran.run("pp", "trainserve-digit-sequences")
    logged = mlflow_client(ran.workdir).get_metric_history(run.info.run_id, "train/loss")
    ddp = ran.losses("ddp", "trainserve-digit-sequences")
    steps = [m.step for m in logged]
    assert set(steps) == set(range(1, 21)) and all(steps.count(step) >= 2 for step in range(13, 21))
    for m in logged:
        assert m.value == pytest.approx(ddp[m.step], rel=1e-5, abs=1e-6), m.step


def pipeline_stages_with_ddp_over_their_copies_agree_with_ddp(launched, tmp_path):
    """pp=2 x 2 data-parallel ranks: each stage DDP over its 2 copies (the replica check compares
    them every 5 steps), the data dealt over the 2 data-parallel ranks."""
    ran = launched("pp_dp")
    assert (
        "device mesh: 2 pipeline stages x 1 replicas x 2 shards x 1 tensor-parallel"
        in ran.proc.stderr
    )
    assert "1f1b schedule, 4 micro-batches of 8 rows" in ran.proc.stderr
    assert_agrees_with_ddp(ran, "pp_dp", "ddp", "trainserve-digit-sequences", 20, adam_lr=3e-3)


def fsdp_shards_hold_different_slices_and_consolidate_into_the_run(launched, tmp_path):
    ran = launched("fsdp")
    assert "FSDP2 units: 2 x TransformerEncoderLayer, and the root" in ran.proc.stderr
    ckpt6 = ran.workdir / "outputs/fsdp/checkpoints/step_00000006"
    metadata = torch.distributed.checkpoint.FileSystemReader(str(ckpt6)).read_metadata()
    key = "model.encoder.layers.0.linear1.weight"
    parts = metadata.state_dict_metadata[key].chunks
    # Two ranks, two slices of a layer's weight, in the two ranks' files.
    assert len(parts) == 2 and parts[0].offsets != parts[1].offsets
    files = {info.relative_path for idx, info in metadata.storage_data.items() if idx.fqn == key}
    assert files == {"__0_0.distcp", "__1_0.distcp"}

    # `pipeline consolidate` of the run directory: the weights training resumes, logged to the same
    # run.
    run_dir = ran.workdir / "outputs/fsdp"
    proc = run_cli(["consolidate", str(run_dir), "--latest"], cwd=ran.workdir)
    weights = Path(proc.stdout.strip().splitlines()[-1])
    assert weights == run_dir.resolve() / "consolidated" / "model.safetensors"
    got = load_file(str(weights))
    assert_equal_weights(got, ran.weights("fsdp"))
    run = ran.run("fsdp", "trainserve-digit-sequences")
    client = mlflow_client(ran.workdir)
    meta = json.loads((weights.parent / "model.json").read_text())
    assert (
        meta["source"]["mlflow_run_id"] == run.info.run_id and meta["source"]["strategy"] == "fsdp"
    )
    assert (
        run_lineage(run.info.run_id, client)["consolidated"]["sha256"]
        == meta["sha256"]
        == file_sha256(weights)
    )
    run = client.get_run(run.info.run_id)
    assert lineage.read_stages(run.data.tags[lineage.STAGES])["consolidate"] == "done"
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id, "consolidated")) == [
        "consolidated/model.json",
        "consolidated/model.safetensors",
    ]


def fsdp_resumes_on_another_world_size(launched, tmp_path):
    ran = launched("fsdp_on_one")
    assert "at step 6" in ran.proc.stderr
    # The same global batches; sums in another order.
    assert_close_weights(ran.weights("fsdp"), ran.weights("fsdp_on_one"), atol=1e-5, rtol=1e-4)


def bert_reference(launched, tmp_path):
    ran = launched("bert")
    assert sorted(ran.losses("bert", "trainserve-digit-sequences")) == list(range(1, 17))


def tensor_parallel_agrees_with_ddp_through_every_stage(launched, tmp_path):
    ran = launched("tp")
    assert (
        "tensor parallel over 2 ranks: 12 projections split (BERT-style encoder (Hugging Face))"
        in ran.proc.stderr
    )
    assert_every_stage_served(ran.proc)
    version = mlflow_client(ran.workdir).get_model_version_by_alias(
        "digit-sequences-bert", "champion"
    )
    assert version.run_id == ran.run("tp", "trainserve-digit-sequences").info.run_id
    # DCP holds each split projection as 2 slices; consolidation made it whole, in DDP's layout.
    ckpt = checkpoint.latest(ran.workdir / "outputs/tp/checkpoints")
    metadata = torch.distributed.checkpoint.FileSystemReader(str(ckpt)).read_metadata()
    query = next(
        k for k in metadata.state_dict_metadata if k.endswith("layer.0.attention.self.query.weight")
    )
    assert len(metadata.state_dict_metadata[query].chunks) == 2
    assert_agrees_with_ddp(ran, "tp", "bert", "trainserve-digit-sequences", 16)


def bf16_on_cpu_reaches_fp32_accuracy(launched, tmp_path):
    accuracy = {
        precision: launched(precision).run(precision, "tiny").data.metrics["val/accuracy"]
        for precision in ("fp32", "bf16")
    }
    assert launched("bf16").run("bf16", "tiny").data.tags[lineage.SETUP].endswith(", bf16")
    assert accuracy["fp32"] >= 0.9, accuracy
    # The stated margin: bf16 autocast may cost at most 3 points of validation accuracy.
    assert accuracy["bf16"] >= accuracy["fp32"] - 0.03, accuracy


def fp32_reference(launched, tmp_path):
    run = launched("fp32").run("fp32", "tiny")
    assert run.data.tags[lineage.SETUP].endswith(", fp32") and run.info.status == "FINISHED"


def dict_inputs_resume_bit_exactly_after_kill_9(launched, tmp_path):
    ran = launched("mixed_killed")
    assert_resumed_after_the_kill(ran.proc, 1)
    straight, killed = ran.weights("mixed"), ran.weights("mixed_killed")
    assert "embed.weight" in straight
    assert_equal_weights(straight, killed)


def dict_inputs_reference(launched, tmp_path):
    run = launched("mixed").run("mixed", "trainserve-diabetes")
    assert run.info.status == "FINISHED" and run.data.tags[lineage.SETUP].endswith(", bf16")


# What each row claims, by its name in the table.
CLAIMS = {
    "one": one_process_reference,
    "ddp_accum": ddp_over_micro_batches_is_one_process,
    "accum": two_micro_batches_are_one_double_batch,
    "one_again": same_seed_same_losses_bit_for_bit,
    "ddp_on_one": ddp_checkpoint_resumes_on_one_process,
    "fsdp": fsdp_shards_hold_different_slices_and_consolidate_into_the_run,
    "fsdp_on_one": fsdp_resumes_on_another_world_size,
    "ddp": transformer_reference,
    "hsdp": hsdp_agrees_with_ddp_and_consolidates_to_its_layout,
    "hsdp_killed": kill_9_under_hsdp_resumes_byte_identical,
    "pp": pipeline_parallel_agrees_with_ddp_through_every_stage,
    "pp_then_ddp": pipeline_checkpoint_resumes_under_ddp_where_it_stopped,
    "pp_dp": pipeline_stages_with_ddp_over_their_copies_agree_with_ddp,
    "bert": bert_reference,
    "tp": tensor_parallel_agrees_with_ddp_through_every_stage,
    "fp32": fp32_reference,
    "bf16": bf16_on_cpu_reaches_fp32_accuracy,
    "mixed": dict_inputs_reference,
    "mixed_killed": dict_inputs_resume_bit_exactly_after_kill_9,
}


def test_every_row_claims_something():
    assert set(CLAIMS) == set(LAUNCHES)


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_the_configuration_launches_and_does_what_it_claims(name, launched, tmp_path):
    CLAIMS[name](launched, tmp_path)
