"""A tag for every token, made from scikit-learn's 8x8 digits (they ship with it: nothing is
downloaded).

Each image read row by row is a sequence of pixel tokens (intensity v is token v + 1; 0 pads), its
trailing blank pixels dropped, so lengths vary (about 50 to 64) and every sequence is padded to 64.
Each token is tagged `blank` (class 0) or, where the stroke is, with the digit it draws (classes
1..10 = digits 0..9); padding is tagged -100, which token classification leaves out. Whether a pixel
is stroke is in its token; which digit it draws is in the whole sequence. Inputs are named as a
transformers model's forward takes them (`input_ids`, `attention_mask`)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from pipeline.components.data import PreBatched
from pipeline.datasets.digits import digits
from pipeline.datasets.images import ImageTensors

PAD, IGNORE = 0, -100
# PAD and intensities 0..16
VOCAB = 18
# intensity (0..16) above which a pixel is stroke
INK = 4


class DigitTokens(Dataset):
    def __init__(self, images: ImageTensors, length: int):
        # back to the intensities 0..16
        pixels = (images.x.flatten(1) * 16).round().long()
        self.input_ids = torch.full((len(pixels), length), PAD, dtype=torch.int64)
        self.tags = torch.full((len(pixels), length), IGNORE, dtype=torch.int64)
        for i, (row, digit) in enumerate(zip(pixels, images.y)):
            n = int(row.nonzero().max()) + 1 if row.any() else 1
            self.input_ids[i, :n] = row[:n] + 1
            self.tags[i, :n] = torch.where(row[:n] > INK, digit + 1, 0)
        self.attention_mask = (self.input_ids != PAD).long()

    def __len__(self) -> int:
        return len(self.tags)

    def __getitem__(self, i):
        return {
            "input_ids": self.input_ids[i],
            "attention_mask": self.attention_mask[i],
        }, self.tags[i]

    def __getitems__(self, indices: list[int]):
        idx = torch.as_tensor(indices)
        return PreBatched(
            (
                {"input_ids": self.input_ids[idx], "attention_mask": self.attention_mask[idx]},
                self.tags[idx],
            )
        )


def digit_tokens(val_fraction: float = 0.2, split_seed: int = 0) -> dict[str, DigitTokens]:
    """The `digits` data set's split (the same images in each split); the training set names the
    tags and suggests `vocab_size`."""
    images = digits(val_fraction, split_seed)
    length = images["train"].x[0].numel()
    train, val = DigitTokens(images["train"], length), DigitTokens(images["val"], length)
    train.classes = ["blank"] + images["train"].classes
    train.model_args = {"vocab_size": VOCAB}
    return {"train": train, "val": val}
