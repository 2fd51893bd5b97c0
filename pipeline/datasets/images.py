"""Images held in memory as float tensors in [0, 1] (N, C, H, W) with int64 labels."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from pipeline.components.data import PreBatched


class ImageTensors(Dataset):
    """A map-style data set of (image, label) with a batched `__getitems__`: the DataLoader gathers
    a batch with one index operation instead of collating 64 single samples."""

    def __init__(
        self, x: torch.Tensor, y: torch.Tensor, classes: list[str], model_args: dict | None = None
    ):
        self.x, self.y = x, y
        self.classes = classes
        if model_args is not None:
            self.model_args = model_args

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __getitems__(self, indices: list[int]):
        idx = torch.as_tensor(indices)
        return PreBatched((self.x[idx], self.y[idx]))


def image_splits(
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    val_x: torch.Tensor,
    val_y: torch.Tensor,
    classes: list[str],
) -> dict[str, ImageTensors]:
    """The two splits; the training set suggests the model's input shape and its own statistics,
    which the built-in models normalize with inside the graph (so clients send raw intensities)."""
    suggested = {
        "in_channels": train_x.shape[1],
        "image_size": train_x.shape[2],
        "mean": train_x.mean(dim=(0, 2, 3)).tolist(),
        "std": train_x.std(dim=(0, 2, 3)).clamp_min(1e-6).tolist(),
    }
    return {
        "train": ImageTensors(train_x, train_y, classes, suggested),
        "val": ImageTensors(val_x, val_y, classes),
    }
