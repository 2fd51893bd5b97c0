"""segmentation: one class per pixel. The model returns N x C x H x W logits (its lone tensor,
`task.output`, or `logits`), the data N x H x W int64 class indices (H x W per sample). Per-pixel
cross-entropy; mean IoU (over the classes present in the target or the prediction), pixel accuracy,
loss; a per-pixel confusion matrix. The graph also returns per-pixel `probabilities` (softmax over C),
and the gates count agreement of the per-pixel argmax, not of a flattened one."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.components import gates
from pipeline.components.data import DataError
from pipeline.tasks.base import ModelOutputs, TaskError, component_callable, reduce_sums, shape_of, suggest_num_classes
from pipeline.tasks.classification import (add_confusion, check_class_count, class_gate_limits, class_loss,
                                           confusion_plot, describe_value, probabilities, refuse_custom_parts)


class Segmentation(ModelOutputs):
    name = "segmentation"
    primary, mode = "mean_iou", "max"
    probe_rows = 2
    single_name, preferred, derived, decides = "logits", ("logits",), ("probabilities",), True

    def __init__(self, classes: list[str] | None, loss=None, num_classes: int | None = None):
        self.classes = classes
        self.num_classes = len(classes) if classes else num_classes
        self._loss = loss

    @classmethod
    def from_config(cls, task_cfg, classes, source, recorded: dict) -> "Segmentation":
        loss = component_callable(task_cfg.loss, 2, source) if task_cfg.loss else None
        task = cls(classes, loss, recorded.get("num_classes"))
        task.restore_outputs(recorded, task_cfg.output)
        return task

    @staticmethod
    def check_config(task_cfg) -> None:
        refuse_custom_parts(task_cfg)

    @staticmethod
    def check_data(classes, where: str) -> None:
        """`classes` are optional (the model then says how many)."""

    @staticmethod
    def check_target(target: Any, classes: list[str] | None, where: str) -> None:
        """An H x W int64 tensor of class indices inside the training set's classes."""
        if not (torch.is_tensor(target) and target.dtype == torch.int64 and target.dim() == 2):
            raise DataError(f"{where}: the target is {describe_value(target)}; segmentation needs an H x W int64 "
                            "tensor of class indices per sample (torch.as_tensor(mask, dtype=torch.long))")
        low, high = int(target.min()), int(target.max())
        if low < 0 or (classes is not None and high >= len(classes)):
            raise DataError(f"{where}: the mask holds class indices {low}..{high}, outside 0.."
                            f"{len(classes) - 1 if classes else 'N-1'}"
                            + (f" (the training set has {len(classes)} classes)" if classes else ""))

    def suggest(self, classes) -> dict[str, Any]:
        return suggest_num_classes(classes)

    @property
    def labels(self) -> list[str]:
        return self.classes or [str(i) for i in range(self.num_classes)]

    def facts(self) -> dict[str, Any]:
        return {"name": self.name, "num_classes": self.num_classes, "labels": self.labels, "primary": self.primary,
                "mode": self.mode, **self.output_facts()}

    def check_output(self, output: Any, target: torch.Tensor, where: str) -> None:
        logits = self.learn_outputs(output, target, where)[self.prediction]
        if logits.dim() != 4 or logits.shape[2:] != target.shape[1:]:
            raise TaskError(f"{where}: for segmentation the model's {self.prediction} must be (batch, classes, H, W) "
                            f"for masks of shape {list(target.shape)}; it is {shape_of(logits)}")
        self.num_classes = check_class_count(logits.shape[1], self.num_classes, where)

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        return class_loss(self._loss, self.predicted(output), target)

    def check_metric(self, output: Any, target: torch.Tensor, where: str) -> None:
        """Built-in metrics need no check."""

    def derive(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return probabilities(named[self.prediction])

    def new_state(self, device: torch.device) -> dict:
        zeros = functools.partial(torch.zeros, dtype=torch.float64, device=device)
        return {"confusion": zeros(self.num_classes, self.num_classes), "loss": zeros(()), "n": zeros(())}

    def update(self, state: dict, named: dict[str, torch.Tensor], target: torch.Tensor) -> None:
        logits = named[self.prediction].float()
        state["loss"] += class_loss(self._loss, logits, target).double() * len(target)
        state["n"] += len(target)
        add_confusion(state["confusion"], target, logits.argmax(1))

    def reduce(self, state: dict, info) -> None:
        reduce_sums(state, info)

    def metrics(self, state: dict) -> dict[str, float]:
        confusion = state["confusion"]
        hits = confusion.diagonal()
        union = confusion.sum(0) + confusion.sum(1) - hits
        present = union > 0
        return {"mean_iou": (hits[present] / union[present]).mean().item() if present.any() else 0.0,
                "pixel_accuracy": hits.sum().item() / confusion.sum().item(),
                "loss": state["loss"].item() / state["n"].item()}

    def plot(self, state: dict, path: Path, subject: str = "validation") -> Path | None:
        return confusion_plot(state, self.labels, path, subject)

    def gate_limits(self, export_cfg, variant: str = "fp32") -> dict[str, Any]:
        return class_gate_limits(export_cfg, variant)

    def metric_gate(self, onnx_metrics: dict, torch_metrics: dict, tolerance: float, atol: float) -> dict:
        return gates.points_gate("mean_iou", onnx_metrics["mean_iou"], torch_metrics["mean_iou"], tolerance)

    def describe(self, answer: dict[str, np.ndarray], target) -> str:
        predicted = answer["probabilities"][0].argmax(0)
        truth = np.asarray(target[0])
        agree = float((predicted == truth).mean())
        found = sorted({self.labels[i] for i in np.unique(predicted)})
        return (f"a real {truth.shape[0]}x{truth.shape[1]} mask from the validation split -> {agree:.1%} of its pixels "
                f"right, classes found: {', '.join(found[:6])}{' ...' if len(found) > 6 else ''}")
