"""Synthetic click data for examples/recommender/model.py: bags of item ids, and whether the user
clicked.

A hidden "taste" of every item decides the click (the bag's mean taste above zero), so the embedding
table has something to learn; the taste is computed from the id (a hash), never stored, so data of a
5M-item catalogue costs only its samples. Deterministic for a seed."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


def taste(items: torch.Tensor) -> torch.Tensor:
    """A fixed pseudo-random value in [-1, 1) per item id (a multiplicative hash), no table behind
    it."""
    return ((items * 2654435761) % 65536).to(torch.float32) / 32768.0 - 1.0


class Clicks(Dataset):
    def __init__(self, items: torch.Tensor):
        self.items = items
        self.clicked = (taste(items).mean(1) > 0).to(torch.int64)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i], self.clicked[i]


def clicks(
    rows: int, bag: int = 8, train_samples: int = 4096, val_samples: int = 512, seed: int = 0
) -> dict:
    """`rows`: the catalogue's size (item ids [0, rows)), the model's too: it is passed to the model
    as an arg."""
    if rows < 1 or bag < 1:
        raise ValueError(f"rows ({rows}) and bag ({bag}) must be positive")
    gen = torch.Generator().manual_seed(seed)
    items = torch.randint(0, rows, (train_samples + val_samples, bag), generator=gen)
    train = Clicks(items[:train_samples])
    train.classes = ["no_click", "click"]
    train.model_args = {"rows": rows}
    return {"train": train, "val": Clicks(items[train_samples:])}
