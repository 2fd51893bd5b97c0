"""A multilayer perceptron over flattened images."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from pipeline.models.layers import Normalize


class MLP(nn.Module):
    def __init__(
        self,
        in_channels: int,
        image_size: int,
        num_classes: int,
        hidden: Sequence[int],
        mean: Sequence[float] | None,
        std: Sequence[float] | None,
    ):
        super().__init__()
        self.normalize = Normalize(in_channels, mean, std)
        dims = [in_channels * image_size * image_size, *hidden]
        blocks: list[nn.Module] = []
        for a, b in zip(dims[:-1], dims[1:]):
            blocks += [nn.Linear(a, b), nn.ReLU()]
        self.body = nn.Sequential(*blocks)
        self.head = nn.Linear(dims[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(torch.flatten(self.normalize(x), 1)))


def mlp(
    num_classes: int,
    in_channels: int,
    image_size: int,
    hidden: Sequence[int] = (256, 128),
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
) -> MLP:
    """`hidden`: the hidden layer sizes. Inputs are (C, image_size, image_size) images."""
    return MLP(in_channels, image_size, num_classes, list(hidden), mean, std)
