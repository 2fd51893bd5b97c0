"""A model component for the int8 tests (imported by name from model.json, as a user's would be)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class OutlierNet(nn.Module):
    """Three 3x3 convolutions on 8x8 images. The second's output carries one channel offset by
    `outlier` (its bias; the third convolution ignores that channel: its weights there are masked to
    0, so no gradient ever moves the bias), harmless in float. int8 quantizes the third
    convolution's input with one scale (uint8 over [0, ~outlier]), which rounds every other channel
    to a step or two: the third convolution is the sensitive node, and the int8 variant passes only
    with it kept in float (its input is then not quantized at all)."""

    def __init__(
        self, num_classes: int = 10, in_channels: int = 1, width: int = 16, outlier: float = 2000.0
    ):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)
        self.conv3 = nn.Conv2d(width, width, 3, padding=1)
        self.head = nn.Linear(width, num_classes)
        with torch.no_grad():
            self.conv2.bias[0] = outlier
        mask = torch.ones(width, width, 1, 1)
        mask[:, 0] = 0
        self.register_buffer("mask", mask)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.relu(F.conv2d(x, self.conv3.weight * self.mask, self.conv3.bias, padding=1))
        return self.head(x.mean(dim=(2, 3)))
