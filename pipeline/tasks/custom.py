"""custom: the user's `task.loss` and `task.metric`. Both receive the model's outputs and the
targets as they are: a tensor, a tuple, or a dict (a ModelOutput reaches the loss as itself and the
metric as a dict of its fields); a target may be a tensor or a dict/tuple of tensors. The metric
returns a number or {name: number}, each logged as val/<name>; the first is the primary one
(checkpoint.monitor can name another). The graph exports every output of the model (a lone tensor as
`output`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pipeline.artifact import gates
from pipeline.components.data import leaves
from pipeline.components.reference import short_name
from pipeline.tasks.base import (
    ModelOutputs,
    TaskError,
    component_callable,
    gather_in_order,
    map_tensors,
    reduce_sums,
    refuse_others_settings,
    rows_of,
    shape_of,
    suggest_num_classes,
)


class Custom(ModelOutputs):
    name = "custom"
    # a metric may need more than a couple of samples (an AUC needs both classes)
    probe_rows = 16
    single_name, needs_prediction = "output", False

    def __init__(self, loss, metric, mode: str, metric_name: str):
        self._loss, self._metric = loss, metric
        self.mode = mode
        # until the metric returns a dict: then its first key
        self.primary = metric_name

    @classmethod
    def from_config(cls, task_cfg, classes, source, recorded: dict) -> "Custom":
        metric = component_callable(task_cfg.metric, 2, source)
        primary = recorded.get("primary") or short_name(task_cfg.metric.component).replace("-", "_")
        task = cls(
            component_callable(task_cfg.loss, 2, source), metric, task_cfg.metric_mode, primary
        )
        task.restore_outputs(recorded, task_cfg.output)
        return task

    @staticmethod
    def check_config(task_cfg) -> None:
        missing = [k for k in ("loss", "metric", "metric_mode") if getattr(task_cfg, k) is None]
        if missing:
            raise ValueError(
                f"task.name=custom needs {', '.join('task.' + k for k in missing)}: a loss component, "
                "a metric component and whether the metric is better high (max) or low (min)"
            )
        refuse_others_settings(task_cfg, own=("metric", "metric_mode"))

    @staticmethod
    def check_data(classes, where: str) -> None:
        """Anything the loss takes."""

    @staticmethod
    def check_target(target: Any, classes, where: str) -> None:
        """Anything the loss takes; checked on the probe's forward."""

    def suggest(self, classes) -> dict[str, Any]:
        return suggest_num_classes(classes)

    def facts(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "primary": self.primary,
            "mode": self.mode,
            **self.output_facts(),
        }

    def check_output(self, output: Any, target: Any, where: str) -> None:
        if not leaves(target):
            raise TaskError(
                f"{where}: the target is a {type(target).__name__}; custom tasks take a tensor or a "
                "dict/tuple of tensors (the default collate makes them from numbers and arrays)"
            )
        named = self.learn_outputs(output, target, where)
        value = self._loss(output, target)
        if not (torch.is_tensor(value) and value.dim() == 0):
            raise TaskError(
                f"{where}: task.loss must return a scalar tensor, got {shape_of(value)}"
            )
        # as evaluation and the export gates will call it: on outputs rebuilt from their names
        try:
            self._loss(self.layout.rebuild(_float32(named)), target)
        except Exception as exc:
            raise TaskError(
                f"{where}: task.loss works on the model's own output but not on the same outputs "
                f"rebuilt by name (as evaluation passes them: {type(exc).__name__}: {exc}); read them "
                "as outputs['name'] or outputs.name"
            ) from exc

    def loss(self, output: Any, target: Any) -> torch.Tensor:
        return self._loss(output, target)

    def check_metric(self, output: Any, target: Any, where: str) -> None:
        """The metric runs on the probe's outputs and gives numbers; its first name becomes the
        primary."""
        named = _float32(self.named(output))
        self._named(self._call_metric(self.layout.rebuild(named), target, where), where)

    def _call_metric(self, outputs: Any, targets: Any, where: str):
        try:
            return self._metric(outputs, targets)
        except Exception as exc:
            raise TaskError(f"{where}: task.metric raised {type(exc).__name__}: {exc}") from exc

    def new_state(self, device: torch.device) -> dict:
        return {
            "n": torch.zeros((), dtype=torch.float64, device=device),
            "loss": torch.zeros((), dtype=torch.float64, device=device),
            "outputs": [],
            "targets": [],
        }

    def update(self, state: dict, named: dict[str, torch.Tensor], target: Any) -> None:
        named = _float32(named)
        state["n"] += rows_of(target)
        state["loss"] += self._loss(self.layout.rebuild(named), target).double() * rows_of(target)
        state["outputs"].append({k: v.detach().cpu() for k, v in named.items()})
        state["targets"].append(map_tensors(lambda t: t.detach().cpu(), target))

    def reduce(self, state: dict, info) -> None:
        reduce_sums(state, info)
        state["outputs"] = [gather_in_order(state["outputs"], info)]
        state["targets"] = [gather_in_order(state["targets"], info)]

    def metrics(self, state: dict) -> dict[str, float]:
        outputs = self.layout.rebuild(state["outputs"][0])
        value = self._call_metric(outputs, state["targets"][0], "the validation split")
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
            raise TaskError(
                f"{where}: task.metric must return a number or a dict of numbers, got "
                f"{shape_of(value) if torch.is_tensor(value) else repr(value)[:80]}"
            ) from None

    def plot(self, state: dict, path, subject: str = "validation") -> None:
        return None

    def gate_limits(self, export_cfg, variant: str = "fp32") -> dict[str, Any]:
        return gates.metric_gate_limits(export_cfg, variant)

    def metric_gate(
        self, onnx_metrics: dict, torch_metrics: dict, tolerance: float, atol: float
    ) -> dict:
        return gates.relative_gate(
            self.primary, onnx_metrics[self.primary], torch_metrics[self.primary], tolerance, atol
        )

    def baseline(self, state: dict) -> None:
        """A metric of the user's own: no trivial predictor is known for it."""
        return None

    def describe(self, answer: dict[str, np.ndarray], target) -> str:
        shown = ", ".join(f"{name} {gates.values_text(value[0])}" for name, value in answer.items())
        return f"a real validation sample (target {_target_text(target)}) -> {shown}"


def _float32(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Floating outputs in float32 (bf16 under autocast), detached; others (indices) as they are."""
    return {
        k: v.detach().float() if v.is_floating_point() else v.detach() for k, v in named.items()
    }


def _target_text(target: Any) -> str:
    if torch.is_tensor(target):
        return gates.values_text(target[0])
    if isinstance(target, dict):
        return "{" + ", ".join(f"{k}: {gates.values_text(v[0])}" for k, v in target.items()) + "}"
    return "(" + ", ".join(gates.values_text(v[0]) for v in target) + ")"
