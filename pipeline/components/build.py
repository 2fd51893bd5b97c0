"""What a run is made of, built from its config: the data splits, the task and the model.

Every stage builds through here: the launcher before it spawns a process (`preflight`), each
training rank, and export from what a checkpoint recorded (`rebuild_*`, with the trust check of
reference.py). A model is rebuilt from its `ModelSpec` alone: the reference and the explicit args it
was called with, the ones the data suggested included, recorded with every checkpoint and
`model.json`.

The model's arguments: `model.args`, plus, for parameters the model's callable takes and args omits,
what the training set suggests: what its task derives from it (`num_classes` from its `classes`, for
any task that predicts classes, and for a factory that takes `**kwargs` as timm's `create_model`
does), and its `model_args` dict (input sizes, normalization statistics). They must be plain values
(numbers, strings, lists, dicts): they travel as JSON, and the model is built from the JSON form, so
training and every rebuild see the same values.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset

from pipeline.components.data import Splits, check_splits, first_batch, forward
from pipeline.components.own_stream import check_length
from pipeline.components.reference import (
    ArtifactSource,
    ComponentError,
    accepted_parameters,
    call,
    resolve,
    takes_kwargs,
)
from pipeline.config import (
    ConfigError,
    DataConfig,
    ExportConfig,
    ModelConfig,
    TaskConfig,
    TrainConfig,
)
from pipeline.distributed import pipeline_parallel, tensor_parallel
from pipeline.distributed.parallelize import fsdp_units
from pipeline.tasks import build_task, task_class
from pipeline.tasks.base import TaskError

log = logging.getLogger(__name__)

PROBE_ROWS = 2
# the launcher skips its test forward above this (each rank still does one)
PROBE_MAX_PARAMETERS = 200_000_000


@dataclass(frozen=True)
class ModelSpec:
    """Everything that rebuilds the model anywhere: `component(**args)`."""

    component: str
    args: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Built:
    splits: Splits
    task: Any
    model_spec: ModelSpec
    # the args that came from the data, for the log
    suggested: dict[str, Any]


def build_data(
    data_cfg: DataConfig,
    task_name: str,
    source: ArtifactSource | None = None,
    missing_hint: str = "",
) -> Splits:
    """`source`: the artifact the config was read back from, if it was (see reference.py on
    trust)."""
    fn = resolve("data", data_cfg.component, missing_hint, source)
    returned = call("data", data_cfg.component, fn, data_cfg.args)
    return check_splits(returned, data_cfg.component, task_class(task_name))


def model_spec(model_cfg: ModelConfig, splits: Splits, task) -> tuple[ModelSpec, dict[str, Any]]:
    """The model's explicit arguments: model.args, plus what the data suggests for parameters the
    callable takes and args omits; and which ones came from the data."""
    fn = resolve("model", model_cfg.component)
    from_task = task.suggest(splits.classes)
    suggested = {**splits.model_hints, **from_task}
    accepted = accepted_parameters(fn)
    # a factory such as timm.create_model(name, **kwargs) passes num_classes on
    if takes_kwargs(fn):
        accepted |= set(from_task)
    from_data = {k: v for k, v in suggested.items() if k in accepted and k not in model_cfg.args}
    args = plain_args({**from_data, **model_cfg.args})
    return ModelSpec(model_cfg.component, args), from_data


def plain_args(args: dict[str, Any]) -> dict[str, Any]:
    """`args` as JSON has them (tensors and arrays as lists); ComponentError for what JSON can't
    hold."""

    def plain(value: Any, key: str) -> Any:
        if torch.is_tensor(value) or hasattr(value, "tolist"):
            return value.tolist()
        if isinstance(value, (list, tuple)):
            return [plain(v, key) for v in value]
        if isinstance(value, dict):
            return {str(k): plain(v, f"{key}.{k}") for k, v in value.items()}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise ComponentError(
            f"model.args.{key} is a {type(value).__name__}; model arguments must be plain values "
            "(numbers, strings, lists, dicts) because they travel with every checkpoint as JSON"
        )

    return json.loads(json.dumps({k: plain(v, k) for k, v in args.items()}))


def instantiate_model(
    spec: ModelSpec, source: ArtifactSource | None = None, missing_hint: str = ""
) -> torch.nn.Module:
    fn = resolve("model", spec.component, missing_hint, source)
    model = call(
        "model",
        spec.component,
        fn,
        spec.args,
        hint=" (or let the training set suggest them: num_classes "
        "follows from its `classes`, any other argument from its `model_args` dict)",
    )
    if not isinstance(model, torch.nn.Module):
        raise ComponentError(
            f"model.component '{spec.component}' returned a {type(model).__name__}; it must return "
            "a torch.nn.Module"
        )
    return model


def probe(model: torch.nn.Module, splits: Splits, task, component: str) -> None:
    """One forward of a few real validation samples (eval mode, no grad): the model takes the
    inputs, its output fits the task, the loss is a finite number, and a custom metric gives
    numbers. Teaches a classification task without `classes` its number of classes, a custom task
    its primary metric."""
    rows = min(len(splits.val), task.probe_rows)
    inputs, target = first_batch(splits.val, rows)
    was_training = model.training
    model.eval()
    where = f"model.component '{component}' on {rows} validation samples"
    try:
        with torch.no_grad():
            output = forward(model, inputs)
            task.check_output(output, target, where)
            loss = task.loss(output, target)
            task.check_metric(output, target, where)
    except TaskError:
        raise
    except Exception as exc:
        hint = ""
        if isinstance(inputs, dict) and isinstance(exc, TypeError):
            hint = (
                f"; dict inputs are passed as keyword arguments, model(**inputs): forward() must take "
                f"{', '.join(inputs)}"
            )
        doubles = [s.name for s in splits.inputs if s.dtype == torch.float64]
        if doubles and any(p.dtype == torch.float32 for p in model.parameters()):
            hint += (
                f"; input(s) {', '.join(doubles)} are float64 and the model's parameters float32: give float32 "
                "tensors (torch.tensor(x, dtype=torch.float32))"
            )
        fed = ", ".join(
            f"{name} {list(t.shape)} {str(t.dtype).removeprefix('torch.')}"
            for name, t in (inputs.items() if isinstance(inputs, dict) else [("input", inputs)])
            if torch.is_tensor(t)
        )
        raise ComponentError(
            f"{where}, fed {fed}: {type(exc).__name__}: {str(exc).strip()}{hint}"
        ) from exc
    finally:
        model.train(was_training)
    if not torch.is_tensor(loss) or loss.dim() != 0 or not torch.isfinite(loss):
        raise TaskError(f"{where}: the loss is {loss!r}, not a finite scalar")
    clash = sorted(set(task.output_names) & set(splits.input_names))
    if clash:
        raise TaskError(
            f"{where}: '{clash[0]}' names both an input and an output of the model; the exported graph "
            "and the server need them apart: rename the input in the data or the output in the model"
        )


def preflight(
    data_cfg: DataConfig,
    task_cfg: TaskConfig,
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    export_cfg: ExportConfig,
) -> Built:
    """Everything a training rank builds, checked in the launcher before any process is spawned: a
    bad component is one message here instead of one per rank after torchrun started. Settings that
    name parts of the model or its inputs (train.fsdp_wrap, export.dynamic_axes) are checked here
    too, not after training."""
    splits = build_data(data_cfg, task_cfg.name)
    if isinstance(splits.train, IterableDataset):
        check_length(splits.train, train_cfg.max_steps)
    task = build_task(task_cfg, splits.classes)
    spec, suggested = model_spec(model_cfg, splits, task)
    check_dynamic_axes(export_cfg.dynamic_axes, {s.name: len(s.shape) + 1 for s in splits.inputs})
    try:
        # shapes without memory: the size decides whether to probe here
        with torch.device("meta"):
            shapes_only = instantiate_model(spec)
        size = sum(p.numel() for p in shapes_only.parameters())
    except ComponentError:
        # some constructors can't run on the meta device; the real one below says why
        shapes_only, size = (
            None,
            0,
        )
    if train_cfg.fsdp_wrap and shapes_only is not None:
        # names classes the model has
        fsdp_units(shapes_only, train_cfg.fsdp_wrap)
    if train_cfg.parallel.tp > 1 and shapes_only is not None:
        # a plan, and one that fits the model
        tensor_parallel.plan_for(shapes_only, train_cfg.parallel.tp)
    if train_cfg.parallel.pp > 1 and shapes_only is not None:
        # stages
        pipeline_parallel.split_points(
            shapes_only, train_cfg.parallel.pp, train_cfg.parallel.pp_split
        )
    if size <= PROBE_MAX_PARAMETERS:
        probe(instantiate_model(spec), splits, task, spec.component)
    else:
        log.info(
            "model has %.0fM parameters: its test forward runs on each rank, not in the launcher",
            size / 1e6,
        )
    return Built(splits, task, spec, suggested)


def check_dynamic_axes(dynamic_axes: dict[str, list[int]], ranks: dict[str, int]) -> None:
    """export.dynamic_axes names inputs the data has, and axes they have besides the batch axis."""
    for name, axes in dynamic_axes.items():
        if name not in ranks:
            raise ConfigError(
                f"export.dynamic_axes names input '{name}'; the model's inputs are "
                f"{', '.join(ranks)} (a lone tensor input is named input)"
            )
        bad = [a for a in axes if not 1 <= a < ranks[name]]
        if bad:
            raise ConfigError(
                f"export.dynamic_axes.{name}: axes {bad} don't exist besides the batch axis; "
                f"'{name}' has {ranks[name]} axes, so 1..{ranks[name] - 1}"
            )


def component_references(
    model_cfg: ModelConfig, data_cfg: DataConfig, task_cfg: TaskConfig
) -> list[str]:
    """Every component a config names: what a run logs the code of, and what `pipeline run` trusts
    when its own model.json names them back."""
    return [
        model_cfg.component,
        data_cfg.component,
        *(c.component for c in (task_cfg.loss, task_cfg.metric) if c),
    ]


def state_manifest(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Every key of the plain model's state_dict with its shape and dtype: what consolidation checks
    the checkpoint and its output against, without importing the model's code."""
    return {
        name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
        for name, t in model.state_dict().items()
    }
