"""Model builders. A model is rebuilt anywhere (consolidate, export) from `model_args` alone.

`model_args` is a plain dict saved with every checkpoint and consolidated weights:
    {"name", "in_channels", "num_classes", "image_size", "width", "hidden", "mean", "std"}
Input normalization lives inside the model as buffers, so every model takes raw intensities in
[0, 1] and the exported ONNX graph carries its own preprocessing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Normalize(nn.Module):
    """(x - mean) / std per channel, with mean and std as buffers (saved, exported, never trained)."""

    def __init__(self, mean: list[float], std: list[float]):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


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
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class SmallImageResNet18(nn.Module):
    """ResNet-18 for small images (CIFAR-style): 3x3 stride-1 stem, no max-pool, 4 stages x 2 blocks."""

    def __init__(self, in_channels: int, num_classes: int, width: float, mean: list[float], std: list[float]):
        super().__init__()
        planes = [max(1, round(c * width)) for c in (64, 128, 256, 512)]
        self.normalize = Normalize(mean, std)
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


class MLP(nn.Module):
    def __init__(self, in_channels: int, image_size: int, num_classes: int, hidden: list[int],
                 mean: list[float], std: list[float]):
        super().__init__()
        self.normalize = Normalize(mean, std)
        dims = [in_channels * image_size * image_size, *hidden]
        blocks: list[nn.Module] = []
        for a, b in zip(dims[:-1], dims[1:]):
            blocks += [nn.Linear(a, b), nn.ReLU()]
        self.body = nn.Sequential(*blocks)
        self.head = nn.Linear(dims[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(torch.flatten(self.normalize(x), 1)))


def model_args_for(model_cfg, data_info: dict[str, Any]) -> dict[str, Any]:
    """Everything needed to rebuild the model, as plain JSON-able values."""
    return {
        "name": model_cfg.name,
        "in_channels": data_info["channels"],
        "image_size": data_info["size"],
        "num_classes": data_info["num_classes"],
        "width": model_cfg.width,
        "hidden": list(model_cfg.hidden),
        "mean": list(data_info["mean"]),
        "std": list(data_info["std"]),
    }


def build_model(model_args: dict[str, Any]) -> nn.Module:
    name = model_args["name"]
    if name == "resnet18":
        return SmallImageResNet18(model_args["in_channels"], model_args["num_classes"], model_args["width"],
                                  model_args["mean"], model_args["std"])
    if name == "mlp":
        return MLP(model_args["in_channels"], model_args["image_size"], model_args["num_classes"],
                   model_args["hidden"], model_args["mean"], model_args["std"])
    raise ValueError(f"unknown model '{name}'; known: resnet18, mlp")


def input_shape(model_args: dict[str, Any]) -> tuple[int, int, int]:
    """(C, H, W) of one sample: what the model (and its ONNX graph) takes after the batch axis."""
    return (model_args["in_channels"], model_args["image_size"], model_args["image_size"])
