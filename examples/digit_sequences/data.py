"""A data component: {"train", "val"} data sets of ({"tokens": int64, "mask": bool}, label) items,
or with `names="transformers"` ({"input_ids": int64, "attention_mask": int64}, label): the keyword
arguments a Hugging Face model's forward takes."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

# token 0 pads; intensity v is token v + 1
PAD = 0
VOCAB = 18


class DigitSequences(Dataset):
    """Each 8x8 image row by row, its trailing blank pixels dropped, so lengths vary (about 50 to
    64); padded to `length` with PAD and a mask that is True on real tokens."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, length: int, names: str = "plain"):
        flat = images.reshape(len(images), -1).astype(np.int64)
        self.lengths = [int(np.flatnonzero(row).max(initial=0)) + 1 for row in flat]
        self.tokens = torch.full((len(flat), length), PAD, dtype=torch.int64)
        for i, (row, n) in enumerate(zip(flat, self.lengths)):
            self.tokens[i, :n] = torch.from_numpy(row[:n] + 1)
        self.mask = self.tokens != PAD
        self.labels = torch.from_numpy(labels.astype(np.int64))
        self.classes = [str(d) for d in range(10)]
        self.transformers = names == "transformers"

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        if self.transformers:
            return {
                "input_ids": self.tokens[i],
                "attention_mask": self.mask[i].long(),
            }, self.labels[i]
        return {"tokens": self.tokens[i], "mask": self.mask[i]}, self.labels[i]


def digit_sequences(
    val_fraction: float = 0.2, seed: int = 0, names: str = "plain"
) -> dict[str, DigitSequences]:
    if names not in ("plain", "transformers"):
        raise ValueError(
            f"names={names!r}: choose plain (tokens, mask) or transformers (input_ids, attention_mask)"
        )
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))
    n_val = int(round(len(order) * val_fraction))
    val, train = order[:n_val], order[n_val:]
    length = digits.images[0].size
    train_set = DigitSequences(digits.images[train], digits.target[train], length, names)
    train_set.model_args = {"vocab_size": VOCAB}
    return {
        "train": train_set,
        "val": DigitSequences(digits.images[val], digits.target[val], length, names),
    }
