"""train.parallel: the device mesh's degrees checked before anything starts, and the pieces that
build it (tensor-parallel plans, traced pipeline stages), in one process. The meshes themselves
launch under torchrun in tests/test_launches.py (HSDP, pipeline parallelism alone and with
data-parallel copies, tensor parallelism: each against DDP, each killed and resumed). What does not
combine yet is refused with the reason."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO, TINY, run_cli

from pipeline.config import ConfigError, check_runtime, load_config

STEPS = [
    "train.max_steps=16",
    "checkpoint.every_n_steps=6",
    "checkpoint.keep_last=3",
    "train.log_every=1",
    "train.eval_every=0",
    "model.name=mlp",
    "model.args={hidden: [64]}",
]
TRANSFORMER = str(REPO / "configs/digit_sequences_transformer.yaml")
# the examples' package
ON_PATH = {"PYTHONPATH": str(REPO)}


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
    """BERT's projections divide over tp=8 (64 features, 8 each) but its 4 heads of 16 do not: each
    rank would hold half a head and fail inside the first forward's reshape."""
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
    """The tracer registers every buffer of a stage as persistent; BERT's position_ids is not, and a
    stage shard holding it would not consolidate (a key the model's manifest lacks)."""
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
            # the head is the embedding
            return self.blocks(self.embed(tokens)) @ self.embed.weight.T

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
    """Before pipeline parallelism the train state held only the world size; a tp=2 run of 4 ranks
    dealt its data over 2, and a resume must count its position so (not over 4: it would skip half
    an epoch)."""
    from pipeline.train import saved_data_parallel

    old = {"train_state": {"world_size": 4}, "config": {"train": {"parallel": {"tp": 2, "pp": 1}}}}
    assert saved_data_parallel(old) == 2
    assert saved_data_parallel({"train_state": {"world_size": 4, "data_parallel": 1}}) == 1
    assert saved_data_parallel({"train_state": {"world_size": 2}, "config": {}}) == 2
