"""Data sets, held in memory as float tensors in [0, 1] (N, C, H, W) and int64 labels.

Every loader returns a `Splits`: train and validation tensors plus the facts the model needs
(channels, size, classes, per-channel mean/std for the normalization inside the model).
Nothing is downloaded: digits ship with scikit-learn, Fashion-MNIST is read from a local path.
"""

from __future__ import annotations

import gzip
import json
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler

FASHION_MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "val_images": "t10k-images-idx3-ubyte",
    "val_labels": "t10k-labels-idx1-ubyte",
}
FASHION_MNIST_URL = "https://github.com/zalandoresearch/fashion-mnist#get-the-data"
FASHION_MNIST_LABELS = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                        "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]


class DataError(ValueError):
    """Data the user pointed at is missing or malformed; the message says which file and why."""


@dataclass
class Splits:
    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    labels: list[str]

    def info(self) -> dict:
        """What the model is built from: shape, classes and the training set's statistics."""
        c, h = self.train_x.shape[1], self.train_x.shape[2]
        mean = self.train_x.mean(dim=(0, 2, 3)).tolist()
        std = self.train_x.std(dim=(0, 2, 3)).clamp_min(1e-6).tolist()
        return {"channels": c, "size": h, "num_classes": len(self.labels), "mean": mean, "std": std,
                "labels": self.labels}


