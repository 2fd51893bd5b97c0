"""A small fully convolutional network: N x 1 x H x W images in, N x C x H x W logits out. A global
context branch lets each pixel see the whole digit (which digit a stroke belongs to is not local)."""

from __future__ import annotations

import torch
from torch import nn


class TinySegmenter(nn.Module):
    def __init__(self, num_classes: int, width: int = 32):
        super().__init__()
        self.local = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.ReLU(),
                                   nn.Conv2d(width, width, 3, padding=1), nn.ReLU())
        self.context = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(width, width, 1), nn.ReLU())
        self.head = nn.Conv2d(2 * width, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.local(x)
        context = self.context(local).expand_as(local)
        return self.head(torch.cat([local, context], dim=1))
