"""What the tasks that predict classes share: classification (a class per sample), segmentation (per
pixel) and token classification (per token).

The model's prediction is logits with a score per class (its lone tensor, `task.output`, or
`logits`, as a transformers model returns them); the loss is cross-entropy unless `task.loss` names
another; validation sums a confusion matrix (exact across ranks: every rank adds its counts), drawn
as the run's figure; the graph also returns `probabilities`, the softmax over the classes, laid out
with the classes on axis 1: that is what `decision` means to the gates and to the server (its argmax
over axis 1 is the answer), so a class per sample, per pixel and per token are decided, compared and
scored the same way. The gates hold the primary metric (a fraction) within
export.accuracy_tolerance_pp points; `num_classes` follows from the training set's `classes`.

A subclass says what its target and logits look like (`check_target`, `check_output`), its settings
from the config (`options`), what it counts on a validation batch (`update`, over `new_state`) and
reports (`metrics`), and how one served answer reads (`describe`).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pipeline.artifact import gates
from pipeline.components.data import DataError
from pipeline.tasks.base import (
    ModelOutputs,
    TaskError,
    component_callable,
    reduce_sums,
    refuse_others_settings,
    suggest_num_classes,
)

# classes beyond which a confusion matrix is unreadable
MAX_CONFUSION_PLOT = 50


class ClassTask(ModelOutputs):
    mode = "max"
    # validation samples a first forward checks the model on
    probe_rows = 2
    single_name, preferred, derived, decides = "logits", ("logits",), ("probabilities",), True

    def __init__(self, classes: list[str] | None, loss=None, num_classes: int | None = None):
        self.classes = classes
        # else learned by the probe, or recorded
        self.num_classes = len(classes) if classes else num_classes
        self._loss = loss

    @classmethod
    def from_config(cls, task_cfg, classes, source, recorded: dict) -> "ClassTask":
        loss = component_callable(task_cfg.loss, 2, source) if task_cfg.loss else None
        task = cls(
            classes, loss=loss, num_classes=recorded.get("num_classes"), **cls.options(task_cfg)
        )
        task.restore_outputs(recorded, task_cfg.output)
        return task

    @staticmethod
    def options(task_cfg) -> dict[str, Any]:
        """The task's own settings from the config, as keyword arguments of its constructor."""
        return {}

    @staticmethod
    def check_config(task_cfg) -> None:
        refuse_others_settings(task_cfg)

    @staticmethod
    def check_data(classes, where: str) -> None:
        """Any data: `classes` are optional (the model then says how many)."""

    def suggest(self, classes: list[str] | None) -> dict[str, Any]:
        return suggest_num_classes(classes)

    @property
    def labels(self) -> list[str]:
        return self.classes or [str(i) for i in range(self.num_classes)]

    def facts(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_classes": self.num_classes,
            "labels": self.labels,
            "primary": self.primary,
            "mode": self.mode,
            **self.output_facts(),
        }

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        return self.class_loss(self.predicted(output), target)

    def class_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """task.loss when given, else cross-entropy over axis 1 (per sample, or per pixel)."""
        return self._loss(logits, target) if self._loss else F.cross_entropy(logits, target)

    def check_metric(self, output: Any, target: torch.Tensor, where: str) -> None:
        """Built-in metrics need no check."""

    def derive(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"probabilities": torch.softmax(named[self.prediction], dim=1)}

    # --- validation metrics: sums over the split ------------------------------------------------

    def new_state(self, device: torch.device) -> dict:
        zeros = functools.partial(torch.zeros, dtype=torch.float64, device=device)
        return {
            "confusion": zeros(self.num_classes, self.num_classes),
            "loss": zeros(()),
            "n": zeros(()),
        }

    def update(self, state: dict, named: dict[str, torch.Tensor], target: torch.Tensor) -> None:
        logits = named[self.prediction].float()
        state["loss"] += self.class_loss(logits, target).double() * len(target)
        state["n"] += len(target)
        add_confusion(state["confusion"], target, logits.argmax(1))

    def reduce(self, state: dict, info) -> None:
        reduce_sums(state, info)

    def plot(self, state: dict, path: Path, subject: str = "validation") -> Path | None:
        if len(self.labels) > MAX_CONFUSION_PLOT:
            return None
        from pipeline.artifact.plots import confusion_matrix_png

        return confusion_matrix_png(
            state["confusion"].cpu(), self.labels, path.with_name("confusion_matrix.png"), subject
        )

    # --- export ----------------------------------------------------------------------------------

    def gate_limits(self, export_cfg, variant: str = "fp32") -> dict[str, Any]:
        """The primary metric within export.accuracy_tolerance_pp; for fp16, probabilities and
        decisions carry the gate; for int8, decisions alone (logits move by whole quantization
        steps, so no element-wise limit: atol is infinite) and the metric within
        export.int8_accuracy_tolerance_pp."""
        if variant == "int8":
            return {
                "atol": float("inf"),
                "min_agreement": export_cfg.int8_min_agreement,
                "tolerance": export_cfg.int8_accuracy_tolerance_pp,
            }
        if variant != "fp16":
            return {"tolerance": export_cfg.accuracy_tolerance_pp}
        return {
            "prob_atol": gates.FP16_PROB_ATOL,
            "min_agreement": gates.FP16_MIN_AGREEMENT,
            "tolerance": max(export_cfg.accuracy_tolerance_pp, gates.FP16_ACCURACY_PP),
        }

    def metric_gate(
        self, onnx_metrics: dict, torch_metrics: dict, tolerance: float, atol: float
    ) -> dict:
        return gates.points_gate(
            self.primary, onnx_metrics[self.primary], torch_metrics[self.primary], tolerance
        )

    def baseline(self, state: dict) -> dict[str, Any]:
        """Always the most frequent class (per sample, pixel or token): its confusion matrix is the
        true counts in one column, scored by this task's own metrics."""
        counts = state["confusion"].sum(1)
        majority = int(counts.argmax())
        trivial = torch.zeros_like(state["confusion"])
        trivial[:, majority] = counts
        return {
            "value": self.metrics({**state, "confusion": trivial})[self.primary],
            "predictor": f"always class {self.labels[majority]}, the most frequent",
        }


def check_index(value: int, classes: list[str] | None, where: str) -> None:
    if value < 0 or (classes is not None and value >= len(classes)):
        raise DataError(
            f"{where}: class index {value} is outside 0..{len(classes) - 1 if classes else 'N-1'}"
            + (f" (the training set has {len(classes)} classes)" if classes else "")
        )


def check_class_count(found: int, expected: int | None, where: str, per: str = "sample") -> int:
    """The model's number of class scores, against the data's classes (None: the model says how
    many)."""
    if expected is not None and found != expected:
        raise TaskError(
            f"{where}: the model returns {found} logits per {per} but the data has {expected} classes "
            f"(the training set's `classes`); set model.args.num_classes={expected}, or the argument "
            "your model sizes its output with"
        )
    return found


def add_confusion(confusion: torch.Tensor, target: torch.Tensor, predicted: torch.Tensor) -> None:
    target, predicted = target.reshape(-1), predicted.reshape(-1)
    confusion.index_put_(
        (target, predicted), torch.ones_like(target, dtype=torch.float64), accumulate=True
    )