class InMemoryDataset(Dataset):
    """A tensor pair with a batched `__getitems__`, so the DataLoader gathers a batch with one
    index operation instead of collating 64 single samples."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __getitems__(self, indices: list[int]):
        idx = torch.as_tensor(indices)
        return self.x[idx], self.y[idx]


def collate_batch(batch):
    """The batch is already stacked by `__getitems__`."""
    return batch


def load_digits_splits(val_fraction: float, split_seed: int) -> Splits:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.from_numpy(digits.images.astype(np.float32) / 16.0).unsqueeze(1)  # 0..16 -> [0, 1]
    y = torch.from_numpy(digits.target.astype(np.int64))
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(split_seed))
    n_val = int(round(len(y) * val_fraction))
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    return Splits(x[train_idx], y[train_idx], x[val_idx], y[val_idx], [str(d) for d in range(10)])


def _open_idx(directory: Path, stem: str):
    """Opens `stem` or `stem.gz` in `directory`."""
    for candidate in (directory / stem, directory / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def read_idx(path: Path) -> np.ndarray:
    """Reads one IDX file (the MNIST format), gzipped or not, checking its header against its size."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as exc:
        raise DataError(f"{path}: cannot be read as {'gzip' if opener is gzip.open else 'IDX'} ({exc})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise DataError(f"{path}: not an IDX file of unsigned bytes (magic {raw[:4].hex() or 'missing'}, expected 0000080N)")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: truncated IDX header")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    expected = int(np.prod(dims))
    if len(raw) - header != expected:
        raise DataError(f"{path}: header says {dims} = {expected} bytes of data, file has {len(raw) - header}; "
                        "the file is truncated or corrupt")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def load_fashion_mnist_splits(path: str) -> Splits:
    directory = Path(path)
    found = {key: _open_idx(directory, stem) for key, stem in FASHION_MNIST_FILES.items()}
    missing = [FASHION_MNIST_FILES[k] for k, v in found.items() if v is None]
    if missing:
        raise DataError(
            f"data.path={path}: missing {', '.join(missing)} (each may also end in .gz). "
            f"Expected the four Fashion-MNIST files {', '.join(FASHION_MNIST_FILES.values())}; "
            f"get them from {FASHION_MNIST_URL} and put them in that directory.")
    arrays = {key: read_idx(p) for key, p in found.items()}
    for split in ("train", "val"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise DataError(f"data.path={path}: {split} images {images.shape} and labels {labels.shape} do not pair up "
                            "(expected (N, 28, 28) and (N,))")
        if labels.max(initial=0) >= len(FASHION_MNIST_LABELS):
            raise DataError(f"data.path={path}: {split} labels go up to {labels.max()}, expected 0..9")

    def to_tensors(images, labels):
        x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
        return x, torch.from_numpy(labels.astype(np.int64))

    tx, ty = to_tensors(arrays["train_images"], arrays["train_labels"])
    vx, vy = to_tensors(arrays["val_images"], arrays["val_labels"])
    return Splits(tx, ty, vx, vy, FASHION_MNIST_LABELS)


def load_synthetic_splits(channels: int, size: int, classes: int, samples: int, seed: int = 0) -> Splits:
    g = torch.Generator().manual_seed(seed)
    n_val = max(classes, samples // 8)
    x = torch.rand(samples + n_val, channels, size, size, generator=g)
    y = torch.randint(0, classes, (samples + n_val,), generator=g)
    return Splits(x[:samples], y[:samples], x[samples:], y[samples:], [str(c) for c in range(classes)])


def load_splits(data_cfg) -> Splits:
    if data_cfg.name == "digits":
        return load_digits_splits(data_cfg.val_fraction, data_cfg.split_seed)
    if data_cfg.name == "fashion_mnist":
        return load_fashion_mnist_splits(data_cfg.path)
    return load_synthetic_splits(data_cfg.synthetic_channels, data_cfg.synthetic_size,
                                 data_cfg.synthetic_classes, data_cfg.synthetic_samples)


def make_train_loader(splits: Splits, batch_size_per_rank: int, rank: int, world_size: int, seed: int,
                      num_workers: int, pin_memory: bool, grad_accum_steps: int = 1):
    """A stateful loader over this rank's shard of the training set.

    DistributedSampler gives rank r the indices perm[r::world] of one seeded permutation per epoch,
    so the union of all ranks' k-th batches is perm[k*B:(k+1)*B] whatever the world size: the same
    global batches for 1, 2 or 8 processes, which is what makes a resume at another world size exact.
    `drop_last` on both, so every step sees a full global batch. torchdata's StatefulDataLoader
    keeps the position inside the epoch for checkpoints.
    """
    from torchdata.stateful_dataloader import StatefulDataLoader

    dataset = InMemoryDataset(splits.train_x, splits.train_y)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                 drop_last=True)
    global_batch = batch_size_per_rank * world_size * grad_accum_steps
    if len(sampler) < batch_size_per_rank * grad_accum_steps:  # not one optimizer step per epoch
        raise DataError(f"the training set has {len(dataset)} samples, fewer than one global batch "
                        f"({global_batch}); lower train.global_batch_size")
    with warnings.catch_warnings():  # torchdata 0.11 calls a deprecated torch API; harmless
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        return StatefulDataLoader(dataset, batch_size=batch_size_per_rank, sampler=sampler, drop_last=True,
                                  num_workers=num_workers, pin_memory=pin_memory, collate_fn=collate_batch)


def val_shard(splits: Splits, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r evaluates samples r, r+W, ...: disjoint and complete, unlike DistributedSampler,
    which pads with repeats; the all-reduced counts are then exact."""
    return splits.val_x[rank::world_size], splits.val_y[rank::world_size]


def rescale_loader_state(state: dict, saved_world: int, world: int) -> dict:
    """The loader position saved by `saved_world` ranks, for `world` ranks.

    torchdata counts the samples each rank consumed; the global position is that count times the
    world size. With the world-size-invariant global batches above, `n * saved_world / world`
    samples per rank is exactly the same global position.
    """
    if saved_world == world:
        return state
    state = json.loads(json.dumps(state))  # a copy
    inner = state.get("_sampler_iter_state") or {}
    if "samples_yielded" not in inner:
        raise DataError("cannot move this data loader position to another world size: the saved loader "
                        "state has no samples_yielded (torchdata changed its format); resume with "
                        f"{saved_world} processes")
    inner["samples_yielded"] = inner["samples_yielded"] * saved_world // world
    return state
