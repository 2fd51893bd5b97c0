"""The baseline gate: the exported model must be clearly better, on the validation split, than the
task's trivial predictor (the most frequent class, the targets' mean: `task.baseline`), or export
registers nothing unless told (export.allow_below_baseline). A model at chance level once became
@champion because it was the first.

A model with BatchNorm layers whose running statistics have not settled scores well with batch
statistics and poorly in eval mode (which is what is exported and served); when such a model falls
below the baseline, the gate measures it both ways and says so.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from pipeline.artifact import gates


def gate(task, state: dict, export_cfg, head: torch.nn.Module, val) -> dict[str, Any] | None:
    """The gate's record, from the exported model's validation `state` (None where the task knows no
    baseline)."""
    found = task.baseline(state)
    if found is None:
        return None
    value, base, metric = task.metrics(state)[task.primary], found["value"], task.primary
    margin = export_cfg.baseline_margin
    # a fraction's margin shrinks near 1: past 95% for one class, half the headroom left
    if task.mode == "max":
        needed = min(base + margin, base + (1 - base) / 2) if 0 <= base <= 1 else base + margin
    else:
        needed = base * (1 - margin)
    better = value >= needed if task.mode == "max" else value <= needed
    shown = _percent if task.mode == "max" and 0 <= base <= 1 else _number
    record = {
        "passed": better or export_cfg.allow_below_baseline,
        "below_baseline": not better,
        "metric": metric,
        "value": value,
        "baseline": base,
        "needed": needed,
        "predictor": found["predictor"],
    }
    if better:
        return record | {
            "message": f"{metric} {shown(value)} beats the baseline ({found['predictor']}: "
            f"{shown(base)}) by the margin export.baseline_margin asks ({shown(needed)})"
        }
    message = (
        f"{metric} {shown(value)} is not clearly better than the baseline ({found['predictor']}: "
        f"{shown(base)}); export.baseline_margin={export_cfg.baseline_margin} asks for {shown(needed)} or "
        "better"
    )
    if (settled := batch_statistics(task, head, val)) is not None:
        record["batch_statistics"] = settled
        if (settled >= needed) if task.mode == "max" else (settled <= needed):
            message += (
                f". With batch statistics (its BatchNorm layers in train mode) it scores {shown(settled)}: its "
                "BatchNorm running statistics have not settled, and eval mode is what is exported and served "
                "(train more steps, or recompute the running statistics over the training data)"
            )
    message += (
        "; registered anyway (export.allow_below_baseline=true)"
        if export_cfg.allow_below_baseline
        else "; train longer or check the data and labels, or set export.allow_below_baseline=true to register "
        "it anyway"
    )
    return record | {"message": message}


def batch_statistics(task, head: torch.nn.Module, val) -> float | None:
    """The primary metric of a copy of the model whose BatchNorm layers normalize with each batch's
    own statistics (None for a model without BatchNorm)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    from pipeline.components.data import eval_loader
    from pipeline.distributed import DistInfo

    if not any(isinstance(m, _BatchNorm) for m in head.modules()):
        return None
    trial = copy.deepcopy(head).eval()
    for module in trial.modules():
        if isinstance(module, _BatchNorm):
            module.train()
    state = task.new_state(torch.device("cpu"))
    model_outputs = [n for n in trial.output_names if n not in task.derived]
    with torch.no_grad():
        for inputs, target in eval_loader(val, gates.VAL_BATCH):
            # (gates.run_torch would put the BatchNorm layers back in eval mode)
            feeds = gates.feeds_of(inputs)
            # a batch of one has no statistics to normalize with (BatchNorm refuses it)
            if len(target) < 2:
                continue
            out = dict(
                zip(
                    trial.output_names,
                    trial(*(torch.from_numpy(feeds[n]) for n in trial.input_names)),
                )
            )
            task.update(state, {n: out[n].float() for n in model_outputs}, target)
    task.reduce(state, DistInfo.cpu_alone())
    return task.metrics(state)[task.primary]


def _percent(value: float) -> str:
    return f"{value:.2%}"


def _number(value: float) -> str:
    return f"{value:.4g}"
