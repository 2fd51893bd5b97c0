"""regression: real values per sample. Mean squared error; RMSE, MAE, R2 (averaged over target
columns), loss; a predicted-vs-actual plot. The prediction is the model's lone tensor (exported as
`prediction`) or the output `task.output` names."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.artifact import gates
from pipeline.components.data import DataError
from pipeline.tasks.base import (
    ModelOutputs,
    TaskError,
    component_callable,
    describe_value,
    gather_in_order,
    reduce_sums,
    refuse_others_settings,
    shape_of,
)

# predicted-vs-actual points kept for the plot, over all ranks
PLOT_POINTS = 2000


class Regression(ModelOutputs):
    name = "regression"
    primary, mode = "rmse", "min"
    probe_rows = 2
    single_name = "prediction"

    def __init__(self, loss=None, columns: int | None = None):
        self._loss = loss
        # target values per sample: learned from the data by the probe, or recorded
        self.columns = columns

    @classmethod
    def from_config(cls, task_cfg, classes, source, recorded: dict) -> "Regression":
        task = cls(
            component_callable(task_cfg.loss, 2, source) if task_cfg.loss else None,
            recorded.get("columns"),
        )
        task.restore_outputs(recorded, task_cfg.output)
        return task

    @staticmethod
    def check_config(task_cfg) -> None:
        refuse_others_settings(task_cfg)

    @staticmethod
    def check_data(classes, where: str) -> None:
        if classes is not None:
            preview = ", ".join(map(str, list(classes)[:5])) + (" ..." if len(classes) > 5 else "")
            raise DataError(
                f"{where}: the training set has classes ({preview}) but task.name=regression; "
                "set task.name=classification, or drop the data set's `classes` attribute"
            )

    @staticmethod
    def check_target(target: Any, classes, where: str) -> None:
        if isinstance(target, float):
            return
        if not (torch.is_tensor(target) and target.is_floating_point() and target.dim() <= 1):
            fix = (
                "; for class indices set task.name=classification"
                if torch.is_tensor(target) and not target.is_floating_point()
                else ""
            )
            raise DataError(
                f"{where}: the target is {describe_value(target)}; regression needs a float tensor "
                f"(0-d for one value, 1-d for several){fix}"
            )

    def suggest(self, classes) -> dict[str, Any]:
        return {}

    def facts(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "columns": self.columns,
            "primary": self.primary,
            "mode": self.mode,
            **self.output_facts(),
        }

    def check_output(self, output: Any, target: torch.Tensor, where: str) -> None:
        prediction = self.learn_outputs(output, target, where)[self.prediction]
        if not prediction.is_floating_point():
            raise TaskError(
                f"{where}: for regression the model must return a float tensor, got {shape_of(prediction)}"
            )
        try:
            _aligned(prediction, target)
        except ValueError:
            raise TaskError(
                f"{where}: the model returns {shape_of(prediction)} for targets of shape "
                f"{list(target.shape)}; for regression it must return the target's shape "
                "((batch,) or (batch, 1) for one value per sample, (batch, k) for k)"
            ) from None
        self.columns = 1 if target.dim() == 1 else target.shape[1]

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        return self._prediction_loss(self.predicted(output), target)

    def _prediction_loss(self, prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        prediction = _aligned(prediction, target)
        return (
            self._loss(prediction, target)
            if self._loss
            else F.mse_loss(prediction.float(), target.float())
        )

    def check_metric(self, output: Any, target: torch.Tensor, where: str) -> None:
        """Built-in metrics need no check."""

    def new_state(self, device: torch.device) -> dict:
        zeros = functools.partial(torch.zeros, dtype=torch.float64, device=device)
        k = self.columns or 1
        return {
            "n": zeros(()),
            "loss": zeros(()),
            "sse": zeros(k),
            "sae": zeros(k),
            "sy": zeros(k),
            "syy": zeros(k),
            "points": [],
        }

    def update(self, state: dict, named: dict[str, torch.Tensor], target: torch.Tensor) -> None:
        output = named[self.prediction].float()
        prediction = _aligned(output, target).double().reshape(len(target), -1)
        actual = target.double().reshape(len(target), -1)
        error = prediction - actual
        state["n"] += len(target)
        state["loss"] += self._prediction_loss(output, target.float()).double() * len(target)
        state["sse"] += (error * error).sum(0)
        state["sae"] += error.abs().sum(0)
        state["sy"] += actual.sum(0)
        state["syy"] += (actual * actual).sum(0)
        if sum(len(p) for p in state["points"]) < PLOT_POINTS:
            state["points"].append(torch.stack([prediction[:, 0], actual[:, 0]], 1).cpu())

    def reduce(self, state: dict, info) -> None:
        reduce_sums(state, info)
        gathered = gather_in_order(state["points"], info)
        state["points"] = [gathered[:PLOT_POINTS]] if gathered is not None else []

    def metrics(self, state: dict) -> dict[str, float]:
        n = state["n"].item()
        sse, sy, syy = state["sse"], state["sy"], state["syy"]
        # sum of squares about the mean, per column
        total = syy - sy * sy / n
        r2 = torch.where(total > 0, 1 - sse / total.clamp_min(1e-300), torch.zeros_like(total))
        return {
            "rmse": math.sqrt(sse.sum().item() / (n * len(sse))),
            "mae": state["sae"].sum().item() / (n * len(sse)),
            "r2": r2.mean().item(),
            "loss": state["loss"].item() / n,
        }

    def plot(self, state: dict, path: Path, subject: str = "validation") -> Path | None:
        from pipeline.artifact.plots import predicted_vs_actual_png

        points = state["points"][0] if state["points"] else torch.empty(0, 2)
        title = f"{subject}: RMSE {self.metrics(state)['rmse']:.4g} over {int(state['n'].item())} samples"
        return predicted_vs_actual_png(
            points[:, 0], points[:, 1], path.with_name("predicted_vs_actual.png"), title
        )

    def gate_limits(self, export_cfg, variant: str = "fp32") -> dict[str, Any]:
        return gates.metric_gate_limits(export_cfg, variant)

    def metric_gate(
        self, onnx_metrics: dict, torch_metrics: dict, tolerance: float, atol: float
    ) -> dict:
        return gates.relative_gate(
            self.primary, onnx_metrics[self.primary], torch_metrics[self.primary], tolerance, atol
        )

    def baseline(self, state: dict) -> dict[str, Any] | None:
        """Always the split's mean: its squared error is the targets' sum of squares about their
        mean; None for targets that do not vary (nothing beats the mean there)."""
        n = state["n"]
        # (rounding: never below 0)
        about_mean = (state["syy"] - state["sy"] * state["sy"] / n).clamp_min(0)
        if not bool((about_mean > 1e-12 * state["syy"].abs().clamp_min(1e-300)).any()):
            return None
        return {
            "value": self.metrics({**state, "sse": about_mean})[self.primary],
            "predictor": "always the mean of the targets",
        }

    def describe(self, answer: dict[str, np.ndarray], target) -> str:
        return (
            f"a real validation sample (target {gates.values_text(target[0])}) -> {self.prediction} "
            f"{gates.values_text(answer[self.prediction][0])}"
        )


def _aligned(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The prediction in the target's shape: (batch, 1) outputs for (batch,) targets are
    squeezed."""
    if output.shape == target.shape:
        return output
    if target.dim() == 1 and output.dim() == 2 and output.shape == (len(target), 1):
        return output[:, 0]
    raise ValueError(f"output {list(output.shape)} vs target {list(target.shape)}")
