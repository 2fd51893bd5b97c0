"""Tasks: what is learned from (inputs, target) pairs: the loss, the validation metrics, the plot, and
the outputs the exported model has.

    classification  cross-entropy; accuracy, top-k accuracy (k < classes), loss; a confusion matrix;
                    exported outputs `logits` and `probabilities` (the softmax is inside the graph)
    regression      mean squared error; RMSE, MAE, R2 (averaged over target columns), loss; a
                    predicted-vs-actual plot; exported output `prediction`
    custom          the user's `task.loss` and `task.metric`; exported output `output` (the model's tensor)

`task.loss` may also replace the built-in loss of classification or regression (label smoothing, a
Huber loss); their metrics and outputs stay. A loss or metric component that is a class is
instantiated with its args; a function is called with (outputs, target[s], **args).

Validation metrics come from sums that every rank adds up, so two ranks over disjoint halves of the
split give exactly what one process gives over all of it. A custom metric sees the whole split's
outputs and targets, gathered from every rank in the split's order. `primary` (better when
`mode` says) is the metric the export gate holds the ONNX model to.
"""

from __future__ import annotations

import functools
import inspect
import math
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeline.components.reference import ArtifactSource, ComponentError, call, plain_signature, resolve, short_name
from pipeline.config import ComponentConfig, TaskConfig

PLOT_POINTS = 2000  # predicted-vs-actual points kept for the plot, over all ranks
MAX_CONFUSION_PLOT = 50  # classes beyond which a confusion matrix is unreadable


class TaskError(ComponentError):
    """The model's outputs don't fit the task and its data; the message says what would."""


def build_task(task_cfg: TaskConfig, classes: list[str] | None, source: ArtifactSource | None = None,
               recorded: dict | None = None):
    """The task a config names. `source`: the artifact the config was read back from, if it was (its
    loss and metric components must then be trusted, see reference.py); `recorded`: the task's facts as
    training recorded them (`facts()`: number of classes, target columns, the primary metric)."""
    recorded = recorded or {}
    loss = _callable(task_cfg.loss, 2, source) if task_cfg.loss else None
    if task_cfg.name == "classification":
        return Classification(classes, task_cfg.top_k, loss, recorded.get("num_classes"))
    if task_cfg.name == "regression":
        return Regression(loss, recorded.get("columns"))
    metric = _callable(task_cfg.metric, 2, source)
    primary = recorded.get("primary") or short_name(task_cfg.metric.component).replace("-", "_")
    return Custom(loss, metric, task_cfg.metric_mode, primary)


def _callable(section: ComponentConfig, arity: int, source: ArtifactSource | None) -> Callable:
    """A loss or metric: a class is instantiated with args; a function gets args on every call."""
    key = section.KEY
    obj = resolve(key, section.component, source=source)
    if inspect.isclass(obj):
        instance = call(key, section.component, obj, section.args)
        if not callable(instance):
            raise ComponentError(f"{key}.component '{section.component}' built a {type(instance).__name__}, "
                                 "which is not callable as (outputs, target)")
        return instance
    try:
        inspect.signature(obj).bind(*([None] * arity), **section.args)
    except TypeError as exc:
        raise ComponentError(f"{key}: {section.component}{plain_signature(inspect.signature(obj))} can't be called as "
                             f"(outputs, target, **args) with args {section.args}: {exc}") from None
    except ValueError:  # no signature to check
        pass
    return functools.partial(obj, **section.args)


def _reduce_sums(state: dict[str, torch.Tensor], info) -> None:
    if info.distributed:
        for value in state.values():
            if torch.is_tensor(value):
                dist.all_reduce(value)


def _gather_in_order(parts: list[torch.Tensor], info) -> torch.Tensor:
    """This rank's rows (samples r, r+W, ... of the split) from every rank, back in the split's order."""
    mine = torch.cat(parts) if parts else torch.empty(0)
    if not info.distributed:
        return mine
    shards = [None] * info.world_size
    dist.all_gather_object(shards, mine)
    total = sum(len(s) for s in shards)
    shape = next(s.shape[1:] for s in shards if len(s))
    dtype = next(s.dtype for s in shards if len(s))
    out = torch.empty((total, *shape), dtype=dtype)
    for rank, shard in enumerate(shards):
        if len(shard):
            out[rank::info.world_size] = shard
    return out


