"""train.parallel: the device mesh's degrees, through real torchrun launches. HSDP (FSDP2 on a 2-D mesh,
dp_replicate x dp_shard) on 4 processes and pipeline parallelism (pp=2) on the transformer example, tensor
parallelism (tp=2) on the BERT example: the losses agree with DDP's at the same global batch, a kill -9 resumes
to byte-identical weights, consolidation gives the layout a DDP run's has, and the pipeline and tensor-parallel
runs go on through export, the registry and the server. What does not combine yet is refused with the reason."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO, TINY, mlflow_client, model_from_checkpoint, run_cli

from pipeline import checkpoint
from pipeline.config import ConfigError, check_runtime, load_config
from serving import lineage

STEPS = [
    "train.max_steps=16",
    "checkpoint.every_n_steps=6",
    "checkpoint.keep_last=3",
    "train.log_every=1",
    "train.eval_every=0",
    "model.name=mlp",
    "model.args={hidden: [64]}",
]
HSDP = ["train.strategy=fsdp", "train.parallel.dp_replicate=2", "train.parallel.dp_shard=2"]
TRANSFORMER = str(REPO / "configs/digit_sequences_transformer.yaml")
ON_PATH = {"PYTHONPATH": str(REPO)}  # the examples' package
# 20 steps, every one logged; a checkpoint every 6 (a kill at step 9 resumes from step 6); gradients clipped (the
# norm spans every shard and stage).
TRANSFORMER_STEPS = [
    "train.max_steps=20",
    "checkpoint.every_n_steps=6",
    "checkpoint.keep_last=3",
    "train.log_every=1",
    "train.eval_every=10",
    "train.clip_grad_norm=1.0",
    "tracking.system_metrics=false",
]


def torchrun(workdir, nproc, args, env=None, max_restarts=0):
    return run_cli(
        [
            "train",
            "--config",
            str(TINY),
            "--nproc-per-node",
            str(nproc),
            f"--max-restarts={max_restarts}",
            *STEPS,
            *args,
        ],
        cwd=workdir,
        env=env,
        timeout=600,
    )


def train_transformer(workdir, nproc, args, env=None, max_restarts=0):
    return run_cli(
        [
            "train",
            "--config",
            TRANSFORMER,
            "--nproc-per-node",
            str(nproc),
            f"--max-restarts={max_restarts}",
            *TRANSFORMER_STEPS,
            *args,
        ],
        cwd=workdir,
        env={**ON_PATH, **(env or {})},
        timeout=600,
    )


def losses(workdir, name, experiment="tiny"):
    client = mlflow_client(workdir)
    run = client.search_runs(
        [client.get_experiment_by_name(experiment).experiment_id],
        filter_string=f"attributes.run_name = '{name}'",
    )[0]
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}


def assert_agrees_with_ddp(
    workdir, name: str, experiment: str, steps: int = 16, adam_lr: float | None = None
) -> None:
    """Run `name`'s losses equal those of run "ddp" (the same global batches: the order is world-size-free) up to
    the order of float sums, and its consolidated-layout weights have DDP's keys, shapes and (nearly) values.
    Under Adam (`adam_lr`), a weight moves by about the learning rate whatever its gradient's size, so a gradient
    near zero that sums to the other sign in another order moves it the other way: there, at most 1% of a
    tensor's elements may differ by more than 1e-4, and none by more than two steps."""
    a, b = losses(workdir, "ddp", experiment), losses(workdir, name, experiment)
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), step
    mine, ddp = weights(workdir, name), weights(workdir, "ddp")
    assert {k: v.shape for k, v in mine.items()} == {k: v.shape for k, v in ddp.items()}
    for key in mine:
        if adam_lr is None:
            torch.testing.assert_close(mine[key], ddp[key], atol=1e-5, rtol=1e-4)
            continue
        diff = (mine[key] - ddp[key]).abs()
        assert diff.max() <= 2 * adam_lr and (diff > 1e-4).float().mean() <= 0.01, (
            key,
            diff.max(),
            (diff > 1e-4).sum(),
        )


