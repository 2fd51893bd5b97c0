"""Layers the built-in models share."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


class Normalize(nn.Module):
    """(x - mean) / std per channel, with mean and std as buffers (saved, exported, never trained).

    Without statistics (None) it is the identity, still with buffers, so every model built from the
    same arguments has the same keys."""

    def __init__(
        self, channels: int, mean: Sequence[float] | None = None, std: Sequence[float] | None = None
    ):
        super().__init__()
        mean = [0.0] * channels if mean is None else list(mean)
        std = [1.0] * channels if std is None else list(std)
        if len(mean) != channels or len(std) != channels:
            raise ValueError(
                f"mean and std need {channels} value(s), one per channel; got {len(mean)} and {len(std)}"
            )
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std
