"""scikit-learn's wine data (178 wines, 13 measurements; it ships with scikit-learn) as a two-target
problem: which of 3 cultivars a wine is, and its alcohol content. Inputs are the other 12
measurements, standardized; the target is a dict {"cultivar": int64, "alcohol": float32}."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

# the first of scikit-learn's wine features
ALCOHOL = 0


class Wines(Dataset):
    def __init__(self, features: np.ndarray, cultivar: np.ndarray, alcohol: np.ndarray):
        self.features = torch.tensor(features, dtype=torch.float32)
        self.cultivar = torch.tensor(cultivar, dtype=torch.int64)
        self.alcohol = torch.tensor(alcohol, dtype=torch.float32)

    def __len__(self) -> int:
        return len(self.cultivar)

    def __getitem__(self, i):
        return self.features[i], {"cultivar": self.cultivar[i], "alcohol": self.alcohol[i]}


def wine(val_fraction: float = 0.25, seed: int = 0) -> dict[str, Wines]:
    from sklearn.datasets import load_wine

    data = load_wine()
    x, y = data.data, data.target
    alcohol = x[:, ALCOHOL]
    features = np.delete(x, ALCOHOL, axis=1)
    order = np.random.default_rng(seed).permutation(len(y))
    n_val = int(round(len(y) * val_fraction))
    val, train = order[:n_val], order[n_val:]
    mean, std = features[train].mean(0), features[train].std(0)
    scaled = (features - mean) / std
    train_set = Wines(scaled[train], y[train], alcohol[train])
    # a hint for the model: num_classes
    train_set.classes = [str(c) for c in data.target_names]
    train_set.model_args = {
        "in_features": scaled.shape[1],
        "alcohol_mean": float(alcohol[train].mean()),
    }
    return {"train": train_set, "val": Wines(scaled[val], y[val], alcohol[val])}