def assert_same_weights(workdir, a: str, b: str) -> None:
    mine, theirs = weights(workdir, a), weights(workdir, b)
    assert mine.keys() == theirs.keys()
    for key in mine:
        assert torch.equal(mine[key], theirs[key]), key


def run_every_stage(workdir, config: str, overrides: list[str], nproc: int = 2):
    """`pipeline run --serve-check` on `nproc` processes. A few steps leave the model near chance: it is registered (the
    override allows it) and --serve-check exits 1 saying so, after the server's answer was checked against the
    PyTorch model's as usual."""
    proc = run_cli(
        [
            "run",
            "--config",
            config,
            "--nproc-per-node",
            str(nproc),
            "--serve-check",
            "serve.port=0",
            "export.allow_below_baseline=true",
            *overrides,
        ],
        cwd=workdir,
        env=ON_PATH,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0 or (
        proc.returncode == 1 and "failed its baseline gate" in proc.stderr
    ), proc.stderr[-4000:]
    return proc


def weights(workdir, name):
    return model_from_checkpoint(
        checkpoint.latest(workdir / "outputs" / name / "checkpoints")
    ).state_dict()


@pytest.fixture(scope="module")
def transformer(tmp_path_factory):
    """A working directory with run "ddp": the transformer example on 2 DDP ranks, what each mesh is compared with."""
    workdir = tmp_path_factory.mktemp("meshes")
    train_transformer(workdir, 2, ["train.run_name=ddp"])
    return workdir


@pytest.fixture(scope="module")
def hsdp(transformer):
    """`pipeline run` of the transformer example on HSDP 2 x 2: train, consolidate, export, register, serve-check."""
    proc = run_every_stage(
        transformer, TRANSFORMER, [*HSDP, "train.run_name=hsdp", *TRANSFORMER_STEPS], nproc=4
    )
    assert (
        "device mesh: 1 pipeline stages x 2 replicas x 2 shards x 1 tensor-parallel (HSDP)"
        in proc.stderr
    )
    assert "the server's answer equals the PyTorch model's" in proc.stdout, proc.stdout[-2000:]
    return transformer


@pytest.mark.slow
def test_hsdp_2x2_agrees_with_ddp_and_consolidates_to_its_layout(hsdp):
    # DCP keeps one copy of what the replicas share: each tensor's chunks are the 2 shards, not 4.
    ckpt = checkpoint.latest(hsdp / "outputs" / "hsdp" / "checkpoints")
    metadata = torch.distributed.checkpoint.FileSystemReader(str(ckpt)).read_metadata()
    assert len(metadata.state_dict_metadata["model.head.weight"].chunks) == 2
    assert_agrees_with_ddp(hsdp, "hsdp", "trainserve-digit-sequences", steps=20, adam_lr=3e-3)


@pytest.mark.slow
def test_a_kill_9_under_hsdp_resumes_to_byte_identical_weights(hsdp):
    proc = train_transformer(
        hsdp,
        4,
        [*HSDP, "train.run_name=hsdp_killed"],
        env={"TRAINSERVE_FAULT": "step:9:3"},
        max_restarts=1,
    )
    assert "SIGKILL to rank 3 at step 9" in proc.stderr and "torchrun restart 1" in proc.stderr
    assert "step_00000006" in proc.stderr
    assert_same_weights(hsdp, "hsdp", "hsdp_killed")


@pytest.fixture(scope="module")
def pipeline_run(transformer):
    """`pipeline run` of the transformer example cut into 2 stages: train, consolidate, export, register and
    --serve-check."""
    return transformer, run_every_stage(
        transformer, TRANSFORMER, ["train.parallel.pp=2", "train.run_name=pp", *TRANSFORMER_STEPS]
    )


@pytest.mark.slow
def test_pipeline_parallel_transformer_agrees_with_ddp_and_goes_through_every_stage(pipeline_run):
    workdir, proc = pipeline_run
    assert "pipeline stage 2 of 2: from encoder.layers.1" in proc.stderr
    assert "1f1b schedule, 4 micro-batches of 16 rows" in proc.stderr
    assert "the server's answer equals the PyTorch model's" in proc.stdout, proc.stdout[-2000:]
    client = mlflow_client(workdir)
    versions = client.search_model_versions("name = 'digit-sequences'")
    run = client.get_run(
        next(v.run_id for v in versions if client.get_run(v.run_id).info.run_name == "pp")
    )
    assert (
        run.data.tags[lineage.SETUP] == "2 x cpu, ddp, pp 2, fp32"
    )  # the mesh, in the runs list of the UI
    # Each stage wrote its own layers; DCP's index holds the whole model under the model's own names.
    ckpt = checkpoint.latest(workdir / "outputs" / "pp" / "checkpoints")
    stored = (
        torch.distributed.checkpoint.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    )
    assert {
        "model.embed.weight",
        "model.encoder.layers.1.linear1.weight",
        "model.head.bias",
    } <= set(stored)
    assert_agrees_with_ddp(workdir, "pp", "trainserve-digit-sequences", steps=20, adam_lr=3e-3)
    # Evaluation went through the stages too (padded to the traced batch): the same accuracy as DDP's model.
    client = mlflow_client(workdir)
    accuracy = {
        name: client.search_runs(
            [client.get_experiment_by_name("trainserve-digit-sequences").experiment_id],
            filter_string=f"attributes.run_name = '{name}'",
        )[0].data.metrics["val/accuracy"]
        for name in ("pp", "ddp")
    }
    assert accuracy["pp"] == pytest.approx(accuracy["ddp"], abs=1e-3)


@pytest.mark.slow
def test_a_kill_9_under_pipeline_parallelism_resumes_to_byte_identical_weights(pipeline_run):
    workdir, _ = pipeline_run
    proc = train_transformer(
        workdir,
        2,
        ["train.parallel.pp=2", "train.run_name=pp_killed"],
        env={"TRAINSERVE_FAULT": "step:9:1"},
        max_restarts=1,
    )
    assert "SIGKILL to rank 1 at step 9" in proc.stderr and "torchrun restart 1" in proc.stderr
    assert_same_weights(workdir, "pp", "pp_killed")


@pytest.mark.slow
def test_a_pipeline_checkpoint_resumes_under_ddp_at_the_sample_where_it_stopped(pipeline_run):
    """Elastic: pp=2's step-12 checkpoint (each stage's shard, 1 data-parallel rank) resumed by 2 DDP ranks that
    deal the data over 2: each stage's keys found, and steps 13-20 are those of the uninterrupted DDP run. (The
    resume continues the checkpoint's MLflow run, which then holds steps 13-20 twice: pp's and DDP's.)"""
    workdir, _ = pipeline_run
    step_12 = workdir / "outputs" / "pp" / "checkpoints" / "step_00000012"
    proc = train_transformer(workdir, 2, ["--resume", str(step_12), "train.run_name=pp_then_ddp"])
    assert "at step 12" in proc.stderr
    client = mlflow_client(workdir)
    run = client.search_runs(
        [client.get_experiment_by_name("trainserve-digit-sequences").experiment_id],
        filter_string="attributes.run_name = 'pp'",
    )[0]
    logged = client.get_metric_history(run.info.run_id, "train/loss")
    ddp = losses(workdir, "ddp", "trainserve-digit-sequences")
    steps = [m.step for m in logged]
    assert set(steps) == set(range(1, 21)) and all(steps.count(step) >= 2 for step in range(13, 21))
    for m in logged:
        assert m.value == pytest.approx(ddp[m.step], rel=1e-5, abs=1e-6), m.step


@pytest.mark.slow
def test_pipeline_stages_with_ddp_over_their_copies_agree_with_ddp(transformer):
    """pp=2 x 2 data-parallel ranks: each stage DDP over its 2 copies (the replica check compares them every 5
    steps), the data dealt over the 2 data-parallel ranks."""
    proc = train_transformer(
        transformer, 4, ["train.parallel.pp=2", "train.consistency_every=5", "train.run_name=pp_dp"]
    )
    assert (
        "device mesh: 2 pipeline stages x 1 replicas x 2 shards x 1 tensor-parallel" in proc.stderr
    )
    assert "1f1b schedule, 4 micro-batches of 8 rows" in proc.stderr
    assert_agrees_with_ddp(
        transformer, "pp_dp", "trainserve-digit-sequences", steps=20, adam_lr=3e-3
    )


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (
            ["train.parallel.tp=2", "train.parallel.dp_shard=2"],
            4,
            "beside 2 data-parallel ranks needs train.strategy=fsdp",
        ),
        (
            ["train.strategy=fsdp", "train.parallel.tp=2", "train.global_batch_size=33"],
            4,
            "must divide by the data-parallel ranks (2 = world size 4 / tp 2 / pp 1)",
        ),
        (
            ["train.parallel.pp=2", "train.parallel.tp=2"],
            4,
            "train.parallel.pp=2 with train.parallel.tp: not built yet",
        ),
        (
            ["train.parallel.pp=2", "train.strategy=fsdp"],
            4,
            "with train.strategy=fsdp beside data-parallel ranks",
        ),
        (
            ["train.parallel.pp=2", "train.global_batch_size=34"],
            2,
            "each rank's batch of 34 rows (global_batch_size 34 / 1 data-parallel rank(s) / grad_accum_steps 1) does not "
            "split into 4 equal micro-batches",
        ),
        (
            ["train.parallel.pp=4", "train.parallel.pp_microbatches=2"],
            4,
            "1f1b needs at least as many micro-batches",
        ),
        (
            ["train.parallel.tp=2", "train.compile=true"],
            2,
            "compiling a tensor-parallel model is not built yet",
        ),
        (["train.parallel.dp_replicate=2"], 4, "that is HSDP, set train.strategy=fsdp"),
        (
            ["train.strategy=fsdp", "train.parallel.dp_replicate=2", "train.parallel.dp_shard=2"],
            2,
            "dp_replicate 2 x dp_shard 2 x tp 1 x pp 1 = 4, but the world has 2 processes",
        ),
        (["train.strategy=fsdp", "train.parallel.dp_replicate=3"], 4, "the world has 4 processes"),
    ],
)
def test_a_mesh_that_does_not_fit_the_world_is_named_before_anything_starts(
    overrides, world, message
):
    cfg = load_config(str(TINY), overrides)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_runtime(cfg, world, cuda_available=False)


