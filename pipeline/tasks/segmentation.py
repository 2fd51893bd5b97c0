"""segmentation: one class per pixel. The model returns N x C x H x W logits (its lone tensor,
`task.output`, or `logits`), the data N x H x W int64 class indices (H x W per sample). Per-pixel
cross-entropy; mean IoU (over the classes present in the target or the prediction), pixel accuracy,
loss; a per-pixel confusion matrix. The graph also returns per-pixel `probabilities` (softmax over
C), and the gates count agreement of the per-pixel argmax, not of a flattened one. What it shares
with the other tasks that predict classes: classes.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pipeline.components.data import DataError
from pipeline.tasks.base import TaskError, describe_value, shape_of
from pipeline.tasks.classes import ClassTask, check_class_count


class Segmentation(ClassTask):
    name = "segmentation"
    primary = "mean_iou"

    @staticmethod
    def check_target(target: Any, classes: list[str] | None, where: str) -> None:
        """An H x W int64 tensor of class indices inside the training set's classes."""
        if not (torch.is_tensor(target) and target.dtype == torch.int64 and target.dim() == 2):
            raise DataError(
                f"{where}: the target is {describe_value(target)}; segmentation needs an H x W int64 "
                "tensor of class indices per sample (torch.as_tensor(mask, dtype=torch.long))"
            )
        low, high = int(target.min()), int(target.max())
        if low < 0 or (classes is not None and high >= len(classes)):
            raise DataError(
                f"{where}: the mask holds class indices {low}..{high}, outside 0.."
                f"{len(classes) - 1 if classes else 'N-1'}"
                + (f" (the training set has {len(classes)} classes)" if classes else "")
            )

    def check_output(self, output: Any, target: torch.Tensor, where: str) -> None:
        logits = self.learn_outputs(output, target, where)[self.prediction]
        if logits.dim() != 4 or logits.shape[2:] != target.shape[1:]:
            raise TaskError(
                f"{where}: for segmentation the model's {self.prediction} must be (batch, classes, H, W) "
                f"for masks of shape {list(target.shape)}; it is {shape_of(logits)}"
            )
        self.num_classes = check_class_count(logits.shape[1], self.num_classes, where)

    def metrics(self, state: dict) -> dict[str, float]:
        confusion = state["confusion"]
        hits = confusion.diagonal()
        union = confusion.sum(0) + confusion.sum(1) - hits
        present = union > 0
        return {
            "mean_iou": (hits[present] / union[present]).mean().item() if present.any() else 0.0,
            "pixel_accuracy": hits.sum().item() / confusion.sum().item(),
            "loss": state["loss"].item() / state["n"].item(),
        }

    def describe(self, answer: dict[str, np.ndarray], target) -> str:
        predicted = answer["probabilities"][0].argmax(0)
        truth = np.asarray(target[0])
        agree = float((predicted == truth).mean())
        found = sorted({self.labels[i] for i in np.unique(predicted)})
        return (
            f"a real {truth.shape[0]}x{truth.shape[1]} mask from the validation split -> {agree:.1%} of its pixels "
            f"right, classes found: {', '.join(found[:6])}{' ...' if len(found) > 6 else ''}"
        )
