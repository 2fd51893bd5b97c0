"""token_classification: one class per token. The model returns N x L x C logits (its lone tensor,
`task.output`, or `logits`: a transformers `...ForTokenClassification` as it is), the data N x L
int64 class indices (L per sample), the positions to leave out (padding, a word's later sub-tokens)
marked with `task.ignore_index` (-100, as Hugging Face labels them). Cross-entropy over the tokens
kept; macro F1 (the mean, over the classes present in the targets or the predictions, of 2 TP / (2
TP + FP + FN)), per-token accuracy and loss, all over the tokens kept; a per-token confusion matrix.
Macro F1 is the primary metric: accuracy is mostly the most frequent tag's.

The graph also returns `probabilities`, N x C x L: the classes on axis 1, as every task that
predicts classes lays them out (classes.py), so the gates count agreement of the per-token argmax
and the server's shadow compares and scores a class per token. The logits stay as the model returns
them, N x L x C."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.components.data import DataError
from pipeline.tasks.base import TaskError, describe_value, refuse_others_settings, shape_of
from pipeline.tasks.classes import ClassTask, add_confusion, check_class_count

# torch's cross-entropy default, and what Hugging Face tokenizers' alignments write
IGNORE_INDEX = -100


class TokenClassification(ClassTask):
    name = "token_classification"
    primary = "macro_f1"

    def __init__(
        self,
        classes: list[str] | None,
        loss=None,
        num_classes: int | None = None,
        ignore_index: int = IGNORE_INDEX,
    ):
        super().__init__(classes, loss, num_classes)
        self.ignore_index = ignore_index

    @staticmethod
    def options(task_cfg) -> dict[str, Any]:
        return {
            "ignore_index": IGNORE_INDEX if task_cfg.ignore_index is None else task_cfg.ignore_index
        }

    @staticmethod
    def check_config(task_cfg) -> None:
        refuse_others_settings(task_cfg, own=("ignore_index",))
        if task_cfg.ignore_index is not None and task_cfg.ignore_index >= 0:
            raise ValueError(
                f"task.ignore_index={task_cfg.ignore_index} is a class index; it must be negative, so that "
                f"no class is ever left out (the default, {IGNORE_INDEX}, is what Hugging Face writes)"
            )

    @staticmethod
    def check_target(target: Any, classes: list[str] | None, where: str) -> None:
        """A 1-d int64 tensor, one class index per token inside the training set's classes, or
        negative: left out (which negative value task.ignore_index is, the probe checks)."""
        if not (torch.is_tensor(target) and target.dtype == torch.int64 and target.dim() == 1):
            one = isinstance(target, int) or (torch.is_tensor(target) and target.dim() == 0)
            raise DataError(
                f"{where}: the target is {describe_value(target)}; token_classification needs a 1-d int64 "
                "tensor per sample, a class index per token (torch.as_tensor(tags, dtype=torch.long)), "
                f"the positions to leave out marked {IGNORE_INDEX}"
                + ("; for one class per sample set task.name=classification" if one else "")
            )
        high = int(target.max()) if target.numel() else -1
        if classes is not None and high >= len(classes):
            raise DataError(
                f"{where}: the tags hold class index {high}, outside 0..{len(classes) - 1} (the training "
                f"set has {len(classes)} classes)"
            )

    def facts(self) -> dict[str, Any]:
        return {**super().facts(), "ignore_index": self.ignore_index}

    def check_output(self, output: Any, target: torch.Tensor, where: str) -> None:
        """After one forward on real samples: logits (batch, length, classes) for targets (batch,
        length), and targets that are class indices of the model or the ignore index."""
        logits = self.learn_outputs(output, target, where)[self.prediction]
        if logits.dim() != 3 or logits.shape[:2] != target.shape:
            hint = ""
            if logits.dim() == 2:
                hint = "; that is a class per sequence: for it set task.name=classification"
            elif logits.dim() == 3 and logits.shape[2] == target.shape[1]:
                hint = "; put the classes last, as a transformers ...ForTokenClassification does"
            raise TaskError(
                f"{where}: for token_classification the model's {self.prediction} must be (batch, length, "
                f"classes) for targets of shape {list(target.shape)}; it is {shape_of(logits)}{hint}"
            )
        self.num_classes = check_class_count(logits.shape[2], self.num_classes, where, per="token")
        kept = target[target != self.ignore_index]
        bad = kept[(kept < 0) | (kept >= self.num_classes)]
        if bad.numel():
            value = int(bad[0])
            raise TaskError(
                f"{where}: a target holds {value}, neither a class index of a model with {self.num_classes} "
                f"outputs nor task.ignore_index ({self.ignore_index})"
                + (
                    f"; if it marks the positions to leave out, set task.ignore_index={value}"
                    if value < 0
                    else ""
                )
            )

    def class_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """task.loss when given, else the mean cross-entropy over the tokens kept (0, not NaN, when
        none is)."""
        if self._loss:
            return self._loss(logits, target)
        total = F.cross_entropy(
            logits.flatten(0, 1), target.flatten(), ignore_index=self.ignore_index, reduction="sum"
        )
        return total / (target != self.ignore_index).sum().clamp_min(1)

    @property
    def decision(self) -> str:
        """The output whose argmax over axis 1 is the answer: `probabilities`, not the logits
        (classes last)."""
        return "probabilities"

    def derive(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"probabilities": torch.softmax(named[self.prediction], dim=2).transpose(1, 2)}

    def update(self, state: dict, named: dict[str, torch.Tensor], target: torch.Tensor) -> None:
        logits = named[self.prediction].float()
        kept = target != self.ignore_index
        tokens = kept.sum()
        state["loss"] += self.class_loss(logits, target).double() * tokens
        state["n"] += tokens
        add_confusion(state["confusion"], target[kept], logits.argmax(2)[kept])

    def metrics(self, state: dict) -> dict[str, float]:
        confusion = state["confusion"]
        hits = confusion.diagonal()
        # predicted + actual, per class: 2 TP + FP + FN
        counted = confusion.sum(0) + confusion.sum(1)
        present = counted > 0
        tokens = max(confusion.sum().item(), 1.0)
        return {
            "macro_f1": (2 * hits[present] / counted[present]).mean().item()
            if present.any()
            else 0.0,
            "token_accuracy": hits.sum().item() / tokens,
            "loss": state["loss"].item() / max(state["n"].item(), 1.0),
        }

    def describe(self, answer: dict[str, np.ndarray], target) -> str:
        predicted = answer["probabilities"][0].argmax(0)
        truth = np.asarray(target[0])
        kept = truth != self.ignore_index
        right = float((predicted[kept] == truth[kept]).mean()) if kept.any() else 0.0
        found = sorted({self.labels[i] for i in np.unique(predicted[kept])})
        return (
            f"a real sequence of {int(kept.sum())} tagged tokens from the validation split -> {right:.1%} of them "
            f"right, tags found: {', '.join(found[:6])}{' ...' if len(found) > 6 else ''}"
        )