BERT = str(REPO / "configs/digit_sequences_bert.yaml")
# Dropout off: DDP's ranks and a tensor-parallel group draw their masks on other shapes, and the losses are
# compared step by step.
BERT_STEPS = [
    "train.max_steps=16",
    "checkpoint.every_n_steps=6",
    "train.log_every=1",
    "train.eval_every=0",
    "model.args.hidden_dropout_prob=0",
    "model.args.attention_probs_dropout_prob=0",
    "tracking.system_metrics=false",
]


@pytest.fixture(scope="module")
def tensor_parallel_run(tmp_path_factory):
    """`pipeline run` of the BERT example with its projections split over 2 ranks: train, consolidate, export,
    register and --serve-check."""
    workdir = tmp_path_factory.mktemp("tp")
    return workdir, run_every_stage(
        workdir, BERT, ["train.parallel.tp=2", "train.run_name=tp", *BERT_STEPS]
    )


@pytest.mark.slow
def test_tensor_parallel_bert_agrees_with_ddp_and_goes_through_every_stage(tensor_parallel_run):
    workdir, proc = tensor_parallel_run
    assert (
        "tensor parallel over 2 ranks: 12 projections split (BERT-style encoder (Hugging Face))"
        in proc.stderr
    )
    assert "the server's answer equals the PyTorch model's" in proc.stdout, proc.stdout[-2000:]
    version = mlflow_client(workdir).get_model_version_by_alias("digit-sequences-bert", "champion")
    assert version.run_id
    # DCP holds each split projection as 2 slices; consolidation made it whole, in DDP's layout.
    ckpt = checkpoint.latest(workdir / "outputs" / "tp" / "checkpoints")
    metadata = torch.distributed.checkpoint.FileSystemReader(str(ckpt)).read_metadata()
    query = next(
        k for k in metadata.state_dict_metadata if k.endswith("layer.0.attention.self.query.weight")
    )
    assert len(metadata.state_dict_metadata[query].chunks) == 2

    run_cli(
        ["train", "--config", BERT, "--nproc-per-node", "2", "train.run_name=ddp", *BERT_STEPS],
        cwd=workdir,
        env=ON_PATH,
    )
    assert_agrees_with_ddp(workdir, "tp", "trainserve-digit-sequences")


