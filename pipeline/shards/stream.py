"""A sharded split read as a stream: shuffled per epoch without a buffer, dealt to ranks and loader
workers, its position the whole of its state.

The order of epoch e is a function of (seed, e) alone: the shards in a seeded order, each shard's
row groups in a seeded order, each row group's rows in a seeded order (format.py: a row group is the
unit that is read). The epoch is that sequence of positions 0..N-1. Micro-batch k is positions [k*M,
(k+1)*M) with M the global micro-batch (per-rank batch x world size); rank r takes its contiguous
part [k*M + r*B, k*M + (r+1)*B), so that each rank reads the row groups of its own part. Loader
worker w of a rank makes the rank's micro-batches k = start + w, start + w + workers, ... in which
order the DataLoader hands them out, so the batches are the same with 0, 1 or 4 workers. The workers
live across epochs (persistent); where each epoch starts reaches them through a tensor in shared
memory.

So the position (epoch, samples consumed: k*M) is the state, and it is the same on every rank: rank
0's stands for all. A resume at another world size with the same global batch continues at the same
k, every sample of the epoch seen exactly once; nothing is buffered, so nothing is lost or repeated.
The memory a worker holds is one decoded row group and its shard's open file, whatever the size of
the data.
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate

from pipeline.errors import DataError, worker_message
from pipeline.shards import format as shard_format
from pipeline.tools.faults import record_samples
from serving.images import Preprocessing

log = logging.getLogger(__name__)

# a bounded sample of the stream (drift reference, int8 calibration) reads at most this many row
# groups
SAMPLE_GROUPS = 32


@dataclass(frozen=True)
class Deal:
    """How one rank reads the stream: its per-rank batch, its place in the world, the seed; and
    where the epoch to read starts, (epoch, micro-batches already consumed), in a tensor in shared
    memory: the loader's workers live across epochs, and read it anew at the start of each."""

    batch: int
    rank: int
    world: int
    seed: int
    # int64 [epoch, start]
    where: torch.Tensor

    @property
    def micro_batch(self) -> int:
        return self.batch * self.world


