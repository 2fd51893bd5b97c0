"""A folder of image files, one sub-folder a class (`root/<class>/*.png|jpg|...`), read lazily: the form photos
usually come in. Every image is decoded with Pillow, converted to `mode` (L: 1 channel, RGB: 3) and resized to
`image_size` x `image_size`, as float32 in [0, 1], channels first. `mode` unset keeps the images' own
channels: L when the images are grey (every one of up to 256 spread over the folder: Pillow's 1, L, LA,
I, I;16 or F), else RGB (alpha dropped). Both splits carry that transform as data (`preprocessing`,
serving/images.py): export records it with the model, and its server then takes image files and computes the
tensors training computed. `pipeline data shard` turns it into shards, which carry it too (docs/data.md):

    pipeline data shard --config C --out OUT data.component=pipeline.datasets:image_folder \
        "data.args={root: photos}"
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from pipeline.errors import DataError
from serving.images import Preprocessing, apply

SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
# The per-channel mean/std the built-in models normalize with, and the images' own mode, are read
# from this many images spread over the folder.
STATS_SAMPLES = 256
# The files a split gives to prove its preprocessing on (ImageFiles.source_images).
SOURCE_IMAGES = 64
# Pillow's modes of one grey channel: such images stay 1-channel (L) unless `mode` says otherwise.
GREY_MODES = ("1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F")


class ImageFiles(Dataset):
    """The files, each read through `preprocessing` (serving/images.py: the description an exported
    model can carry, applied by the same function a server applies)."""

    def __init__(
        self, files: list[tuple[Path, int]], classes: list[str], preprocessing: Preprocessing
    ):
        self.files, self.classes, self.preprocessing = files, classes, preprocessing

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i):
        from PIL import Image, UnidentifiedImageError

        path, label = self.files[i]
        try:
            with Image.open(path) as image:
                x = apply(self.preprocessing, image)
        except (OSError, UnidentifiedImageError) as exc:
            raise unreadable(path, exc) from None
        return torch.from_numpy(x), torch.tensor(label, dtype=torch.int64)

    def source_images(self) -> list[tuple[int, str, bytes]]:
        """(index, file suffix, file bytes) of up to SOURCE_IMAGES samples spread over the split:
        the files their inputs are made from (the export gate decodes them as a server does;
        `pipeline data shard` keeps them)."""
        found = []
        for i in spread(len(self.files), SOURCE_IMAGES):
            path = self.files[i][0]
            try:
                found.append((i, path.suffix.lower(), path.read_bytes()))
            except OSError as exc:
                raise unreadable(path, exc) from None
        return found


def image_folder(
    root: str,
    image_size: int = 32,
    mode: str | None = None,
    val_fraction: float = 0.2,
    split_seed: int = 0,
) -> dict[str, ImageFiles]:
    """A fixed, seeded train/validation split of the files (`split_seed`, independent of
    train.seed); `mode` None: the images' own (own_mode)."""
    folder = Path(root)
    if not folder.is_dir():
        raise DataError(
            f"data.args.root={root} is not a directory; give a folder with one sub-folder per class"
        )
    if mode not in (None, "L", "RGB"):
        raise DataError(
            f"data.args.mode={mode!r}: give 'L' (grey, 1 channel) or 'RGB' (3 channels), or leave it "
            "out for the images' own"
        )
    if not 0 < val_fraction < 1:
        raise DataError(
            f"data.args.val_fraction={val_fraction} must be between 0 and 1 (exclusive)"
        )
    classes = sorted(d.name for d in folder.iterdir() if d.is_dir() and not d.name.startswith("."))
    files = [
        (f, c)
        for c, name in enumerate(classes)
        for f in sorted((folder / name).rglob("*"))
        if f.suffix.lower() in SUFFIXES and f.is_file()
    ]
    if len(classes) < 2 or not files:
        raise DataError(
            f"{root} holds {len(classes)} class folder(s) and {len(files)} image(s) ({', '.join(SUFFIXES)}); "
            "a classification data set needs a sub-folder per class (at least 2) with images in them"
        )
    mode = mode or own_mode([f for f, _ in files])
    perm = torch.randperm(len(files), generator=torch.Generator().manual_seed(split_seed)).tolist()
    n_val = max(1, int(round(len(files) * val_fraction)))
    # Pixel values in [0, 1], channels first; the built-in models normalize inside (model_args
    # below).
    preprocessing = Preprocessing(mode=mode, size=(image_size, image_size), resample="bilinear")
    train = ImageFiles([files[i] for i in perm[n_val:]], classes, preprocessing)
    val = ImageFiles([files[i] for i in perm[:n_val]], classes, preprocessing)
    sample = torch.stack([train[i][0] for i in spread(len(train))])
    train.model_args = {
        "in_channels": sample.shape[1],
        "image_size": image_size,
        "mean": sample.mean(dim=(0, 2, 3)).tolist(),
        "std": sample.std(dim=(0, 2, 3)).clamp_min(1e-6).tolist(),
    }
    return {"train": train, "val": val}


def own_mode(files: list[Path]) -> str:
    """L when every one of up to STATS_SAMPLES images spread over `files` is grey (GREY_MODES), else
    RGB: only their headers are read."""
    from PIL import Image, UnidentifiedImageError

    for i in spread(len(files)):
        try:
            with Image.open(files[i]) as image:
                if image.mode not in GREY_MODES:
                    return "RGB"
        except (OSError, UnidentifiedImageError) as exc:
            raise unreadable(files[i], exc) from None
    return "L"


def spread(n: int, count: int = STATS_SAMPLES) -> list[int]:
    """Up to `count` positions spread evenly over `n` items, first and last included."""
    return np.unique(np.linspace(0, n - 1, min(count, n)).astype(int)).tolist()


def unreadable(path: Path, exc: Exception) -> DataError:
    return DataError(
        f"{path} can't be read as an image ({type(exc).__name__}: {exc}); remove it or replace it"
    )