@pytest.mark.slow
def test_a_kill_9_under_tensor_parallelism_resumes_to_byte_identical_weights(tensor_parallel_run):
    workdir, _ = tensor_parallel_run
    proc = run_cli(
        [
            "train",
            "--config",
            BERT,
            "--nproc-per-node",
            "2",
            "--max-restarts=1",
            "train.parallel.tp=2",
            "train.run_name=tp_killed",
            *BERT_STEPS,
        ],
        cwd=workdir,
        env={**ON_PATH, "TRAINSERVE_FAULT": "step:9:1"},
    )
    assert "SIGKILL to rank 1 at step 9" in proc.stderr and "torchrun restart 1" in proc.stderr
    a, b = weights(workdir, "tp"), weights(workdir, "tp_killed")
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_a_model_without_a_tensor_parallel_plan_is_refused_before_any_process_starts(tmp_path):
    proc = run_cli(
        [
            "train",
            "--config",
            str(TINY),
            "--nproc-per-node",
            "2",
            "train.parallel.tp=2",
            "train.global_batch_size=32",
            *STEPS,
        ],
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 2
    assert "train.parallel.tp=2: the model (MLP) has no tensor-parallel plan" in proc.stderr, (
        proc.stderr[-2000:]
    )
    assert "tensor_parallel_plan()" in proc.stderr and "[rank" not in proc.stderr


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["train.parallel.pp_split=[encoder.layers.7]"],
            "train.parallel.pp_split=['encoder.layers.7']: no module encoder.layers.7 in the model",
        ),
        (
            ["train.parallel.pp_split=[encoder.layers.1, head]"],
            "it names the 1 module(s) where stages 2..2 begin (pp=2)",
        ),
        (
            ["model.args.layers=1"],
            "train.parallel.pp=2: the model has 0 repeated block(s) (none found) to deal over 2 "
            "stages; name where stages begin with train.parallel.pp_split",
        ),
    ],
)
def test_split_points_that_the_model_lacks_are_refused_before_any_process_starts(
    tmp_path, overrides, message
):
    proc = run_cli(
        [
            "train",
            "--config",
            TRANSFORMER,
            "--nproc-per-node",
            "2",
            "train.parallel.pp=2",
            *overrides,
        ],
        cwd=tmp_path,
        env=ON_PATH,
        check=False,
    )
    assert proc.returncode == 2
    assert message in proc.stderr and "[rank" not in proc.stderr, proc.stderr[-2000:]


