"""Tasks: what is learned from (inputs, target) pairs. A task is one class in one module, and one
line in `TASKS` below; `task.name` in a config picks it. Nothing outside a task's module branches on
its name.

    classification  cross-entropy; accuracy, top-k accuracy, loss; a confusion matrix; exports the
                    model's outputs and `probabilities` (softmax of the logits, inside the graph)
    regression      mean squared error; RMSE, MAE, R2, loss; a predicted-vs-actual plot; exports the
                    model's outputs (a lone tensor as `prediction`)
    segmentation    per-pixel cross-entropy on N x C x H x W logits and N x H x W class indices;
                    mean IoU, pixel accuracy, loss; exports the model's outputs and per-pixel
                    `probabilities`
    token_classification  per-token cross-entropy on N x L x C logits and N x L class indices,
                          positions
                    marked `task.ignore_index` (-100) left out; macro F1, per-token accuracy, loss; exports
                    the model's outputs and per-token `probabilities` (N x C x L: classes on axis 1)
    custom          the user's `task.loss` and `task.metric`, given the model's outputs and the
                    targets as they are (a dict for a dict); exports the model's outputs (a lone
                    tensor as `output`)

The tasks that predict classes (classification, segmentation, token_classification) share one base,
`classes.py`; each of them adds what its targets and logits look like and what it counts.

The contract a task class keeps (`Task` below; the built-ins are the examples):
- from the config and the data: `check_config` (cross-field rules, at load time), `check_data` and
  `check_target` (each sample, before anything is built), `suggest` (model arguments the data
  implies: `num_classes` from the training set's `classes`);
- from one forward of real samples (`check_output`, the probe): how the model's outputs are laid out
  (`OutputLayout`) and which one carries the prediction (`task.output`, the only one, or `logits`);
- training: `loss(outputs, target)`; evaluation: `new_state`, `update(state, named, target)`,
  `reduce`, `metrics` (sums every rank adds up, so two ranks give exactly what one gives),
  `primary`/`mode`, `plot`; `facts()` is what a checkpoint records of the task, given back as
  `recorded`;
- export and serving: `exported(outputs)` (the graph's outputs by name), `derived` (outputs the task
  adds, held to `prob_atol` instead of the model's limits), `decision` (the output whose argmax over
  axis 1 is the answer: gates count agreement on it), `gate_limits(export_cfg, variant)` (fp32,
  fp16, int8), `metric_gate(...)`, and `describe(answer, target)` for the served sample a run
  prints.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Protocol

# The registry: task.name -> the class. Adding a task is a module and a line here.
TASKS = {
    "classification": "pipeline.tasks.classification:Classification",
    "regression": "pipeline.tasks.regression:Regression",
    "segmentation": "pipeline.tasks.segmentation:Segmentation",
    "token_classification": "pipeline.tasks.token_classification:TokenClassification",
    "custom": "pipeline.tasks.custom:Custom",
}


class Task(Protocol):
    """Every member a stage uses (train, export, gates, promotion, the serve check, the launcher's
    checks); the first four are called on the class, before the data or the model exist."""

    # task.name
    name: str
    # the metric best.json, the gates and promotion compare
    primary: str
    # "max" or "min": which way `primary` is better
    mode: str
    # validation samples the probe's forward takes
    probe_rows: int
    # outputs the task adds to the graph (held to prob_atol, not the model's limits)
    derived: tuple[str, ...]

    @classmethod
    def from_config(cls, task_cfg, classes: list[str] | None, source, recorded: dict) -> "Task": ...
    @staticmethod
    def check_config(task_cfg) -> None: ...
    @staticmethod
    def check_data(classes: list[str] | None, where: str) -> None: ...
    @staticmethod
    def check_target(target: Any, classes: list[str] | None, where: str) -> None: ...

    def suggest(self, classes: list[str] | None) -> dict[str, Any]: ...
    def check_output(self, output: Any, target: Any, where: str) -> None: ...
    def check_metric(self, output: Any, target: Any, where: str) -> None: ...
    def facts(self) -> dict[str, Any]: ...

    @property
    def prediction(self) -> str | None: ...
    @property
    def decision(self) -> str | None: ...
    @property
    def output_names(self) -> list[str]: ...
    def named(self, output: Any) -> dict[str, Any]: ...
    def exported(self, output: Any) -> dict[str, Any]: ...

    def loss(self, output: Any, target: Any) -> Any: ...
    def new_state(self, device: Any) -> dict: ...
    def update(self, state: dict, named: dict[str, Any], target: Any) -> None: ...
    def reduce(self, state: dict, info: Any) -> None: ...
    def metrics(self, state: dict) -> dict[str, float]: ...
    def plot(self, state: dict, path: Path, subject: str = "validation") -> Path | None: ...

    def gate_limits(self, export_cfg, variant: str = "fp32") -> dict[str, Any]: ...
    def metric_gate(
        self, onnx_metrics: dict, torch_metrics: dict, tolerance: float, atol: float
    ) -> dict: ...
    # The trivial predictor's primary metric on the same split (from a validation state): {"value",
    # "predictor"}, or None where the task knows none (a custom metric). export's baseline gate
    # holds the model above it.
    def baseline(self, state: dict) -> dict[str, Any] | None: ...
    def describe(self, answer: dict[str, Any], target: Any) -> str: ...


def task_class(name: str) -> type:
    """The class `task.name` names; ValueError listing the known names."""
    if name not in TASKS:
        raise ValueError(f"task.name={name!r} is not a task; choose one of {', '.join(TASKS)}")
    module, _, attribute = TASKS[name].partition(":")
    return getattr(importlib.import_module(module), attribute)


def build_task(task_cfg, classes: list[str] | None, source=None, recorded: dict | None = None):
    """The task a config names. `source`: the artifact the config was read back from, if it was (its
    loss and metric components must then be trusted, see components/reference.py); `recorded`: the
    task's `facts()` as training recorded them (number of classes, target columns, the primary
    metric)."""
    return task_class(task_cfg.name).from_config(task_cfg, classes, source, recorded or {})
