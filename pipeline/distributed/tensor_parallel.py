"""Tensor parallelism (train.parallel.tp): a model's attention and MLP projections split over `tp`
ranks with DTensor's `parallelize_module`, Megatron's pattern: the first projection of a pair
column-wise (each rank computes its share of the heads or hidden units), the second row-wise (the
partial sums all-reduced), so what flows between blocks is a whole, replicated tensor and the rest
of the model is untouched.

The plan comes from, in order:
  1. the model itself: a `tensor_parallel_plan()` method returning {module name: "colwise" |
     "rowwise"} (or DTensor ParallelStyle objects), for a user's own model;
  2. the families we know by their module names (FAMILIES): Hugging Face BERT-style encoders
     (`attention.self.query/key/value` -> `attention.output.dense`, `intermediate.dense` ->
     `output.dense`) and LLaMA-style decoders (`self_attn.q/k/v_proj` -> `o_proj`,
     `mlp.gate/up_proj` -> `down_proj`);
and a model that matches none is refused with what was looked for. Attention that reshapes its
projections with the head count taken from the local width (Hugging Face's
`view(..., -1, head_dim)`) runs unchanged on a rank's share of the heads; `nn.MultiheadAttention`
packs q, k and v in one parameter and has no plan.
"""

from __future__ import annotations

import logging
import re

from torch import nn

from pipeline.errors import ConfigError

log = logging.getLogger(__name__)

# (family, [(regex on the module's full name, style)]): a family applies when all its patterns match
# something.
FAMILIES = [
    (
        "BERT-style encoder (Hugging Face)",
        [
            (r"(^|\.)attention\.self\.(query|key|value)$", "colwise"),
            (r"(^|\.)attention\.output\.dense$", "rowwise"),
            (r"(^|\.)intermediate\.dense$", "colwise"),
            (r"(^|\.)layer\.\d+\.output\.dense$", "rowwise"),
        ],
    ),
    (
        "LLaMA-style decoder (Hugging Face)",
        [
            (r"(^|\.)self_attn\.(q|k|v)_proj$", "colwise"),
            (r"(^|\.)self_attn\.o_proj$", "rowwise"),
            (r"(^|\.)mlp\.(gate|up)_proj$", "colwise"),
            (r"(^|\.)mlp\.down_proj$", "rowwise"),
        ],
    ),
]


def plan_for(model: nn.Module, tp: int) -> tuple[str, dict[str, str]]:
    """(where the plan came from, {module name: "colwise" | "rowwise"}), checked against the model:
    every named module is an nn.Linear whose split dimension divides by `tp`. ConfigError when the
    model has no plan."""
    own = getattr(model, "tensor_parallel_plan", None)
    if callable(own):
        source, plan = f"{type(model).__name__}.tensor_parallel_plan()", dict(own())
    else:
        source, plan = None, {}
        names = [name for name, _ in model.named_modules()]
        for family, patterns in FAMILIES:
            found = {
                name: style
                for pattern, style in patterns
                for name in names
                if re.search(pattern, name)
            }
            if all(any(re.search(p, n) for n in names) for p, _ in patterns):
                source, plan = family, found
                break
        if not plan:
            known = "; ".join(
                f"{family}: {', '.join(p for p, _ in patterns)}" for family, patterns in FAMILIES
            )
            raise ConfigError(
                f"train.parallel.tp={tp}: the model ({type(model).__name__}) has no tensor-parallel plan. Give it a "
                "method `tensor_parallel_plan()` returning {module name: 'colwise' | 'rowwise'} (each an nn.Linear: "
                "the first projection of a pair colwise, the second rowwise), or use a family trainserve knows by "
                f"its module names ({known}). nn.MultiheadAttention packs q, k and v in one parameter and can't be "
                "split this way"
            )
    modules = dict(model.named_modules())
    for name, style in plan.items():
        module = modules.get(name)
        if module is None:
            raise ConfigError(
                f"the tensor-parallel plan ({source}) names '{name}', which the model does not have"
            )
        if isinstance(style, str):
            if style not in ("colwise", "rowwise"):
                raise ConfigError(
                    f"the tensor-parallel plan ({source}) gives '{name}' the style {style!r}; use "
                    "'colwise' or 'rowwise'"
                )
            if not isinstance(module, nn.Linear):
                raise ConfigError(
                    f"the tensor-parallel plan ({source}) names '{name}', a {type(module).__name__}; "
                    "'colwise' and 'rowwise' split an nn.Linear"
                )
            split = module.out_features if style == "colwise" else module.in_features
            if split % tp:
                raise ConfigError(
                    f"'{name}' has {split} {'output' if style == 'colwise' else 'input'} features, which "
                    f"do not divide over train.parallel.tp={tp} ranks"
                )
    check_heads(model, tp)
    return source, plan


def check_heads(model: nn.Module, tp: int) -> None:
    """A Hugging Face model's attention heads (and key/value heads, under grouped-query attention)
    divide over the tensor-parallel ranks: each rank computes whole heads, or its first forward
    fails inside a reshape."""
    config = getattr(model, "config", None)
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % tp:
            raise ConfigError(
                f"the model has {heads} {key.removeprefix('num_').replace('_', ' ')} "
                f"(config.{key}), which do not divide over train.parallel.tp={tp} ranks: each rank "
                f"computes whole heads; choose a tp that divides {heads}"
            )


def parallelize(model: nn.Module, tp_mesh, tp: int) -> nn.Module:
    """The model's planned projections split over `tp_mesh` (in place)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    source, plan = plan_for(model, tp)
    styles = {
        name: (ColwiseParallel() if style == "colwise" else RowwiseParallel())
        if isinstance(style, str)
        else style
        for name, style in plan.items()
    }
    log.info("tensor parallel over %d ranks: %d projections split (%s)", tp, len(styles), source)
    model = parallelize_module(model, tp_mesh, styles)
    keep_generators_per_rank(tp_mesh)
    return model


def keep_generators_per_rank(tp_mesh) -> None:
    """DTensor's random ops on a GPU (dropout on a DTensor: a plan's own styles that keep DTensor
    outputs) go through torch's RNG tracker, which keeps its offsets in each rank's CUDA generator
    (a checkpoint holds it). torch creates the tracker at the first such op and sets every rank's
    generator to rank 0's there; in a resume that op comes after each rank restored its own
    generator, which rank 0's would overwrite. Created here, at setup, without that sync: the ranks'
    generators start alike anyway (train.seed on every rank). On a CPU mesh there is no tracker:
    each rank draws from its own generator."""
    # torch 2.13 keeps the tracker in this private module.
    from torch.distributed.tensor import _random as dtensor_random

    if tp_mesh.device_type == "cpu" or dtensor_random._rng_tracker is not None:
        return
    if not dtensor_random.is_rng_supported_mesh(tp_mesh):
        return
    dtensor_random._rng_tracker = dtensor_random.OffsetBasedRNGTracker(
        tp_mesh, run_state_sync=False
    )
