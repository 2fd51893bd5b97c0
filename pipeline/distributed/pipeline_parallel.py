"""Pipeline parallelism (train.parallel.pp): the model cut into `pp` stages at named modules, one
stage a rank, and a schedule (1F1B or GPipe, torch.distributed.pipelining) that streams
micro-batches of each step's batch through them, forward and backward.

The cut is torch.distributed.pipelining's tracer (torch.export): it works on the model as written,
with no change to its forward, and each stage keeps the model's own parameter names
("encoder.layers.1.linear1.weight"), so a stage's DCP shard, the consolidated file and everything
after it are those of a DDP run. The price of tracing: a traced graph has fixed shapes (a step's
micro-batches are all traced-size; evaluation pads its batches to that size) and fixed train/eval
behaviour (dropout, BatchNorm), so the model is traced twice, once in each mode, both graphs running
on the same parameters.

Where stages begin: `train.parallel.pp_split` names the modules, or the model's repeated block (a
transformer layer, a residual block; see parallelize.repeated_block) is dealt evenly over the
stages.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from pipeline.components.data import batch_rows
from pipeline.distributed.mesh import Layout
from pipeline.errors import ConfigError, DataError

log = logging.getLogger(__name__)


def split_points(model: nn.Module, pp: int, named: list[str]) -> list[str]:
    """The modules where stages 1..pp-1 begin: `named` (train.parallel.pp_split) checked against the
    model, or the repeated block's instances dealt evenly over the stages."""
    from pipeline.distributed.parallelize import repeated_block

    modules = dict(model.named_modules())
    if named:
        unknown = [n for n in named if n not in modules]
        if unknown or len(named) != pp - 1 or len(set(named)) != len(named):
            blocks = block_names(model, repeated_block(model))
            raise ConfigError(
                f"train.parallel.pp_split={named}: {'no module ' + ', '.join(unknown) + ' in the model; ' if unknown else ''}"
                f"it names the {pp - 1} module(s) where stages 2..{pp} begin (pp={pp}), in forward "
                f"order, e.g. {blocks[len(blocks) // 2 : len(blocks) // 2 + pp - 1] or ['<module name>']}"
            )
        return list(named)
    block = repeated_block(model)
    blocks = block_names(model, block)
    if len(blocks) < pp:
        raise ConfigError(
            f"train.parallel.pp={pp}: the model has {len(blocks)} repeated block(s) "
            f"({block or 'none found'}) to deal over {pp} stages; name where stages begin with "
            "train.parallel.pp_split=[<module>, ...], or use a smaller pp"
        )
    return [blocks[(k * len(blocks)) // pp] for k in range(1, pp)]


def block_names(model: nn.Module, block: str | None) -> list[str]:
    """The names of the outermost modules of class `block`, in registration (forward) order."""
    names: list[str] = []
    for name, module in model.named_modules():
        if type(module).__name__ == block and not any(name.startswith(n + ".") for n in names):
            names.append(name)
    return names


@dataclass
class Pipeline:
    """This rank's stage and the schedules that run it. `module` is what the optimizer, checkpoints
    and replica checks see (the train-mode stage, DDP-wrapped where the stage has data-parallel
    copies)."""

    module: nn.Module
    train_schedule: object
    eval_schedule: object
    # the rows of one step's batch on this rank: micro-batches x traced micro-batch rows
    rows: int
    is_first: bool
    is_last: bool
    # the pipeline's process group: this rank and the other stages' ranks of its place
    group: object
    # the structure of the model's output (a traced stage returns its tensors flat)
    output_spec: object
    # each input's shape in a batch of `rows` rows, as traced
    shapes: dict

    def step(self, inputs, target) -> torch.Tensor | None:
        """Forward and backward of one batch through every stage; the last stage returns the sum of
        its micro-batches' losses (each already scaled, see `build`), the others None."""
        check_shapes(inputs, self.shapes)
        args, kwargs = as_arguments(inputs) if self.is_first else ((), {})
        losses: list[torch.Tensor] = []
        self.train_schedule.step(
            *args,
            target=target if self.is_last else None,
            losses=losses,
            return_outputs=False,
            **kwargs,
        )
        return (
            torch.stack([loss.detach().double() for loss in losses]).sum() if self.is_last else None
        )

    @torch.no_grad()
    def forward(self, inputs):
        """The model's output on a batch of at most `rows` rows (padded to them: the graphs have
        fixed shapes), on the last stage; None on the others."""
        n = batch_rows(inputs)
        padded = tree_map(lambda t: pad_rows(t, self.rows), inputs)
        args, kwargs = as_arguments(padded) if self.is_first else ((), {})
        output = self.eval_schedule.step(*args, **kwargs)
        return (
            tree_map(lambda t: t[:n], restructured(output, self.output_spec))
            if self.is_last
            else None
        )


def trace(
    model: nn.Module, example_micro_batch, pp: int, named_split: list[str]
) -> tuple[dict, list[str], object]:
    """The model traced on one micro-batch and cut into `pp` stages, in eval and in train mode
    ({mode: Pipe}), both graphs on the model's own parameters; the split points; the structure of
    the model's output."""
    from torch.distributed.pipelining import SplitPoint
    from torch.distributed.pipelining._IR import Pipe, annotate_split_points

    points = split_points(model, pp, named_split)
    args, kwargs = as_arguments(example_micro_batch)
    reserved = sorted(set(kwargs) & {"target", "losses", "loss_kwargs", "return_outputs"})
    if reserved:
        raise ConfigError(
            f"train.parallel.pp={pp}: the model's input '{reserved[0]}' has the name of an argument of "
            "the pipeline schedule's step(); rename it in the data and the model's forward"
        )
    # what the model returns (a Hugging Face output, a dict of heads), for the last stage
    with torch.no_grad():
        output_spec = tree_flatten(model.eval()(*args, **kwargs))[1]
    not_persistent = non_persistent_buffers(model)
    annotate_split_points(model, {name: SplitPoint.BEGINNING for name in points})
    traced = {}
    # both graphs hold the model's own parameters: one set of weights
    for mode in (
        "eval",
        "train",
    ):
        model.train(mode == "train")
        try:
            with inputs_passed_on(model):
                traced[mode] = Pipe.from_tracing(model, args, kwargs)
        except Exception as exc:
            cause = exc.__cause__ or exc
            raise ConfigError(
                f"train.parallel.pp={pp}: the model could not be traced into stages "
                f"({type(cause).__name__}: {str(cause).strip().splitlines()[0][:300] if str(cause).strip() else ''}); "
                "pipeline parallelism cuts a model torch.export can capture as one graph (no "
                "data-dependent Python control flow): fix that, or train with train.parallel.pp=1 "
                "(FSDP2 or tensor parallelism)"
            ) from exc
        pipe = traced[mode]
        if pipe.num_stages != pp:
            raise ConfigError(
                f"train.parallel.pp_split={points} cut the model into {pipe.num_stages} stage(s), not "
                f"pp={pp}: each split point must be a module the forward calls once, in forward order"
            )
        # the tracer copies such a parameter into each stage: copies trained apart
        if pipe.replicated_params:
            shared = sorted(
                {name for mapping in pipe.replicated_params for name in mapping.values()}
            )
            raise ConfigError(
                f"train.parallel.pp={pp}: {', '.join(shared)} is used by more than one stage (tied "
                "weights); the stages would train separate copies of it. Split where one stage holds "
                "every use (train.parallel.pp_split), or untie the weights"
            )
        for index in range(pipe.num_stages):
            keep_non_persistent(pipe.get_stage_module(index), not_persistent)
    return traced, points, output_spec


def build(
    model: nn.Module,
    example_micro_batch,
    layout: Layout,
    group,
    device: torch.device,
    microbatches: int,
    named_split: list[str],
    schedule: str,
    loss_fn,
    wrap,
) -> Pipeline:
    """Traces `model` on one micro-batch (see `trace`), keeps this rank's stage in each mode, and
    gives the train-mode one to `wrap` (DDP over the stage's data-parallel copies, or nothing);
    `loss_fn(output, target)` is the loss of one micro-batch, scaled by the caller for the
    accumulation."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
    from torch.distributed.pipelining.stage import build_stage

    traced, points, output_spec = trace(model, example_micro_batch, layout.pp, named_split)
    stage_index = layout.pp_rank
    # the other stages' modules: this rank never runs them (their memory is freed)
    for pipe in traced.values():
        mine = pipe.get_stage_module(stage_index)
        for name in [n for n, child in pipe.split_gm.named_children() if child is not mine]:
            delattr(pipe.split_gm, name)
    stage_graph = traced["train"].get_stage_module(stage_index)
    train_module = wrap(stage_graph)
    if train_module is not stage_graph:
        # DDP over the stage's copies: the traced stage finds which stage sends each of its inputs
        # in the graph of the module it runs (`submod.graph`), which DDP's wrapper does not pass
        # through.
        train_module.graph = stage_graph.graph
    eval_module = traced["eval"].get_stage_module(stage_index)
    eval_module.eval()
    log.info(
        "pipeline stage %d of %d: from %s (%.2fM parameters), %s schedule, %d micro-batches of %d rows",
        stage_index + 1,
        layout.pp,
        "the input" if stage_index == 0 else points[stage_index - 1],
        sum(p.numel() for p in eval_module.parameters()) / 1e6,
        schedule,
        microbatches,
        batch_rows(example_micro_batch),
    )
    kind = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    # scale_grads=False: loss_fn is already divided by the micro-batches and accumulation steps, so
    # gradients summed over several steps of the schedule (train.grad_accum_steps) are the mean, as
    # without pipelining.
    train_schedule = kind(
        build_stage(train_module, stage_index, traced["train"].info(), device, group),
        microbatches,
        loss_fn=lambda output, target: loss_fn(restructured(output, output_spec), target),
        scale_grads=False,
    )
    eval_schedule = ScheduleGPipe(
        build_stage(eval_module, stage_index, traced["eval"].info(), device, group), microbatches
    )
    rows = microbatches * batch_rows(example_micro_batch)
    shapes = tree_map(lambda t: (rows, *t.shape[1:]), example_micro_batch)
    return Pipeline(
        train_module,
        train_schedule,
        eval_schedule,
        rows,
        stage_index == 0,
        stage_index == layout.pp - 1,
        group,
        output_spec,
        shapes,
    )


@contextlib.contextmanager
def inputs_passed_on(model: nn.Module):
    """The model's forward with a copy of each input made first. A later stage may read an input
    again (the transformer example's padding mask, read by its pooling after the encoder), and the
    tracer hands a stage only what the stage before it computed: a copy made at the start is such a
    value, sent on from stage to stage. The class is swapped, not wrapped, so the parameter names
    stay the model's."""
    base = type(model)

    def forward(self, *args, **kwargs):
        args, kwargs = tree_map(
            lambda v: v.clone() if isinstance(v, torch.Tensor) else v, (args, kwargs)
        )
        return base.forward(self, *args, **kwargs)

    model.__class__ = type(base.__name__, (base,), {"forward": forward})
    try:
        yield model
    finally:
        model.__class__ = base


def non_persistent_buffers(model: nn.Module) -> set[str]:
    """The names of the buffers the model leaves out of its state_dict (Hugging Face's
    position_ids)."""
    return {
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        for name in module._non_persistent_buffers_set
    }


def keep_non_persistent(stage: nn.Module, names: set[str]) -> None:
    """The tracer registers every buffer of a stage as persistent: those the model keeps out of its
    state_dict are put back out of it, or the stage's checkpoint shard would hold keys the model's
    manifest lacks."""
    for name, _ in list(stage.named_buffers()):
        if name in names:
            owner, _, leaf = name.rpartition(".")
            stage.get_submodule(owner)._non_persistent_buffers_set.add(leaf)


def check_shapes(inputs, traced: dict | torch.Size) -> None:
    """A batch of the shapes the stages were traced at (their graphs are fixed: another length would
    fail in a stage's receive, or hang under NCCL)."""
    given = tree_map(lambda t: tuple(t.shape), inputs)
    if given != traced:
        raise DataError(
            f"train.parallel.pp: a batch of input shapes {given}, but the pipeline's stages were traced "
            f"at {traced}: every batch must have the traced shapes (pad sequences to one fixed length in "
            "the data), or train without train.parallel.pp"
        )


def restructured(output, spec):
    """The last stage's flat output in the model's own structure (what the task's loss and metrics
    read)."""
    leaves = list(output) if isinstance(output, (tuple, list)) else [output]
    return tree_unflatten(leaves, spec) if len(leaves) == spec.num_leaves else output


def as_arguments(inputs) -> tuple[tuple, dict]:
    """A batch as the model's forward takes it: a dict as keyword arguments, a tensor
    positionally."""
    return ((), dict(inputs)) if isinstance(inputs, dict) else ((inputs,), {})


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t` with its first row repeated up to `rows` rows (outputs of the padding are dropped)."""
    if len(t) > rows:
        raise ValueError(f"a batch of {len(t)} rows for a pipeline traced at {rows}")
    return t if len(t) == rows else torch.cat([t, t[:1].expand(rows - len(t), *t.shape[1:])])
