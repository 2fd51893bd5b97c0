"""Fashion-MNIST from its four IDX files in a local directory; nothing is downloaded."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import torch

from pipeline.components.data import DataError
from pipeline.datasets.images import ImageTensors, image_splits

FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "val_images": "t10k-images-idx3-ubyte",
    "val_labels": "t10k-labels-idx1-ubyte",
}
URL = "https://github.com/zalandoresearch/fashion-mnist#get-the-data"
LABELS = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]


def fashion_mnist(path: str) -> dict[str, ImageTensors]:
    """`path`: the directory with the four standard files, each optionally gzipped."""
    directory = Path(path)
    found = {key: _find(directory, stem) for key, stem in FILES.items()}
    missing = [FILES[k] for k, v in found.items() if v is None]
    if missing:
        raise DataError(
            f"data.args.path={path}: missing {', '.join(missing)} (each may also end in .gz). "
            f"Expected the four Fashion-MNIST files {', '.join(FILES.values())}; "
            f"get them from {URL} and put them in that directory."
        )
    arrays = {key: read_idx(p) for key, p in found.items()}
    for split in ("train", "val"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise DataError(
                f"data.args.path={path}: {split} images {images.shape} and labels {labels.shape} do "
                "not pair up (expected (N, 28, 28) and (N,))"
            )
        if labels.max(initial=0) >= len(LABELS):
            raise DataError(
                f"data.args.path={path}: {split} labels go up to {labels.max()}, expected 0..9"
            )

    def to_tensors(images, labels):
        return (
            torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1),
            torch.from_numpy(labels.astype(np.int64)),
        )

    tx, ty = to_tensors(arrays["train_images"], arrays["train_labels"])
    vx, vy = to_tensors(arrays["val_images"], arrays["val_labels"])
    return image_splits(tx, ty, vx, vy, LABELS)


def _find(directory: Path, stem: str) -> Path | None:
    """`stem` or `stem.gz` in `directory`."""
    for candidate in (directory / stem, directory / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def read_idx(path: Path) -> np.ndarray:
    """Reads one IDX file (the MNIST format), gzipped or not, checking its header against its
    size."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as exc:
        raise DataError(
            f"{path}: cannot be read as {'gzip' if opener is gzip.open else 'IDX'} ({exc})"
        ) from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise DataError(
            f"{path}: not an IDX file of unsigned bytes (magic {raw[:4].hex() or 'missing'}, expected 0000080N)"
        )
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: truncated IDX header")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    expected = int(np.prod(dims))
    if len(raw) - header != expected:
        raise DataError(
            f"{path}: header says {dims} = {expected} bytes of data, file has {len(raw) - header}; "
            "the file is truncated or corrupt"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)
