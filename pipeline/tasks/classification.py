"""classification: one class per sample. Cross-entropy; accuracy, top-k accuracy (k < classes), loss;
a confusion matrix. The prediction is the model's lone tensor, `task.output`, or `logits` (a
transformers classifier's output as it is); the graph also returns `probabilities`, its softmax."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.components import gates
from pipeline.components.data import DataError
from pipeline.tasks.base import ModelOutputs, TaskError, component_callable, reduce_sums, shape_of, suggest_num_classes

MAX_CONFUSION_PLOT = 50  # classes beyond which a confusion matrix is unreadable


class Classification(ModelOutputs):
    name = "classification"
    primary, mode = "accuracy", "max"
    probe_rows = 2  # validation samples a first forward checks the model on
    single_name, preferred, derived, decides = "logits", ("logits",), ("probabilities",), True

    def __init__(self, classes: list[str] | None, top_k: int, loss=None, num_classes: int | None = None):
        self.classes = classes
        self.num_classes = len(classes) if classes else num_classes
        self.top_k = top_k
        self._loss = loss

    @classmethod
    def from_config(cls, task_cfg, classes, source, recorded: dict) -> "Classification":
        loss = component_callable(task_cfg.loss, 2, source) if task_cfg.loss else None
        task = cls(classes, task_cfg.top_k, loss, recorded.get("num_classes"))
        task.restore_outputs(recorded, task_cfg.output)
        return task

    @staticmethod
    def check_config(task_cfg) -> None:
        refuse_custom_parts(task_cfg)

    # --- the data ------------------------------------------------------------------------------

    @staticmethod
    def check_data(classes, where: str) -> None:
        """Any data: `classes` are optional (the model then says how many)."""

    @staticmethod
    def check_target(target: Any, classes: list[str] | None, where: str) -> None:
        """An int64 class index (a 0-d torch.long tensor or an int) inside the training set's classes."""
        if isinstance(target, bool) or not (isinstance(target, int) or (
                torch.is_tensor(target) and target.dtype == torch.int64 and target.dim() == 0)):
            fix = ("; for regression targets set task.name=regression" if torch.is_tensor(target)
                   and target.is_floating_point() else "; use torch.tensor(label, dtype=torch.long)")
            raise DataError(f"{where}: the target is {describe_value(target)}; classification needs an int64 class "
                            f"index (a 0-d torch.long tensor or an int){fix}")
        check_index(int(target), classes, where)

    def suggest(self, classes: list[str] | None) -> dict[str, Any]:
        return suggest_num_classes(classes)

    # --- the model's outputs -------------------------------------------------------------------

    @property
    def labels(self) -> list[str]:
        return self.classes or [str(i) for i in range(self.num_classes)]

    def facts(self) -> dict[str, Any]:
        return {"name": self.name, "num_classes": self.num_classes, "labels": self.labels, "primary": self.primary,
                "mode": self.mode, **self.output_facts()}

    def check_output(self, output: Any, target: torch.Tensor, where: str) -> None:
        """After one forward on real samples: logits (batch, classes) that fit the data's classes."""
        logits = self.learn_outputs(output, target, where)[self.prediction]
        rows = len(target)
        if logits.dim() != 2:
            raise TaskError(f"{where}: for classification the model's {self.prediction} must have shape (batch, "
                            f"classes); on {rows} samples it is {shape_of(logits)}")
        self.num_classes = check_class_count(logits.shape[1], self.num_classes, where)
        if int(target.max()) >= self.num_classes:
            raise TaskError(f"{where}: class index {int(target.max())} for a model with {self.num_classes} outputs")

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        return class_loss(self._loss, self.predicted(output), target)

    def check_metric(self, output: Any, target: torch.Tensor, where: str) -> None:
        """Built-in metrics need no check."""

    def derive(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return probabilities(named[self.prediction])

    # --- validation metrics --------------------------------------------------------------------

    def new_state(self, device: torch.device) -> dict:
        zeros = functools.partial(torch.zeros, dtype=torch.float64, device=device)
        return {"confusion": zeros(self.num_classes, self.num_classes), "loss": zeros(()), "topk": zeros(())}

    def update(self, state: dict, named: dict[str, torch.Tensor], target: torch.Tensor) -> None:
        logits = named[self.prediction].float()
        state["loss"] += class_loss(self._loss, logits, target).double() * len(target)
        add_confusion(state["confusion"], target, logits.argmax(1))
        if self._k:
            hits = (logits.topk(self._k, dim=1).indices == target[:, None]).any(1)
            state["topk"] += hits.sum().double()

    @property
    def _k(self) -> int | None:
        return self.top_k if self.top_k < self.num_classes else None

    def reduce(self, state: dict, info) -> None:
        reduce_sums(state, info)

    def metrics(self, state: dict) -> dict[str, float]:
        total = state["confusion"].sum().item()
        out = {"accuracy": state["confusion"].diagonal().sum().item() / total}
        if self._k:
            out[f"top{self._k}_accuracy"] = state["topk"].item() / total
        out["loss"] = state["loss"].item() / total
        return out

    def plot(self, state: dict, path: Path, subject: str = "validation") -> Path | None:
        return confusion_plot(state, self.labels, path, subject)

    # --- export and serving --------------------------------------------------------------------

    def gate_limits(self, export_cfg, variant: str = "fp32") -> dict[str, Any]:
        return class_gate_limits(export_cfg, variant)

    def metric_gate(self, onnx_metrics: dict, torch_metrics: dict, tolerance: float, atol: float) -> dict:
        return gates.points_gate("accuracy", onnx_metrics["accuracy"], torch_metrics["accuracy"], tolerance)

    def describe(self, answer: dict[str, np.ndarray], target) -> str:
        probabilities = answer["probabilities"][0]
        label, predicted = int(target[0]), int(probabilities.argmax())
        return (f"a real '{self.labels[label]}' from the validation split -> predicted '{self.labels[predicted]}' "
                f"(p={probabilities[predicted]:.3f}), {'correct' if predicted == label else 'WRONG'}")


# --- shared with the other tasks that predict classes (segmentation) -----------------------------


def class_loss(custom, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """task.loss when given, else cross-entropy over axis 1 (per sample, or per pixel)."""
    return custom(logits, target) if custom else F.cross_entropy(logits, target)


def probabilities(logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """The output the graph adds for a task that predicts classes: the softmax over axis 1."""
    return {"probabilities": torch.softmax(logits, dim=1)}


def refuse_custom_parts(task_cfg) -> None:
    given = [k for k in ("metric", "metric_mode") if getattr(task_cfg, k) is not None]
    if given:
        raise ValueError(f"{', '.join('task.' + k for k in given)} only apply to task.name=custom; "
                         f"{task_cfg.name} has its own metrics (set task.name=custom to use yours)")


def check_index(value: int, classes: list[str] | None, where: str) -> None:
    if value < 0 or (classes is not None and value >= len(classes)):
        raise DataError(f"{where}: class index {value} is outside 0..{len(classes) - 1 if classes else 'N-1'}"
                        + (f" (the training set has {len(classes)} classes)" if classes else ""))


def check_class_count(found: int, expected: int | None, where: str) -> int:
    """The model's number of class scores, against the data's classes (None: the model says how many)."""
    if expected is not None and found != expected:
        raise TaskError(f"{where}: the model returns {found} logits per sample but the data has {expected} classes "
                        f"(the training set's `classes`); set model.args.num_classes={expected}, or the argument "
                        "your model sizes its output with")
    return found


def add_confusion(confusion: torch.Tensor, target: torch.Tensor, predicted: torch.Tensor) -> None:
    target, predicted = target.reshape(-1), predicted.reshape(-1)
    confusion.index_put_((target, predicted), torch.ones_like(target, dtype=torch.float64), accumulate=True)


def confusion_plot(state: dict, labels: list[str], path: Path, subject: str = "validation") -> Path | None:
    if len(labels) > MAX_CONFUSION_PLOT:
        return None
    from pipeline.components.plots import confusion_matrix_png

    return confusion_matrix_png(state["confusion"].cpu(), labels, path.with_name("confusion_matrix.png"), subject)


def class_gate_limits(export_cfg, variant: str = "fp32") -> dict[str, Any]:
    """Accuracy within export.accuracy_tolerance_pp; for fp16, probabilities and decisions carry the gate; for
    int8, decisions alone (logits move by whole quantization steps, so no element-wise limit: atol is infinite)
    and accuracy within export.int8_accuracy_tolerance_pp."""
    if variant == "int8":
        return {"atol": float("inf"), "min_agreement": export_cfg.int8_min_agreement,
                "tolerance": export_cfg.int8_accuracy_tolerance_pp}
    if variant != "fp16":
        return {"tolerance": export_cfg.accuracy_tolerance_pp}
    return {"prob_atol": gates.FP16_PROB_ATOL, "min_agreement": gates.FP16_MIN_AGREEMENT,
            "tolerance": max(export_cfg.accuracy_tolerance_pp, gates.FP16_ACCURACY_PP)}


def describe_value(value: Any) -> str:
    if torch.is_tensor(value):
        return shape_of(value)
    return f"a {type(value).__name__} ({value!r:.40})"
