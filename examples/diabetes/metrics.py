"""A custom task's parts: the metric (a function of all validation outputs and targets) and a
loss."""

from __future__ import annotations

import torch


def absolute_errors(
    outputs: torch.Tensor, targets: torch.Tensor, within: float = 25.0
) -> dict[str, float]:
    """The first value is the one the export gate compares and `task.metric_mode` ranks (min: lower
    is better)."""
    errors = (outputs.reshape(-1) - targets.reshape(-1)).abs()
    return {
        "mae": errors.mean().item(),
        f"within_{within:g}": (errors <= within).float().mean().item(),
    }


class ScaledHuberLoss(torch.nn.Module):
    """Huber loss on the error in units of the target's spread: robust to the few extreme
    patients."""

    def __init__(self, scale: float = 77.0, delta: float = 1.0):
        super().__init__()
        self.scale, self.huber = scale, torch.nn.HuberLoss(delta=delta)

    def forward(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.huber(outputs.reshape(-1) / self.scale, targets.reshape(-1) / self.scale)
