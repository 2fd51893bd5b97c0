"""What a run is made of, built from its config: the data splits, the task and the model.

Every stage builds through here: the launcher before it spawns a process (`preflight`), each training
rank, and export from what a checkpoint recorded (`rebuild_*`, with the trust check of reference.py).
A model is rebuilt from its `ModelSpec` alone: the reference and the explicit args it was called with,
the ones the data suggested included, recorded with every checkpoint and `model.json`.

The model's arguments: `model.args`, plus, for parameters the model's callable takes and args omits,
what the training set suggests: `num_classes` from its `classes` (classification), and its
`model_args` dict (input sizes, normalization statistics). They must be plain values (numbers,
strings, lists, dicts): they travel as JSON, and the model is built from the JSON form, so training
and every rebuild see the same values.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pipeline.components.data import Splits, check_splits, first_batch, forward
from pipeline.components.reference import (ArtifactSource, ComponentError, accepted_parameters, call,
                                           check_trusted, resolve)
from pipeline.components.tasks import TaskError, build_task
from pipeline.config import Config, DataConfig, ModelConfig

log = logging.getLogger(__name__)

PROBE_ROWS = 2
PROBE_MAX_PARAMETERS = 200_000_000  # the launcher skips its test forward above this (each rank still does one)


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
    suggested: dict[str, Any]  # the args that came from the data, for the log


def build_data(data_cfg: DataConfig, task_name: str, source: ArtifactSource | None = None,
               missing_hint: str = "") -> Splits:
    """`source`: the artifact the config was read back from, if it was (see reference.py on trust)."""
    check_trusted("data", data_cfg.component, source)
    fn = resolve("data", data_cfg.component, missing_hint)
    returned = call("data", data_cfg.component, fn, data_cfg.args)
    return check_splits(returned, data_cfg.component, task_name)


def model_spec(model_cfg: ModelConfig, splits: Splits, task) -> tuple[ModelSpec, dict[str, Any]]:
    """The model's explicit arguments: model.args, plus what the data suggests for parameters the
    callable takes and args omits; and which ones came from the data."""
    fn = resolve("model", model_cfg.component)
    suggested = dict(splits.model_hints)
    if task.name == "classification" and splits.classes:
        suggested["num_classes"] = len(splits.classes)
    accepted = accepted_parameters(fn)
    from_data = {k: v for k, v in suggested.items() if k in accepted and k not in model_cfg.args}
    args = plain_args({**from_data, **model_cfg.args})
    return ModelSpec(model_cfg.component, args), from_data


def plain_args(args: dict[str, Any]) -> dict[str, Any]:
    """`args` as JSON has them (tensors and arrays as lists); ComponentError for what JSON can't hold."""
    def plain(value: Any, key: str) -> Any:
        if torch.is_tensor(value) or hasattr(value, "tolist"):
            return value.tolist()
        if isinstance(value, (list, tuple)):
            return [plain(v, key) for v in value]
        if isinstance(value, dict):
            return {str(k): plain(v, f"{key}.{k}") for k, v in value.items()}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise ComponentError(f"model.args.{key} is a {type(value).__name__}; model arguments must be plain values "
                             "(numbers, strings, lists, dicts) because they travel with every checkpoint as JSON")
    return json.loads(json.dumps({k: plain(v, k) for k, v in args.items()}))


def instantiate_model(spec: ModelSpec, source: ArtifactSource | None = None,
                      missing_hint: str = "") -> torch.nn.Module:
    check_trusted("model", spec.component, source)
    fn = resolve("model", spec.component, missing_hint)
    model = call("model", spec.component, fn, spec.args)
    if not isinstance(model, torch.nn.Module):
        raise ComponentError(f"model.component '{spec.component}' returned a {type(model).__name__}; it must return "
                             "a torch.nn.Module")
    return model


def probe(model: torch.nn.Module, splits: Splits, task, component: str) -> None:
    """One forward of a few real validation samples (eval mode, no grad): the model takes the inputs,
    its output fits the task, and the loss is a finite number. Teaches a classification task without
    `classes` its number of classes."""
    inputs, target = first_batch(splits.val, PROBE_ROWS)
    was_training = model.training
    model.eval()
    where = f"model.component '{component}' on {PROBE_ROWS} validation samples"
    try:
        with torch.no_grad():
            output = forward(model, inputs)
            task.check_output(output, target, where)
            loss = task.loss(output.float(), target)
    except TaskError:
        raise
    except Exception as exc:
        hint = ""
        if isinstance(inputs, dict) and isinstance(exc, TypeError):
            hint = (f"; dict inputs are passed as keyword arguments, model(**inputs): forward() must take "
                    f"{', '.join(inputs)}")
        raise ComponentError(f"{where}: {type(exc).__name__}: {exc}{hint}") from exc
    finally:
        model.train(was_training)
    if not torch.is_tensor(loss) or loss.dim() != 0 or not torch.isfinite(loss):
        raise TaskError(f"{where}: the loss is {loss!r}, not a finite scalar")


def preflight(cfg: Config) -> Built:
    """Everything a training rank builds, checked in the launcher before any process is spawned: a bad
    component is one message here instead of one per rank after torchrun started."""
    splits = build_data(cfg.data, cfg.task.name)
    task = build_task(cfg.task, splits.classes)
    spec, suggested = model_spec(cfg.model, splits, task)
    try:
        with torch.device("meta"):  # shapes without memory: the size decides whether to probe here
            size = sum(p.numel() for p in instantiate_model(spec).parameters())
    except ComponentError:
        size = 0  # some constructors can't run on the meta device; the real one below says what is wrong
    if size <= PROBE_MAX_PARAMETERS:
        probe(instantiate_model(spec), splits, task, spec.component)
    else:
        log.info("model has %.0fM parameters: its test forward runs on each rank, not in the launcher", size / 1e6)
    return Built(splits, task, spec, suggested)


def state_manifest(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Every key of the plain model's state_dict with its shape and dtype: what consolidation checks the
    checkpoint and its output against, without importing the model's code."""
    return {name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
            for name, t in model.state_dict().items()}