def test_a_models_own_plan_is_taken_and_checked():
    from torch import nn

    from pipeline.distributed.tensor_parallel import plan_for

    class Mine(nn.Module):
        def __init__(self, hidden=6):
            super().__init__()
            self.up, self.down = nn.Linear(4, hidden), nn.Linear(hidden, 4)

        def tensor_parallel_plan(self):
            return {"up": "colwise", "down": "rowwise"}

    assert plan_for(Mine(), 2) == (
        "Mine.tensor_parallel_plan()",
        {"up": "colwise", "down": "rowwise"},
    )
    with pytest.raises(
        ConfigError,
        match="'up' has 6 output features, which do not divide over train.parallel.tp=4",
    ):
        plan_for(Mine(), 4)


def test_heads_that_do_not_divide_over_the_tensor_parallel_ranks_are_refused():
    """BERT's projections divide over tp=8 (64 features, 8 each) but its 4 heads of 16 do not: each rank would hold
    half a head and fail inside the first forward's reshape."""
    import transformers

    from pipeline.distributed.tensor_parallel import plan_for

    model = transformers.BertForSequenceClassification(
        transformers.BertConfig(
            vocab_size=20,
            hidden_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=128,
        )
    )
    assert plan_for(model, 2)[0] == "BERT-style encoder (Hugging Face)"
    with pytest.raises(
        ConfigError,
        match=r"the model has 4 attention heads \(config.num_attention_heads\), which do "
        r"not divide over train.parallel.tp=8 ranks",
    ):
        plan_for(model, 8)


