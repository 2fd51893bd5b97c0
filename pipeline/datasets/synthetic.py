"""Random images of a chosen shape and random labels: for benchmarks, where only the shapes
matter."""

from __future__ import annotations

import torch

from pipeline.datasets.images import ImageTensors, image_splits


def synthetic(
    channels: int = 1, size: int = 28, classes: int = 10, samples: int = 1024, seed: int = 0
) -> dict[str, ImageTensors]:
    g = torch.Generator().manual_seed(seed)
    n_val = max(classes, samples // 8)
    x = torch.rand(samples + n_val, channels, size, size, generator=g)
    y = torch.randint(0, classes, (samples + n_val,), generator=g)
    return image_splits(
        x[:samples], y[:samples], x[samples:], y[samples:], [str(c) for c in range(classes)]
    )
