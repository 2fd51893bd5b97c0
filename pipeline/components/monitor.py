"""Best, not last: which evaluation has been the best so far, and whether training should stop
early.

Every rank sees the same reduced validation metrics, and the decision to stop is broadcast from rank
0 anyway, so all ranks stop at the same step. The monitor's state travels in each checkpoint's train
state: a resume (or a torchrun restart) continues with the same best and the same patience count.

On disk (or on the object store), `checkpoints/best.json` names the best checkpoint; checkpoint
saves never prune it, and consolidate/export take it unless told `--latest`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.checkpoint import CheckpointError, step_dir_name
from pipeline.checkpoint.object_store import location
from pipeline.config import ConfigError
from pipeline.tools.files import StateFileError, read_json, write_json

log = logging.getLogger(__name__)

# in <run_dir>/checkpoints/
BEST_FILE = "best.json"

# Whether more is better, for the metrics the built-in tasks report (a custom task's primary metric
# carries its own mode; its other metrics need checkpoint.mode).
KNOWN_MODES = {"accuracy": "max", "r2": "max", "loss": "min", "rmse": "min", "mae": "min"}


@dataclass
class Monitor:
    # a validation metric's name, as the task reports it ("accuracy")
    metric: str
    # "max" or "min"
    mode: str
    # evaluations without an improvement of min_delta before stopping; 0 = never
    patience: int = 0
    min_delta: float = 0.0
    best_value: float | None = None
    best_step: int | None = None
    # evaluations since the last improvement of more than min_delta
    bad_evals: int = 0
    # why training stopped early, once it has
    stopped: str = ""

    def update(self, metrics: dict[str, float], step: int) -> bool:
        """Takes one evaluation's metrics; True when it is the best so far (strictly better)."""
        if self.metric not in metrics:
            raise ConfigError(
                f"checkpoint.monitor={self.metric}: the task reports no such validation metric; "
                f"it reports {', '.join(sorted(metrics))}"
            )
        value = float(metrics[self.metric])
        # A NaN is never the best, not even the first: it would compare worse than nothing ever
        # after.
        best = not math.isnan(value) and (
            self.best_value is None or self._better(value, self.best_value, 0.0)
        )
        if best and (
            self.best_value is None or self._better(value, self.best_value, self.min_delta)
        ):
            self.bad_evals = 0
        else:
            self.bad_evals += 1
        if best:
            self.best_value, self.best_step = value, step
        if self.patience and self.bad_evals >= self.patience and not self.stopped:
            self.stopped = (
                f"early stopping at step {step}: val/{self.metric} did not improve by more than "
                f"{self.min_delta:g} in {self.bad_evals} evaluations (best {self.best_value:.6g} "
                f"at step {self.best_step})"
            )
        return best

    def _better(self, value: float, than: float, delta: float) -> bool:
        if math.isnan(value):
            return False
        return value > than + delta if self.mode == "max" else value < than - delta

    def state(self) -> dict:
        return asdict(self)

    def restore(self, state: dict | None) -> None:
        """The state a checkpoint saved; a checkpoint from before monitoring (or of another metric)
        starts fresh."""
        if not state or state.get("metric") != self.metric or state.get("mode") != self.mode:
            return
        self.best_value, self.best_step = state.get("best_value"), state.get("best_step")
        self.bad_evals, self.stopped = int(state.get("bad_evals", 0)), state.get("stopped", "")


def build_monitor(ckpt_cfg, train_cfg, task) -> Monitor:
    """checkpoint.monitor (default: the task's primary metric) and its mode;
    train.early_stopping."""
    metric = (ckpt_cfg.monitor or task.primary).removeprefix("val/")
    mode = ckpt_cfg.mode
    if mode == "auto":
        mode = task.mode if metric == task.primary else KNOWN_MODES.get(metric.split("_")[-1])
        if mode is None:
            raise ConfigError(
                f"checkpoint.monitor={metric}: set checkpoint.mode=max (larger is better) or min; "
                f"only the task's primary metric ({task.primary}) and {', '.join(KNOWN_MODES)} "
                "have a known direction"
            )
    stop = train_cfg.early_stopping
    return Monitor(metric, mode, stop.patience, stop.min_delta)


def write_best(ckpt_root: Path, monitor: Monitor, checkpoint_dir: Path) -> None:
    write_json(
        location(ckpt_root) / BEST_FILE,
        {
            "checkpoint": checkpoint_dir.name,
            "step": monitor.best_step,
            "metric": f"val/{monitor.metric}",
            "value": monitor.best_value,
            "mode": monitor.mode,
        },
    )


def read_best(ckpt_root: Path) -> dict | None:
    """best.json, if the run wrote one and its checkpoint is still there (else None, with a
    warning)."""
    path = location(ckpt_root) / BEST_FILE
    if not path.is_file():
        return None
    try:
        record = read_json(
            path, "delete it, or use --latest, to take the newest checkpoint instead"
        )
    except StateFileError as exc:
        raise CheckpointError(str(exc)) from None
    name = record.get("checkpoint") if isinstance(record, dict) else None
    if not isinstance(name, str) or "/" in name or not (location(ckpt_root) / name).is_dir():
        log.warning(
            "%s names checkpoint %r, which is not in %s: taking the newest instead",
            path,
            name,
            ckpt_root,
        )
        return None
    return record


def sync_best_file(ckpt_root: Path, monitor: Monitor) -> None:
    """After a resume: best.json names the best of the timeline being trained (a later best may have
    been set aside with the checkpoints after the resumed step), or nothing yet."""
    path = location(ckpt_root) / BEST_FILE
    if (
        monitor.best_step is not None
        and (location(ckpt_root) / step_dir_name(monitor.best_step)).is_dir()
    ):
        write_best(ckpt_root, monitor, location(ckpt_root) / step_dir_name(monitor.best_step))
    else:
        path.unlink(missing_ok=True)