class ShardedStream(IterableDataset):
    """The training split of a sharded data set. Iterated alone it yields its samples
    `(inputs, target)` in file order (what the data checks read); dealt (`dealt(...)`, what the
    training loader does) it yields this rank's collated micro-batches of the epoch's shuffled
    order."""

    def __init__(self, location: str, check: bool = True):
        self.manifest = opened(self, location, check)
        if self.manifest.model_args:
            self.model_args = dict(self.manifest.model_args)
        self.deal: Deal | None = None

    def __len__(self) -> int:
        return self.manifest.rows

    def dealt(self, deal: Deal) -> "ShardedStream":
        dealt = copy.copy(self)
        dealt.deal = deal
        return dealt

    def __iter__(self) -> Iterator:
        if self.deal is None:
            return (sample for _, sample in _file_order(self.manifest))
        return self._micro_batches()

    def _micro_batches(self) -> Iterator:
        deal = self.deal
        epoch, start = (int(v) for v in deal.where.tolist())
        worker = get_worker_info()
        w, workers = (worker.id, worker.num_workers) if worker else (0, 1)
        order = epoch_order(self.manifest, deal.seed, epoch)
        reader = _GroupCache(self.manifest)
        try:
            for k in range(start + w, len(self) // deal.micro_batch, workers):
                first = k * deal.micro_batch + deal.rank * deal.batch
                ids, batch = order.read_batch(reader, first, first + deal.batch, default_collate)
                yield ids, batch
        finally:
            reader.close()

    def sample(self, count: int) -> list[tuple[Any, Any]]:
        """About `count` samples spread over the split, read from at most SAMPLE_GROUPS row groups
        (the drift reference and int8 calibration take them): bounded reads, the same samples every
        time."""
        groups = [(s, g) for s, g, _ in self.manifest.row_groups]
        picked = [
            groups[round(i * (len(groups) - 1) / max(1, min(SAMPLE_GROUPS, len(groups)) - 1))]
            for i in range(min(SAMPLE_GROUPS, len(groups)))
        ]
        picked = list(dict.fromkeys(picked))
        per_group = -(-count // len(picked))
        reader = shard_format.ShardReader(self.manifest)
        out: list[tuple[Any, Any]] = []
        try:
            for s, g in picked:
                group = reader.read_group(s, g)
                n = len(group["id"])
                rows = np.unique(np.linspace(0, n - 1, min(per_group, n)).astype(int))
                out.extend(
                    sample
                    for _, sample in shard_format.samples_of(
                        shard_format.take(group, rows), self.manifest.structure
                    )
                )
        finally:
            reader.close()
        return out[:count]


class ShardRows(Dataset):
    """The validation split of a sharded data set, map-style: sample i in file order, read a row
    group at a time (a loader in order reads each row group once)."""

    def __init__(self, location: str, check: bool = True):
        self.manifest = opened(self, location, check)
        self._starts = np.cumsum([0] + [rows for _, _, rows in self.manifest.row_groups])
        self._cache: _GroupCache | None = None

    def __len__(self) -> int:
        return self.manifest.rows

    def __getitem__(self, index: int):
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} of a split of {len(self)}")
        index %= len(self)
        block = int(np.searchsorted(self._starts, index, side="right")) - 1
        # a forked worker opens its own files
        if self._cache is None or self._cache.pid != os.getpid():
            self._cache = _GroupCache(self.manifest)
        group = self._cache.get(*self.manifest.row_groups[block][:2])
        row = np.array([index - self._starts[block]])
        return next(
            shard_format.samples_of(shard_format.take(group, row), self.manifest.structure)
        )[1]

    # a spawned worker process opens its own files
    def __getstate__(self):
        return {**self.__dict__, "_cache": None}

    def source_images(self) -> list[tuple[int, str, bytes]]:
        """(index, file suffix, file bytes) of the image files kept beside the shards (the data
        contract's, pipeline/components/data.py): sample `id` of a validation split written in order
        is its index."""
        return shard_format.read_examples(self.manifest)


def opened(split, location: str, check: bool) -> shard_format.Manifest:
    """The manifest of the split at `location`, checked against the store when `check`; its class
    names given to `split` (the data contract's `classes`)."""
    manifest = shard_format.read_manifest(location)
    if check:
        shard_format.check_against_store(manifest)
    if manifest.classes is not None:
        split.classes = list(manifest.classes)
    if manifest.preprocessing:
        split.preprocessing = Preprocessing.from_json(manifest.preprocessing["transform"])
    return manifest


def identity_of(manifest: shard_format.Manifest) -> dict[str, Any]:
    """The split's lineage, from the manifest alone: what `data.split_digest` gives for a sharded
    split."""
    return {
        "sha256": manifest.digest,
        "samples": manifest.rows,
        "targets": manifest.targets,
        "manifest": shard_format.join(manifest.location, shard_format.MANIFEST),
        "shards": len(manifest.shards),
    }


# --- the epoch's order --------------------------------------------------------------------------


@dataclass
class EpochOrder:
    """The epoch's blocks (shard, row group) in order, where each starts, and how to read
    positions."""

    manifest: shard_format.Manifest
    seed: int
    epoch: int
    blocks: list[tuple[int, int]]
    # starts[i]: the epoch position of block i's first row; starts[-1] = N
    starts: np.ndarray

    def takes(self, reader: "_GroupCache", first: int, stop: int) -> list[dict]:
        """The rows at positions first..stop-1 of the epoch, one `take` per row group they lie
        in."""
        out = []
        position = first
        while position < stop:
            block = int(np.searchsorted(self.starts, position, side="right")) - 1
            s, g = self.blocks[block]
            end = min(stop, int(self.starts[block + 1]))
            offsets = np.arange(position - self.starts[block], end - self.starts[block])
            # Read (its shard opened, its footer's rows checked against the manifest's) before its
            # rows are permuted: a permutation of declared rows costs what the manifest says, not
            # the file.
            group = reader.get(s, g)
            rows = row_order(
                self.seed, self.epoch, s, g, int(self.starts[block + 1] - self.starts[block])
            )[offsets]
            out.append(shard_format.take(group, rows))
            position = end
        return out

    def read(self, reader: "_GroupCache", first: int, stop: int) -> list[tuple[int, tuple]]:
        """(id, sample) at positions first..stop-1 of the epoch."""
        return [
            item
            for taken in self.takes(reader, first, stop)
            for item in shard_format.samples_of(taken, self.manifest.structure)
        ]

    def read_batch(
        self, reader: "_GroupCache", first: int, stop: int, collate
    ) -> tuple[list[int], Any]:
        """(ids, the collated batch) of positions first..stop-1: stacked column by column where the
        columns allow, else sample by sample through `collate`."""
        takes = self.takes(reader, first, stop)
        ids = [int(i) for taken in takes for i in taken["id"]]
        batch = shard_format.batch_of(takes, self.manifest.structure)
        if batch is None:
            batch = collate(
                [
                    sample
                    for taken in takes
                    for _, sample in shard_format.samples_of(taken, self.manifest.structure)
                ]
            )
        return ids, batch


def epoch_order(manifest: shard_format.Manifest, seed: int, epoch: int) -> EpochOrder:
    shards = _rng(seed, epoch).permutation(len(manifest.shards))
    blocks = []
    for s in shards.tolist():
        groups = _rng(seed, epoch, s).permutation(len(manifest.shards[s].row_groups))
        blocks.extend((s, g) for g in groups.tolist())
    sizes = [manifest.shards[s].row_groups[g]["rows"] for s, g in blocks]
    return EpochOrder(manifest, seed, epoch, blocks, np.cumsum([0] + sizes))


@lru_cache(maxsize=64)
def row_order(seed: int, epoch: int, shard: int, group: int, rows: int) -> np.ndarray:
    return _rng(seed, epoch, shard, group).permutation(rows)


def _rng(*key: int) -> np.random.Generator:
    """A generator of the key alone (numpy's PCG64 from a SeedSequence: the same numbers on every
    machine)."""
    return np.random.default_rng([int(k) for k in key])


def _file_order(manifest: shard_format.Manifest) -> Iterator[tuple[int, tuple]]:
    reader = shard_format.ShardReader(manifest)
    try:
        for s, g, rows in manifest.row_groups:
            yield from shard_format.samples_of(
                shard_format.take(reader.read_group(s, g), np.arange(rows)), manifest.structure
            )
    finally:
        reader.close()


class _GroupCache:
    """The last decoded row group (consecutive reads of a worker land in the same one)."""

    def __init__(self, manifest: shard_format.Manifest):
        self.reader = shard_format.ShardReader(manifest)
        self.pid = os.getpid()
        self.key: tuple[int, int] | None = None
        self.group: dict | None = None

    def get(self, shard: int, group: int) -> dict:
        if self.key != (shard, group):
            # the old one freed before the new one is decoded
            self.group, self.key = None, None
            self.group, self.key = self.reader.read_group(shard, group), (shard, group)
        return self.group

    def close(self) -> None:
        self.reader.close()


# --- the training loader ------------------------------------------------------------------------


class StreamLoader:
    """The training loader of a sharded stream: this rank's micro-batches of each epoch, through a
    DataLoader with `workers` processes, and the position (epoch, samples consumed) that a
    checkpoint keeps."""

    def __init__(
        self,
        stream: ShardedStream,
        batch: int,
        rank: int,
        world: int,
        seed: int,
        workers: int,
        pin_memory: bool,
    ):
        self.stream, self.batch, self.rank, self.world, self.seed = stream, batch, rank, world, seed
        self.workers, self.pin_memory = workers, pin_memory
        self.epoch, self.position = 0, 0
        # what the workers read: Deal.where
        self._where = torch.zeros(2, dtype=torch.int64).share_memory_()
        self._loader = None

    @property
    def micro_batch(self) -> int:
        return self.batch * self.world

    def __len__(self) -> int:
        return len(self.stream) // self.micro_batch

    def set_epoch(self, epoch: int) -> None:
        """A new epoch starts at its beginning; the epoch a resume restored keeps its position."""
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def __iter__(self):
        # What a worker imports to read Parquet (pyarrow imports pandas as it reads a row group),
        # imported here before the workers fork: each would otherwise import them itself before its
        # first batch.
        import pyarrow.parquet  # noqa: F401
        from torch.utils.data import DataLoader

        try:
            import pandas  # noqa: F401
        except ImportError:
            pass

        self._where[0], self._where[1] = self.epoch, self.position // self.micro_batch
        # persistent workers: forked once, told where each epoch starts through _where
        if self._loader is None:
            deal = Deal(self.batch, self.rank, self.world, self.seed, self._where)
            # Its own generator: the iterator's draw of a worker seed leaves training's stream alone
            # (the workers draw nothing: the order is a function of the seed and the epoch).
            self._loader = DataLoader(
                self.stream.dealt(deal),
                batch_size=None,
                num_workers=self.workers,
                pin_memory=self.pin_memory,
                persistent_workers=self.workers > 0,
                generator=torch.Generator().manual_seed(self.seed),
            )
        batches = iter(self._loader)
        while True:
            try:
                ids, micro_batch = next(batches)
            except StopIteration:
                return
            except DataError as exc:
                # a shard named by a worker: its message, not torch's wrapper around it
                raise DataError(worker_message(exc)) from None
            record_samples(
                {
                    "epoch": self.epoch,
                    "k": self.position // self.micro_batch,
                    "rank": self.rank,
                    "world": self.world,
                    "ids": ids,
                }
            )
            self.position += self.micro_batch
            yield micro_batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "sharded-stream",
            "epoch": self.epoch,
            "position": self.position,
            "manifest": self.stream.manifest.digest,
            "micro_batch": self.micro_batch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "sharded-stream":
            raise DataError(
                "the checkpoint's data position is a map-style loader's; this run streams a sharded "
                "split: resume it with the data it was trained on"
            )
        if state["manifest"] != self.stream.manifest.digest:
            raise DataError(
                f"the checkpoint was trained on the sharded split with manifest digest "
                f"{state['manifest'][:16]}; {shard_format.join(self.stream.manifest.location, 'manifest.json')} "
                f"is {self.stream.manifest.digest[:16]}: resume with the data it was trained on"
            )
        if state["position"] % self.micro_batch:
            raise DataError(
                f"the checkpoint stopped {state['position']} samples into epoch {state['epoch']}, which is "
                f"not a whole number of this run's micro-batches of {self.micro_batch} (per-rank batch "
                f"{self.batch} x {self.world} ranks); resume with the same train.global_batch_size and "
                f"train.grad_accum_steps ({state['micro_batch']} samples a micro-batch)"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        log.info(
            "the stream resumes at epoch %d, sample %d of %d",
            self.epoch,
            self.position,
            len(self.stream),
        )
