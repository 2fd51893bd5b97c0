"""classification: one class per sample. Cross-entropy; accuracy, top-k accuracy (k < classes),
loss; a confusion matrix. The prediction is the model's lone tensor, `task.output`, or `logits` (a
transformers classifier's output as it is); the graph also returns `probabilities`, its softmax.
What it shares with the other tasks that predict classes: classes.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pipeline.components.data import DataError
from pipeline.tasks.base import TaskError, describe_value, shape_of
from pipeline.tasks.classes import ClassTask, check_class_count, check_index


class Classification(ClassTask):
    name = "classification"
    primary = "accuracy"

    def __init__(
        self, classes: list[str] | None, top_k: int, loss=None, num_classes: int | None = None
    ):
        super().__init__(classes, loss, num_classes)
        self.top_k = top_k

    @staticmethod
    def options(task_cfg) -> dict[str, Any]:
        return {"top_k": task_cfg.top_k}

    @staticmethod
    def check_target(target: Any, classes: list[str] | None, where: str) -> None:
        """An int64 class index (a 0-d torch.long tensor or an int) inside the training set's
        classes."""
        if isinstance(target, bool) or not (
            isinstance(target, int)
            or (torch.is_tensor(target) and target.dtype == torch.int64 and target.dim() == 0)
        ):
            raise DataError(
                f"{where}: the target is {describe_value(target)}; classification needs an int64 class "
                f"index (a 0-d torch.long tensor or an int){_fix(target)}"
            )
        check_index(int(target), classes, where)

    def check_output(self, output: Any, target: torch.Tensor, where: str) -> None:
        """After one forward on real samples: logits (batch, classes) that fit the data's
        classes."""
        logits = self.learn_outputs(output, target, where)[self.prediction]
        rows = len(target)
        if logits.dim() != 2:
            raise TaskError(
                f"{where}: for classification the model's {self.prediction} must have shape (batch, "
                f"classes); on {rows} samples it is {shape_of(logits)}"
            )
        self.num_classes = check_class_count(logits.shape[1], self.num_classes, where)
        if int(target.max()) >= self.num_classes:
            raise TaskError(
                f"{where}: class index {int(target.max())} for a model with {self.num_classes} outputs"
            )

    def new_state(self, device: torch.device) -> dict:
        return {
            **super().new_state(device),
            "topk": torch.zeros((), dtype=torch.float64, device=device),
        }

    def update(self, state: dict, named: dict[str, torch.Tensor], target: torch.Tensor) -> None:
        super().update(state, named, target)
        if self._k:
            hits = (
                named[self.prediction].float().topk(self._k, dim=1).indices == target[:, None]
            ).any(1)
            state["topk"] += hits.sum().double()

    @property
    def _k(self) -> int | None:
        return self.top_k if self.top_k < self.num_classes else None

    def metrics(self, state: dict) -> dict[str, float]:
        total = state["confusion"].sum().item()
        out = {"accuracy": state["confusion"].diagonal().sum().item() / total}
        if self._k:
            out[f"top{self._k}_accuracy"] = state["topk"].item() / total
        out["loss"] = state["loss"].item() / total
        return out

    def describe(self, answer: dict[str, np.ndarray], target) -> str:
        probabilities = answer["probabilities"][0]
        label, predicted = int(target[0]), int(probabilities.argmax())
        return (
            f"a real '{self.labels[label]}' from the validation split -> predicted '{self.labels[predicted]}' "
            f"(p={probabilities[predicted]:.3f}), {'correct' if predicted == label else 'WRONG'}"
        )


def _fix(target: Any) -> str:
    """What to change for a target that is not a class index: the task it fits, else how to make
    one."""
    if torch.is_tensor(target) and target.is_floating_point():
        return "; for regression targets set task.name=regression"
    if torch.is_tensor(target) and not target.is_floating_point() and target.dim() == 1:
        return (
            "; for a class per token (per-token labels, the positions to leave out marked -100) set "
            "task.name=token_classification"
        )
    if torch.is_tensor(target) and not target.is_floating_point() and target.dim() == 2:
        return "; for a class per pixel (an H x W mask) set task.name=segmentation"
    return "; use torch.tensor(label, dtype=torch.long)"