class Classification:
    name = "classification"
    output_names = ("logits", "probabilities")
    primary, mode = "accuracy", "max"
    probe_rows = 2  # validation samples a first forward checks the model on

    def __init__(self, classes: list[str] | None, top_k: int, loss: Callable | None = None,
                 num_classes: int | None = None):
        self.classes = classes
        self.num_classes = len(classes) if classes else num_classes
        self.top_k = top_k
        self._loss = loss

    @property
    def labels(self) -> list[str]:
        return self.classes or [str(i) for i in range(self.num_classes)]

    def facts(self) -> dict[str, Any]:
        return {"name": self.name, "num_classes": self.num_classes, "labels": self.labels, "primary": self.primary,
                "mode": self.mode}

    def check_output(self, output: Any, target: torch.Tensor, where: str) -> None:
        """After one forward on real samples: logits (batch, classes) that fit the data's classes."""
        rows = len(target)
        if not torch.is_tensor(output) or output.dim() != 2 or output.shape[0] != rows:
            raise TaskError(f"{where}: for classification the model must return logits of shape (batch, classes); "
                            f"on {rows} samples it returned {_shape_of(output)}")
        if self.num_classes is None:
            self.num_classes = output.shape[1]  # the data names no classes: the model says how many
        elif output.shape[1] != self.num_classes:
            raise TaskError(f"{where}: the model returns {output.shape[1]} logits per sample but the data has "
                            f"{self.num_classes} classes (the training set's `classes`); set model.args.num_classes="
                            f"{self.num_classes}, or the argument your model sizes its output with")
        if int(target.max()) >= self.num_classes:
            raise TaskError(f"{where}: class index {int(target.max())} for a model with {self.num_classes} outputs")

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._loss(output, target) if self._loss else F.cross_entropy(output, target)

    def check_metric(self, output: torch.Tensor, target: torch.Tensor, where: str) -> None:
        """Built-in metrics need no check."""

    def new_state(self, device: torch.device) -> dict:
        zeros = functools.partial(torch.zeros, dtype=torch.float64, device=device)
        return {"confusion": zeros(self.num_classes, self.num_classes), "loss": zeros(()), "topk": zeros(())}

    def update(self, state: dict, output: torch.Tensor, target: torch.Tensor) -> None:
        output = output.float()
        state["loss"] += self.loss(output, target).double() * len(target)
        state["confusion"].index_put_((target, output.argmax(1)), torch.ones_like(target, dtype=torch.float64),
                                      accumulate=True)
        if self._k:
            hits = (output.topk(self._k, dim=1).indices == target[:, None]).any(1)
            state["topk"] += hits.sum().double()

    @property
    def _k(self) -> int | None:
        return self.top_k if self.top_k < self.num_classes else None

    def reduce(self, state: dict, info) -> None:
        _reduce_sums(state, info)

    def metrics(self, state: dict) -> dict[str, float]:
        total = state["confusion"].sum().item()
        out = {"accuracy": state["confusion"].diagonal().sum().item() / total}
        if self._k:
            out[f"top{self._k}_accuracy"] = state["topk"].item() / total
        out["loss"] = state["loss"].item() / total
        return out

    def plot(self, state: dict, path: Path) -> Path | None:
        if self.num_classes > MAX_CONFUSION_PLOT:
            return None
        from pipeline.components.plots import confusion_matrix_png

        return confusion_matrix_png(state["confusion"].cpu(), self.labels, path.with_name("confusion_matrix.png"))

    def outputs(self, output: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return output, torch.softmax(output, dim=1)


class Regression:
    name = "regression"
    output_names = ("prediction",)
    primary, mode = "rmse", "min"
    probe_rows = 2

    def __init__(self, loss: Callable | None = None, columns: int | None = None):
        self._loss = loss
        self.columns = columns  # target values per sample: learned from the data by the probe, or recorded

    def facts(self) -> dict[str, Any]:
        return {"name": self.name, "columns": self.columns, "primary": self.primary, "mode": self.mode}

    def check_output(self, output: Any, target: torch.Tensor, where: str) -> None:
        if not torch.is_tensor(output) or not output.is_floating_point():
            raise TaskError(f"{where}: for regression the model must return a float tensor, got {_shape_of(output)}")
        try:
            _aligned(output, target)
        except ValueError:
            raise TaskError(f"{where}: the model returns {_shape_of(output)} for targets of shape "
                            f"{list(target.shape)}; for regression it must return the target's shape "
                            "((batch,) or (batch, 1) for one value per sample, (batch, k) for k)") from None
        self.columns = 1 if target.dim() == 1 else target.shape[1]

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        prediction = _aligned(output, target)
        return self._loss(prediction, target) if self._loss else F.mse_loss(prediction.float(), target.float())

    def check_metric(self, output: torch.Tensor, target: torch.Tensor, where: str) -> None:
        """Built-in metrics need no check."""

    def new_state(self, device: torch.device) -> dict:
        zeros = functools.partial(torch.zeros, dtype=torch.float64, device=device)
        k = self.columns or 1
        return {"n": zeros(()), "loss": zeros(()), "sse": zeros(k), "sae": zeros(k), "sy": zeros(k), "syy": zeros(k),
                "points": []}

    def update(self, state: dict, output: torch.Tensor, target: torch.Tensor) -> None:
        prediction = _aligned(output.float(), target).double().reshape(len(target), -1)
        actual = target.double().reshape(len(target), -1)
        error = prediction - actual
        state["n"] += len(target)
        state["loss"] += self.loss(output.float(), target.float()).double() * len(target)
        state["sse"] += (error * error).sum(0)
        state["sae"] += error.abs().sum(0)
        state["sy"] += actual.sum(0)
        state["syy"] += (actual * actual).sum(0)
        if sum(len(p) for p in state["points"]) < PLOT_POINTS:
            state["points"].append(torch.stack([prediction[:, 0], actual[:, 0]], 1).cpu())

    def reduce(self, state: dict, info) -> None:
        _reduce_sums(state, info)
        state["points"] = [_gather_in_order(state["points"], info)[:PLOT_POINTS]]

    def metrics(self, state: dict) -> dict[str, float]:
        n = state["n"].item()
        sse, sy, syy = state["sse"], state["sy"], state["syy"]
        total = syy - sy * sy / n  # sum of squares about the mean, per column
        r2 = torch.where(total > 0, 1 - sse / total.clamp_min(1e-300), torch.zeros_like(total))
        return {"rmse": math.sqrt(sse.sum().item() / (n * len(sse))), "mae": state["sae"].sum().item() / (n * len(sse)),
                "r2": r2.mean().item(), "loss": state["loss"].item() / n}

    def plot(self, state: dict, path: Path) -> Path | None:
        from pipeline.components.plots import predicted_vs_actual_png

        points = state["points"][0] if state["points"] else torch.empty(0, 2)
        title = f"validation: RMSE {self.metrics(state)['rmse']:.4g} over {int(state['n'].item())} samples"
        return predicted_vs_actual_png(points[:, 0], points[:, 1], path.with_name("predicted_vs_actual.png"), title)

    def outputs(self, output: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (output,)


def _aligned(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The prediction in the target's shape: (batch, 1) outputs for (batch,) targets are squeezed."""
    if output.shape == target.shape:
        return output
    if target.dim() == 1 and output.dim() == 2 and output.shape == (len(target), 1):
        return output[:, 0]
    raise ValueError(f"output {list(output.shape)} vs target {list(target.shape)}")


class Custom:
    name = "custom"
    output_names = ("output",)
    probe_rows = 16  # a metric may need more than a couple of samples (an AUC needs both classes)

    def __init__(self, loss: Callable, metric: Callable, mode: str, metric_name: str):
        self._loss, self._metric = loss, metric
        self.mode = mode
        self.primary = metric_name  # until the metric returns a dict: then its first key

    def facts(self) -> dict[str, Any]:
        return {"name": self.name, "primary": self.primary, "mode": self.mode}

    def check_output(self, output: Any, target: Any, where: str) -> None:
        if not torch.is_tensor(output):
            raise TaskError(f"{where}: the model must return one tensor (exported as `output`), got {_shape_of(output)}")
        if not torch.is_tensor(target):
            raise TaskError(f"{where}: custom tasks need tensor targets (the default collate makes them from numbers "
                            f"and arrays), got {type(target).__name__}")
        value = self._loss(output.float(), target)
        if not (torch.is_tensor(value) and value.dim() == 0):
            raise TaskError(f"{where}: task.loss must return a scalar tensor, got {_shape_of(value)}")

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._loss(output, target)

    def check_metric(self, output: torch.Tensor, target: torch.Tensor, where: str) -> None:
        """The metric runs on the probe's outputs and gives numbers; its first name becomes the primary."""
        self._named(self._call_metric(output.detach().float(), target, where), where)

    def _call_metric(self, outputs: torch.Tensor, targets: torch.Tensor, where: str):
        try:
            return self._metric(outputs, targets)
        except Exception as exc:
            raise TaskError(f"{where}: task.metric raised {type(exc).__name__}: {exc}") from exc

    def new_state(self, device: torch.device) -> dict:
        return {"n": torch.zeros((), dtype=torch.float64, device=device),
                "loss": torch.zeros((), dtype=torch.float64, device=device), "outputs": [], "targets": []}

    def update(self, state: dict, output: torch.Tensor, target: torch.Tensor) -> None:
        state["n"] += len(target)
        state["loss"] += self._loss(output.float(), target).double() * len(target)
        state["outputs"].append(output.detach().float().cpu())
        state["targets"].append(target.detach().cpu())

    def reduce(self, state: dict, info) -> None:
        _reduce_sums(state, info)
        state["outputs"] = [_gather_in_order(state["outputs"], info)]
        state["targets"] = [_gather_in_order(state["targets"], info)]

    def metrics(self, state: dict) -> dict[str, float]:
        value = self._call_metric(state["outputs"][0], state["targets"][0], "the validation split")
        values = self._named(value, "the validation split")
        return {**values, "loss": state["loss"].item() / state["n"].item()}

    def _named(self, value: Any, where: str) -> dict[str, float]:
        """{name: float} of what the metric returned; its first name becomes the primary metric."""
        try:
            if isinstance(value, dict) and value:
                named = {str(k): float(v) for k, v in value.items()}
                self.primary = next(iter(named))
                return named
            return {self.primary: float(value)}
        except (TypeError, ValueError):
            raise TaskError(f"{where}: task.metric must return a number or a dict of numbers, got "
                            f"{_shape_of(value) if torch.is_tensor(value) else repr(value)[:80]}") from None

    def plot(self, state: dict, path: Path) -> Path | None:
        return None

    def outputs(self, output: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (output,)


def _shape_of(value: Any) -> str:
    if torch.is_tensor(value):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {list(value.shape)}"
    return f"a {type(value).__name__}"