def tiny_bert():
    import transformers

    return transformers.BertForSequenceClassification(
        transformers.BertConfig(
            vocab_size=20,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
        )
    )


def test_traced_stages_hold_the_models_own_keys_and_no_more():
    """The tracer registers every buffer of a stage as persistent; BERT's position_ids is not, and a stage shard
    holding it would not consolidate (a key the model's manifest lacks)."""
    from pipeline.distributed.pipeline_parallel import trace

    model = tiny_bert()
    keys = set(model.state_dict())
    example = {
        "input_ids": torch.randint(0, 20, (4, 12)),
        "attention_mask": torch.ones(4, 12, dtype=torch.long),
    }
    traced, points, _ = trace(model, example, 2, [])
    assert points == ["bert.encoder.layer.1"]
    for pipe in traced.values():
        stages = [set(pipe.get_stage_module(i).state_dict()) for i in range(2)]
        assert stages[0] | stages[1] == keys and not stages[0] & stages[1]


def test_a_weight_two_stages_use_is_refused():
    from torch import nn

    from pipeline.distributed.pipeline_parallel import trace

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.blocks = nn.Sequential(*[nn.Linear(8, 8) for _ in range(2)])

        def forward(self, tokens):
            return (
                self.blocks(self.embed(tokens)) @ self.embed.weight.T
            )  # the head is the embedding

    with pytest.raises(
        ConfigError, match=r"embed.weight is used by more than one stage \(tied weights\)"
    ):
        trace(Tied(), torch.randint(0, 10, (4, 3)), 2, [])


def test_a_batch_of_other_shapes_than_traced_is_named():
    from pipeline.distributed.pipeline_parallel import DataError, check_shapes

    traced = {"tokens": (64, 64), "mask": (64, 64)}
    check_shapes({"tokens": torch.zeros(64, 64), "mask": torch.zeros(64, 64)}, traced)
    with pytest.raises(
        DataError,
        match=r"a batch of input shapes \{'tokens': \(64, 50\), 'mask': \(64, 50\)\}, but "
        r"the pipeline's stages were traced at \{'tokens': \(64, 64\)",
    ):
        check_shapes({"tokens": torch.zeros(64, 50), "mask": torch.zeros(64, 50)}, traced)


def test_a_tensor_parallel_checkpoint_from_before_records_its_data_parallel_ranks():
    """Before pipeline parallelism the train state held only the world size; a tp=2 run of 4 ranks dealt its data over
    2, and a resume must count its position so (not over 4: it would skip half an epoch)."""
    from pipeline.train import saved_data_parallel

    old = {"train_state": {"world_size": 4}, "config": {"train": {"parallel": {"tp": 2, "pp": 1}}}}
    assert saved_data_parallel(old) == 2
    assert saved_data_parallel({"train_state": {"world_size": 4, "data_parallel": 1}}) == 1
    assert saved_data_parallel({"train_state": {"world_size": 2}, "config": {}}) == 2
