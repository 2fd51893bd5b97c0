"""scikit-learn's 1,797 real 8x8 handwritten digits (they ship with it: nothing is downloaded)."""

from __future__ import annotations

import numpy as np
import torch

from pipeline.datasets.images import ImageTensors, image_splits


def digits(val_fraction: float = 0.2, split_seed: int = 0) -> dict[str, ImageTensors]:
    """A fixed, seeded train/validation split (`split_seed` is independent of train.seed); intensities
    0..16 scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    data = load_digits()
    x = torch.from_numpy(data.images.astype(np.float32) / 16.0).unsqueeze(1)
    y = torch.from_numpy(data.target.astype(np.int64))
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(split_seed))
    n_val = int(round(len(y) * val_fraction))
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    return image_splits(x[train_idx], y[train_idx], x[val_idx], y[val_idx], [str(d) for d in range(10)])
