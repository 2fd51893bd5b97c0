"""scikit-learn's 1,797 real 8x8 handwritten digits (they ship with it: nothing is downloaded)."""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch

from pipeline.datasets.images import ImageTensors, image_splits


def digits(val_fraction: float = 0.2, split_seed: int = 0) -> dict[str, ImageTensors]:
    """A fixed, seeded train/validation split (`split_seed` is independent of train.seed);
    intensities 0..16 scaled to [0, 1]."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    images, target = load_digits()
    x = torch.from_numpy(images.astype(np.float32) / 16.0).unsqueeze(1)
    y = torch.from_numpy(target.astype(np.int64))
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(split_seed))
    n_val = int(round(len(y) * val_fraction))
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    return image_splits(
        x[train_idx], y[train_idx], x[val_idx], y[val_idx], [str(d) for d in range(10)]
    )


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """(images N x 8 x 8, targets N) as scikit-learn's load_digits gives them, read from the CSV
    file it ships without importing scikit-learn: importing it (scipy and all) made load_digits cost
    1.1 s against 0.02 s for the file alone, in every process that loads the data (each rank, and a
    launcher's pre-run check)."""
    spec = importlib.util.find_spec("sklearn")
    csv = (
        Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
        if spec is not None and spec.submodule_search_locations
        else None
    )
    # another layout of scikit-learn: its own loader
    if csv is None or not csv.is_file():
        from sklearn.datasets import load_digits as sklearn_load_digits

        data = sklearn_load_digits()
        return data.images, data.target
    with gzip.open(csv) as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(int)
