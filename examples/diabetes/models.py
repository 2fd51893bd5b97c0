"""Model components: callables returning a torch.nn.Module."""

from __future__ import annotations

import torch
from torch import nn


class TabularMLP(nn.Module):
    """Features -> progression. The network predicts the standardized target; the statistics are
    buffers, so the exported model answers in the target's own units."""

    def __init__(
        self,
        in_features: int,
        hidden: list[int] = (64, 64),
        dropout: float = 0.0,
        target_mean: float = 0.0,
        target_std: float = 1.0,
    ):
        super().__init__()
        layers, width = [], in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.GELU(), nn.Dropout(dropout)]
            width = h
        self.body = nn.Sequential(*layers, nn.Linear(width, 1))
        self.register_buffer("target_mean", torch.tensor(float(target_mean)))
        self.register_buffer("target_std", torch.tensor(float(target_std)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.target_mean + self.target_std * self.body(x).squeeze(-1)


class MixedInputNet(nn.Module):
    """Numeric features and a category: the category's embedding joins the features (as in wide &
    deep models). Dict inputs arrive as keyword arguments named after the data's keys."""

    def __init__(
        self,
        numeric_features: int,
        categories: int = 2,
        embedding: int = 4,
        hidden: int = 64,
        target_mean: float = 0.0,
        target_std: float = 1.0,
    ):
        super().__init__()
        self.embed = nn.Embedding(categories, embedding)
        self.body = nn.Sequential(
            nn.Linear(numeric_features + embedding, hidden),
            nn.GELU(),
            nn.Linear(hidden, hidden),
            nn.GELU(),
            nn.Linear(hidden, 1),
        )
        self.register_buffer("target_mean", torch.tensor(float(target_mean)))
        self.register_buffer("target_std", torch.tensor(float(target_std)))

    def forward(self, features: torch.Tensor, sex: torch.Tensor) -> torch.Tensor:
        x = torch.cat([features, self.embed(sex)], dim=1)
        return self.target_mean + self.target_std * self.body(x).squeeze(-1)
