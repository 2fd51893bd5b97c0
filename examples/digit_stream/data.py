"""A data component whose training split is a stream of its own (docs/data.md, "Your own stream"):
the digits as an IterableDataset that deals itself over ranks and loader workers and keeps its
position, as torchdata's Stateful protocol asks. Written the way a stream over a database cursor or
a message queue would be; for files, write them as shards instead (`pipeline data shard`), which
resume at any world size.

    data.component=examples.digit_stream.data:digit_stream
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import IterableDataset, TensorDataset, get_worker_info


class DigitStream(IterableDataset):
    """Each epoch a seeded shuffle of the samples; rank r takes every world-th of it, its worker w
    every workers-th of those. The state is (epoch, samples this worker yielded in it)."""

    def __init__(
        self, x: torch.Tensor, y: torch.Tensor, classes: list[str], model_args: dict, seed: int = 0
    ):
        self.x, self.y, self.classes, self.model_args, self.seed = x, y, classes, model_args, seed
        self.epoch, self.position = 0, 0

    def _rank(self) -> tuple[int, int]:
        import torch.distributed as dist

        return (
            (dist.get_rank(), dist.get_world_size())
            if dist.is_available() and dist.is_initialized()
            else (0, 1)
        )

    # the samples this rank's copy yields an epoch
    def __len__(self) -> int:
        rank, world = self._rank()
        return len(range(rank, len(self.y), world))

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def __iter__(self):
        rank, world = self._rank()
        worker = get_worker_info()
        w, workers = (worker.id, worker.num_workers) if worker else (0, 1)
        order = torch.randperm(
            len(self.y), generator=torch.Generator().manual_seed(self.seed + self.epoch)
        )
        mine = order[rank::world][w::workers]
        for i in mine[self.position :].tolist():
            self.position += 1
            yield self.x[i], self.y[i]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


class UnsizedDigitStream(DigitStream):
    # a stream that does not know its length (len() raises TypeError): train.max_steps says how long
    __len__ = None


def digit_stream(
    seed: int = 0, stateful: bool = True, sized: bool = True, val_fraction: float = 0.2
) -> dict:
    """scikit-learn's digits (8x8, intensities scaled to [0, 1]): the training split streamed, the
    validation split map-style. `stateful=False` leaves out state_dict/load_state_dict,
    `sized=False` len(): to see trainserve refuse such streams, or ask for train.max_steps."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.from_numpy(data.images.astype(np.float32) / 16.0).unsqueeze(1)
    y = torch.from_numpy(data.target.astype(np.int64))
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_val = int(round(len(y) * val_fraction))
    train_x, train_y = x[order[n_val:]], y[order[n_val:]]
    classes = [str(d) for d in range(10)]
    # What the model takes from the data (the data contract's model_args): its input shape and
    # normalization.
    model_args = {
        "in_channels": 1,
        "image_size": 8,
        "mean": [float(train_x.mean())],
        "std": [float(train_x.std())],
    }
    stream = (DigitStream if sized else UnsizedDigitStream)(
        train_x, train_y, classes, model_args, seed
    )
    if not stateful:
        stream = _Forgetful(stream)
    val = TensorDataset(x[order[:n_val]], y[order[:n_val]])
    val.classes = classes
    return {"train": stream, "val": val}


class _Forgetful(IterableDataset):
    def __init__(self, inner: DigitStream):
        self.inner, self.classes, self.model_args = inner, inner.classes, inner.model_args

    def __iter__(self):
        return iter(self.inner)
