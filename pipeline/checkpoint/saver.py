"""The training loop's checkpoint saves: synchronous, or asynchronous (checkpoint.async_save) with
one save in flight at a time.

Asynchronous: a save returns once the state is staged in CPU memory; the shards are written, hashed
and, once every rank's are written, published as a synchronous save is (COMPLETE marker, atomic
rename: formats.WRITTEN.finish_save) by background threads with their own process group. Each step
`poll` looks (no collective) whether this rank's publish is done, and runs what follows a publish
(best.json, the MLflow upload). A save waits for the one before it, and `close` for the last. A
crash before the publish leaves the previous checkpoint, as it would mid-way through a synchronous
save.

The console hears of the saves once, at the end ("saved 6 checkpoints to outputs/x/checkpoints, kept
2 (...)"); each save gets its own line at --verbose, or when it was slow (SLOW_SAVE_S): in a short
run they were a fifth of the console.
"""

from __future__ import annotations

import copy
import logging
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

from pipeline import checkpoint
from pipeline.checkpoint import formats
from pipeline.checkpoint.dcp import AsyncWriter
from pipeline.checkpoint.object_store import location
from pipeline.distributed import DistInfo
from pipeline.tools import stopping
from pipeline.tools.every import Every
from serving.console import verbose

log = logging.getLogger(__name__)

# a save this long (staging, writing and publishing) is said at once: it is time the run lost
SLOW_SAVE_S = 10.0


class Saver:
    def __init__(
        self, root: Path, info: DistInfo, keep_last: int, asynchronous: bool, every: int = 0
    ):
        # A Path, or an s3:// StoreUrl
        self.root = location(root)
        self.info, self.keep_last, self.every = info, keep_last, Every(every)
        self.writer = AsyncWriter(info) if asynchronous else None
        self.pending: tuple[Future, Callable[[Path], None], float] | None = None
        # For the summary
        self.saved, self.seconds = 0, 0.0

    def due(self, step: int, last: bool) -> bool:
        """A save at each `every`-th step (checkpoint.every_n_steps; none when 0) and at the last.
        The loop saves at each new best too."""
        return self.every.due(step, last)

    def save(
        self,
        step: int,
        model,
        optimizer,
        meta: dict,
        protect: tuple[int | None, ...],
        then: Callable[[Path], None],
    ) -> None:
        """Collective. Saves the state of `step`; `then(path)` once it is published (at once when
        synchronous)."""
        self.finish()
        started = time.perf_counter()
        # A SIGTERM (preemption, docker stop) lets the save finish: DCP would otherwise wrap the
        # exit in a CheckpointException, and a stop right after a complete save loses nothing.
        with stopping.deferred():
            pending = formats.WRITTEN.start_save(
                self.root, step, model, optimizer, meta, self.info, self.writer
            )
            if self.writer is None:
                path = formats.WRITTEN.finish_save(pending, self.info, self.keep_last, protect)
                self._published(path, time.perf_counter() - started)
                then(path)
                return
        self.pending = (
            self.writer.publish(pending, self.info, self.keep_last, protect),
            then,
            started,
        )

    def poll(self) -> None:
        """Each step: what follows the publish of the save in flight, once it is done (a local
        look)."""
        if self.pending is not None and self.pending[0].done():
            self.finish()

    def finish(self) -> Path | None:
        """Waits for the save in flight, if any: its publish, then what follows it."""
        if self.pending is None:
            return None
        published, then, started = self.pending
        self.pending = None
        with stopping.deferred():
            # raises what the write or the publish raised
            path = published.result()
        # asynchronous: until this rank saw it published
        self._published(path, time.perf_counter() - started)
        then(path)
        return path

    def _published(self, path: Path, seconds: float) -> None:
        self.saved, self.seconds = self.saved + 1, self.seconds + seconds
        if self.info.is_main and (verbose() or seconds >= SLOW_SAVE_S):
            log.info("checkpoint saved: %s (%.1f s)", path, seconds)

    def close(self) -> None:
        """Collective: the last save published, the background threads and staging buffers freed;
        the summary said."""
        try:
            self.finish()
        finally:
            if self.writer is not None:
                self.writer.close()
        if self.info.is_main and self.saved:
            kept = [p.name for p in checkpoint.list_complete(self.root)]
            log.info(
                "saved %d checkpoint%s to %s (%.1f s in all), kept %d (%s)",
                self.saved,
                "" if self.saved == 1 else "s",
                self.root,
                self.seconds,
                len(kept),
                ", ".join(kept),
            )


def snapshot(obj):
    """A shallow copy, for a callback that runs after the save is published: what it records must be
    the state of the step saved, not of a later one."""
    return copy.copy(obj)
