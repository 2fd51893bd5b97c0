"""A shared trunk with two heads, returned as a dict: the exported model answers both by name."""

from __future__ import annotations

import torch
from torch import nn


class TwoHeads(nn.Module):
    def __init__(
        self, in_features: int, num_classes: int, hidden: int = 32, alcohol_mean: float = 13.0
    ):
        super().__init__()
        self.trunk = nn.Sequential(
            nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU()
        )
        self.cultivar = nn.Linear(hidden, num_classes)
        self.alcohol = nn.Linear(hidden, 1)
        self.register_buffer("alcohol_mean", torch.tensor(float(alcohol_mean)))

    def forward(self, features: torch.Tensor) -> dict[str, torch.Tensor]:
        shared = self.trunk(features)
        return {
            "cultivar_logits": self.cultivar(shared),
            "alcohol": self.alcohol(shared)[:, 0] + self.alcohol_mean,
        }
