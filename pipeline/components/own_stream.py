"""A data component's own training stream: an IterableDataset that implements torchdata's Stateful
protocol.

Such a stream deals itself: each rank's copy yields that rank's samples (the stream reads
`torch.distributed.get_rank()` and `get_worker_info()` to split itself over ranks and loader
workers), and its `state_dict()` / `load_state_dict()` hold its position. torchdata's
StatefulDataLoader batches it and keeps each worker's state; every rank's state goes into the
checkpoint, so a resume, at the world size and `data.num_workers` it was saved with, continues
exactly where each rank stopped. (The sharded source, pipeline/shards, needs neither: its position
is the same on every rank, at any world size.)

- **Refused**: a stream without `state_dict` / `load_state_dict`, which could only be resumed by
  reading its batches again and skipping them, and a resume at another world size or number of
  workers (the saved states are per rank and per worker); each with the reason.
- **Epochs**: a stream with `len()` (the samples each rank's copy yields an epoch) has epochs; one
  without needs train.max_steps. `set_epoch(epoch)`, if it has one, is called at each epoch's start.
- **Lockstep**: ranks must train the same number of steps, or one would wait forever in a
  collective: every micro-batch is agreed on by all ranks (one small all-reduce), and the epoch ends
  for all at the first rank whose stream ends.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch

from pipeline.components.random_streams import loader_generator
from pipeline.errors import ConfigError, DataError

log = logging.getLogger(__name__)


def is_stateful(dataset) -> bool:
    return callable(getattr(dataset, "state_dict", None)) and callable(
        getattr(dataset, "load_state_dict", None)
    )


def has_length(dataset) -> bool:
    try:
        len(dataset)
    except TypeError:
        return False
    return True


def check_length(dataset, max_steps: int) -> None:
    """A stream without len() trains train.max_steps steps: without them it has no end."""
    if not has_length(dataset) and not max_steps:
        raise ConfigError(
            "the training split is a stream of the data component's own without len(): its epochs have "
            "no known length, so set train.max_steps (or give the stream __len__: the samples each "
            "rank's copy yields an epoch)"
        )


def first_items(dataset, count: int) -> list:
    """The stream's first `count` items, read without moving it: its state put back after (a queue
    or a cursor would otherwise lose them to the check)."""
    import itertools

    state = dataset.state_dict() if is_stateful(dataset) else None
    try:
        return list(itertools.islice(iter(dataset), count))
    finally:
        if state is not None:
            dataset.load_state_dict(state)


class OwnStreamLoader:
    """Batches of the stream on this rank. Its workers' base seed comes from a generator of its own,
    re-seeded from (seed, rank, epoch) at each epoch: a function of the epoch alone, so a resume's
    epochs draw the seeds the uninterrupted run's did (torchdata restores the seed of the epoch it
    resumes in)."""

    def __init__(
        self, dataset, batch: int, workers: int, pin_memory: bool, collate_fn, info, seed: int = 0
    ):
        from torchdata.stateful_dataloader import StatefulDataLoader

        self.dataset, self.batch, self.workers, self.info = dataset, batch, workers, info
        self.seed, self.epoch = seed, 0
        # torchdata 0.11 calls a deprecated torch API; harmless
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            # Workers forked each epoch (not persistent): each takes the epoch `set_epoch` gave the
            # stream.
            self.loader = StatefulDataLoader(
                dataset,
                batch_size=batch,
                num_workers=workers,
                collate_fn=collate_fn,
                pin_memory=pin_memory,
                drop_last=True,
                generator=loader_generator(seed, info.rank, 0),
            )

        # Each rank's copy may hold a sample more or less: every rank trains the steps the shortest
        # one has, or their step counts (and with them the evaluations and the schedule) would part
        # and a collective hang.
        self.length = None
        if has_length(dataset):
            mine = torch.tensor([len(dataset) // batch], dtype=torch.float64, device=info.device)
            if info.distributed:
                torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MIN)
            self.length = int(mine.item())

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("a stream without len()")
        return self.length

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        self.epoch = epoch
        self.loader.generator = loader_generator(self.seed, self.info.rank, epoch)

    def __iter__(self):
        batches = iter(self.loader)
        while True:
            batch = next(batches, None)
            if not self._every_rank_has(batch is not None):
                return
            yield batch

    def _every_rank_has(self, mine: bool) -> bool:
        if not self.info.distributed:
            return mine
        flag = torch.tensor([1.0 if mine else 0.0], device=self.info.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(flag.item())

    def state_dict(self) -> dict[str, Any]:
        """Every rank's loader state (each worker's stream state inside it), gathered: a
        collective."""
        from pipeline.distributed import all_gather_object

        return {
            "kind": "own-stream",
            "epoch": self.epoch,
            "workers": self.workers,
            "ranks": all_gather_object(self.loader.state_dict(), self.info),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "own-stream":
            raise DataError(
                "the checkpoint's data position is not that of a stream of your own; resume with the data "
                "it was trained on"
            )
        saved_world, world = len(state["ranks"]), self.info.world_size
        if saved_world != world or state["workers"] != self.workers:
            raise DataError(
                f"the checkpoint holds the positions of a stream of your own on {saved_world} ranks x "
                f"{state['workers']} loader workers; this run has {world} x {self.workers}. A stream's "
                "own state is per rank and per worker: resume with --nproc-per-node "
                f"{saved_world} data.num_workers={state['workers']}, or write the data as shards "
                "(`pipeline data shard`), which resume at any world size"
            )
        self.set_epoch(int(state["epoch"]))
        self.loader.load_state_dict(state["ranks"][self.info.rank])
        log.info(
            "the stream of your own resumes at epoch %d where rank %d stopped",
            self.epoch,
            self.info.rank,
        )
