"""Small-image ResNet-18 (CIFAR-style): a 3x3 stride-1 stem, no max-pool, 4 stages x 2 basic
blocks."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from pipeline.models.layers import Normalize


class BasicBlock(nn.Module):
    def __init__(self, in_planes: int, planes: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class SmallImageResNet18(nn.Module):
    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        width: float,
        mean: Sequence[float] | None,
        std: Sequence[float] | None,
    ):
        super().__init__()
        planes = [max(1, round(c * width)) for c in (64, 128, 256, 512)]
        self.normalize = Normalize(in_channels, mean, std)
        self.conv1 = nn.Conv2d(in_channels, planes[0], 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes[0])
        layers, in_planes = [], planes[0]
        for i, p in enumerate(planes):
            stride = 1 if i == 0 else 2
            layers.append(nn.Sequential(BasicBlock(in_planes, p, stride), BasicBlock(p, p, 1)))
            in_planes = p
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(planes[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(self.normalize(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


def resnet18(
    num_classes: int,
    in_channels: int,
    width: float = 1.0,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
) -> SmallImageResNet18:
    """`width` scales the channels: 1.0 gives 64/128/256/512, 0.125 gives 8/16/32/64 (tiny tests).
    `mean`/`std`: per-channel input statistics, normalized inside the model (None: inputs as they
    are)."""
    return SmallImageResNet18(in_channels, num_classes, width, mean, std)
