"""Per-pixel labels made from scikit-learn's 8x8 digits (they ship with it): each pixel is
background (class 0) or, where the stroke is, the digit it belongs to (classes 1..10 = digits 0..9).
A model must find the stroke and say which digit it is, pixel by pixel."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

# intensity (0..1) above which a pixel is part of the stroke
INK = 0.25


class DigitMasks(Dataset):
    def __init__(self, images: np.ndarray, digits: np.ndarray):
        # N x 1 x 8 x 8
        self.images = torch.from_numpy(images.astype(np.float32) / 16.0).unsqueeze(1)
        stroke = self.images[:, 0] > INK
        # N x 8 x 8
        self.masks = torch.where(
            stroke, torch.from_numpy(digits.astype(np.int64))[:, None, None] + 1, 0
        )

    def __len__(self) -> int:
        return len(self.masks)

    def __getitem__(self, i):
        return self.images[i], self.masks[i]


def digit_masks(val_fraction: float = 0.2, seed: int = 0) -> dict[str, DigitMasks]:
    from sklearn.datasets import load_digits

    data = load_digits()
    order = np.random.default_rng(seed).permutation(len(data.target))
    n_val = int(round(len(order) * val_fraction))
    val, train = order[:n_val], order[n_val:]
    train_set = DigitMasks(data.images[train], data.target[train])
    train_set.classes = ["background"] + [str(d) for d in range(10)]
    # the model's context branch sees the whole image
    train_set.model_args = {"image_size": data.images.shape[1]}
    return {"train": train_set, "val": DigitMasks(data.images[val], data.target[val])}
