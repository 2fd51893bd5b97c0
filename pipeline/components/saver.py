"""The training loop's checkpoint saves: synchronous, or asynchronous (checkpoint.async_save) with one write in
flight at a time.

Asynchronous: a save returns once the state is staged in CPU memory; the shards are written by a thread while
training goes on. Each step (`poll`, collective) the ranks agree whether every rank's write is done; then, and
only then, the save is published as a synchronous one is (hashes, COMPLETE marker, atomic rename:
checkpoint.finish_save), and what follows a publish (best.json, the MLflow upload) runs. A save waits for the
one before it, and `close` for the last. A crash before the publish leaves the previous checkpoint, as it would
mid-way through a synchronous save.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable

import torch

from pipeline.components import checkpoint
from pipeline.distributed import DistInfo
from pipeline.tools import stopping


class Saver:
    def __init__(self, root: Path, info: DistInfo, keep_last: int, asynchronous: bool):
        self.root, self.info, self.keep_last = Path(root), info, keep_last
        self.writer = checkpoint.AsyncWriter(info) if asynchronous else None
        self.pending: tuple[checkpoint.PendingSave, tuple, Callable[[Path], None]] | None = None

    def save(self, step: int, model, optimizer, meta: dict, protect: tuple[int | None, ...],
             then: Callable[[Path], None]) -> None:
        """Collective. Saves the state of `step`; `then(path)` once it is published (at once when synchronous)."""
        self.finish()
        # A SIGTERM (preemption, docker stop) lets the save finish: DCP would otherwise wrap the exit in a
        # CheckpointException, and a stop right after a complete save loses nothing.
        with stopping.deferred():
            pending = checkpoint.start_save(self.root, step, model, optimizer, meta, self.info, self.writer)
        self.pending = (pending, protect, then)
        if self.writer is None:
            self.finish()

    def poll(self) -> None:
        """Collective, each step: publishes the save in flight once every rank's write is done."""
        if self.pending is None:
            return
        written = self.pending[0].written
        done = torch.tensor([int(written is None or written.done())], device=self.info.device)
        if self.info.distributed:
            torch.distributed.all_reduce(done, op=torch.distributed.ReduceOp.MIN)
        if done.item():
            self.finish()

    def finish(self) -> Path | None:
        """Collective: waits for the save in flight, if any, and publishes it."""
        if self.pending is None:
            return None
        pending, protect, then = self.pending
        self.pending = None
        with stopping.deferred():
            path = checkpoint.finish_save(pending, self.info, self.keep_last, protect)
        then(path)
        return path

    def close(self) -> None:
        """Collective: the last save published, the staging buffers freed."""
        try:
            self.finish()
        finally:
            if self.writer is not None:
                self.writer.close()


def snapshot(obj):
    """A shallow copy, for a callback that runs after the save is published: what it records must be the
    state of the step saved, not of a later one."""
    return copy.copy(obj)
