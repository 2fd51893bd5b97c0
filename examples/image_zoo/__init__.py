"""A model zoo with timm's factory shape: `create_model(model_name, pretrained=False, **kwargs)`,
the keyword arguments (num_classes, in_chans, ...) passed on to the named architecture. trainserve
fills `num_classes` from the training set's classes through **kwargs, as it would for
`timm:create_model` (timm itself needs torchvision, whose PyPI wheels are CUDA builds: see the
README)."""

from __future__ import annotations

from torch import nn


def _tinynet(num_classes: int = 1000, in_chans: int = 3, width: int = 16) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(in_chans, width, 3, padding=1),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1, stride=2),
        nn.BatchNorm2d(2 * width),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, num_classes),
    )


_MODELS = {"tinynet": _tinynet}


def create_model(model_name: str, pretrained: bool = False, **kwargs) -> nn.Module:
    if pretrained:
        raise ValueError("this zoo has no pretrained weights (nothing is downloaded here)")
    if model_name not in _MODELS:
        raise ValueError(f"unknown model {model_name!r}; known: {', '.join(_MODELS)}")
    return _MODELS[model_name](**kwargs)
