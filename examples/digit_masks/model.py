"""A small fully convolutional network: N x 1 x H x W images in, N x C x H x W logits out. Which
digit a stroke belongs to is not local, so a context branch (the whole image, pooled) is broadcast
back to every pixel beside the local features: each pixel's logits see both where the stroke is and
what it draws."""

from __future__ import annotations

import torch
from torch import nn


class TinySegmenter(nn.Module):
    def __init__(self, num_classes: int, image_size: int, width: int = 32):
        super().__init__()
        self.local = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1),
            nn.ReLU(),
        )
        self.context = nn.Sequential(
            nn.Flatten(),
            nn.Linear(width * image_size * image_size, 4 * width),
            nn.ReLU(),
            nn.Linear(4 * width, width),
            nn.ReLU(),
        )
        self.head = nn.Sequential(
            nn.Conv2d(2 * width + 1, width, 1), nn.ReLU(), nn.Conv2d(width, num_classes, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.local(x)
        context = self.context(local)[:, :, None, None].expand(-1, -1, *local.shape[2:])
        return self.head(torch.cat([x, local, context], dim=1))
