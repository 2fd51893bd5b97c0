"""Data components: callables returning {"train": Dataset, "val": Dataset} of (inputs, target)
items."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

# in scikit-learn's (scaled) feature order: age, sex, bmi, bp, s1..s6
SEX_COLUMN = 1


class Patients(Dataset):
    """One patient per item: (inputs, progression), inputs a float tensor or a dict of named
    tensors."""

    def __init__(self, inputs, target: torch.Tensor):
        self.inputs, self.target = inputs, target

    def __len__(self) -> int:
        return len(self.target)

    def __getitem__(self, i):
        inputs = (
            {k: v[i] for k, v in self.inputs.items()}
            if isinstance(self.inputs, dict)
            else self.inputs[i]
        )
        return inputs, self.target[i]


def _split(val_fraction: float, seed: int):
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(y))
    n_val = int(round(len(y) * val_fraction))
    return (x[order[n_val:]], y[order[n_val:]]), (x[order[:n_val]], y[order[:n_val]])


def features(val_fraction: float = 0.2, seed: int = 0) -> dict[str, Patients]:
    """All ten features as one float tensor; the target as a float (regression)."""
    (tx, ty), (vx, vy) = _split(val_fraction, seed)
    train = Patients(torch.tensor(tx, dtype=torch.float32), torch.tensor(ty, dtype=torch.float32))
    # Suggestions for the model's parameters of the same names (model.args may override them).
    train.model_args = {
        "in_features": tx.shape[1],
        "target_mean": float(ty.mean()),
        "target_std": float(ty.std()),
    }
    return {
        "train": train,
        "val": Patients(
            torch.tensor(vx, dtype=torch.float32), torch.tensor(vy, dtype=torch.float32)
        ),
    }


def mixed(val_fraction: float = 0.2, seed: int = 0) -> dict[str, Patients]:
    """Two named inputs: `features`, the nine numeric ones (float32), and `sex`, a category (int64
    0/1)."""

    def inputs(x):
        numeric = np.delete(x, SEX_COLUMN, axis=1)
        sex = (x[:, SEX_COLUMN] > 0).astype(np.int64)
        return {"features": torch.tensor(numeric, dtype=torch.float32), "sex": torch.tensor(sex)}

    (tx, ty), (vx, vy) = _split(val_fraction, seed)
    train = Patients(inputs(tx), torch.tensor(ty, dtype=torch.float32))
    train.model_args = {
        "numeric_features": tx.shape[1] - 1,
        "target_mean": float(ty.mean()),
        "target_std": float(ty.std()),
    }
    return {"train": train, "val": Patients(inputs(vx), torch.tensor(vy, dtype=torch.float32))}
