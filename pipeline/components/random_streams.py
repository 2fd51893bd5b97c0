"""The random streams a training step draws from, kept apart so that a resume continues each
exactly.

- The training process's generators (dropout, and whatever a model, a task, or a data set read with
  data.num_workers=0 draws): torch's default generator of each rank and its CUDA device's, Python's
  `random` and numpy's global one. A checkpoint holds each rank's state of all of them
  (checkpoint/dcp_read.py: rng_state), and a resume sets it immediately before its first step.
- The loaders' own generators: a DataLoader draws its workers' base seed from its generator each
  time it creates an iterator, torch's default one when it has none, and a resumed run creates its
  iterators at other points than the uninterrupted run did. So no loader here draws from the
  training's generators: each has a generator of its own, seeded from a key of its own
  (`loader_generator`).
- A loader worker's generators: a worker process is seeded once when it starts, and a resume starts
  fresh workers mid-epoch. So before each batch of the training set a worker seeds its generators
  from the batch itself (`WorkerSeeded`): what a data set draws for a batch, a random augmentation,
  is a function of (base seed, epoch, the batch's indices), whatever the worker read before and
  however many workers there are.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info


def loader_generator(*key: int) -> torch.Generator:
    """A loader's own generator, seeded from `key` alone (the same numbers on every machine)."""
    return torch.Generator().manual_seed(_words(key, 2))


def seed_worker_batch(base_seed: int, epoch: int, indices) -> None:
    """Seeds this process's torch (CPU), numpy and Python generators from a batch's identity."""
    words = np.random.SeedSequence([base_seed, epoch, *(int(i) for i in indices)]).generate_state(
        4, np.uint32
    )
    torch.default_generator.manual_seed(int(words[0]) << 32 | int(words[1]))
    np.random.seed(int(words[2]))
    random.seed(int(words[3]))


def _words(key, n: int) -> int:
    words = np.random.SeedSequence([int(k) for k in key]).generate_state(n, np.uint32)
    return int.from_bytes(words.astype("<u4").tobytes(), "little")


class WorkerSeeded(Dataset):
    """A map-style training set as its loader's workers read it: in a worker, each batch is read
    after seed_worker_batch(the loader's base seed, the epoch, its indices); in the training
    process, as it is. The epoch lives in shared memory: the loader's persistent workers see the one
    `set_epoch` writes."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset
        self.epoch = torch.zeros(1, dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self.epoch[0] = epoch

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        return self.dataset[index]

    def __getitems__(self, indices: list[int]):
        worker = get_worker_info()
        if worker is not None:
            # torch seeds worker k with base seed + k: the base seed is the loader's, for any k
            seed_worker_batch(worker.seed - worker.id, int(self.epoch[0]), indices)
        getitems = getattr(self.dataset, "__getitems__", None)
        return getitems(indices) if getitems else [self.dataset[i] for i in indices]
