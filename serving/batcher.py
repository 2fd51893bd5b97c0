"""Dynamic batching: concurrent requests are gathered into one model run.

Knows neither HTTP nor onnxruntime: it is given `run(feeds) -> outputs` over dicts of arrays whose
first axis is the row axis, and an executor to call it in.

Policy (measured, see DESIGN.md): never wait while the engine is idle. What is queued when the
engine becomes free runs at once, as one batch of up to `max_batch_size` rows; requests that arrive
during a run form the next batch. `max_delay_ms` > 0 lets a partial batch wait at most that long
(from its oldest request) for more rows, for models where a bigger batch pays.
"""

from __future__ import annotations

import asyncio
import collections
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

Feeds = dict[str, np.ndarray]


class QueueFull(Exception):
    """The queue holds `max_queue_rows` rows already; the caller should retry later."""


class BatcherClosed(Exception):
    """The batcher is shutting down (or was replaced by a new model) and takes no new work."""


@dataclass
class _Job:
    feeds: Feeds
    rows: int
    future: asyncio.Future
    arrived: float = field(default_factory=time.monotonic)


class Batcher:
    """Gathers jobs (a request's rows) into batches and runs them one batch at a time.

    Invariants:
    - at most one `run` of this batcher is in flight, in `executor`;
    - the queue never holds more than `max_queue_rows` rows (a job is refused, never truncated);
    - a job larger than `max_batch_size` rows runs alone, never split; the caller caps rows per
      request;
    - with `merge=False` (a model without a dynamic batch axis), every job runs alone.
    """

    def __init__(self, run: Callable[[Feeds], Feeds], executor: Executor, *, max_batch_size: int,
                 max_delay_ms: float, max_queue_rows: int, merge: bool = True,
                 on_batch: Callable[[int, float], None] | None = None):
        self._run = run
        self._executor = executor
        self.max_batch_size = max_batch_size
        self.max_delay = max_delay_ms / 1000.0
        self.max_queue_rows = max_queue_rows
        self.merge = merge
        self._on_batch = on_batch
        self._queue: collections.deque[_Job] = collections.deque()
        self.queued_rows = 0
        self._wakeup = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="batcher")

    async def submit(self, feeds: Feeds, rows: int) -> Feeds:
        """Queue `rows` rows and wait for their outputs (same row order)."""
        if self._closing:
            raise BatcherClosed("the server is shutting down or switching models")
        if self.queued_rows + rows > self.max_queue_rows:
            raise QueueFull(f"the queue is full ({self.queued_rows} of {self.max_queue_rows} rows waiting)")
        job = _Job(feeds, rows, asyncio.get_running_loop().create_future())
        self._queue.append(job)
        self.queued_rows += rows
        self._wakeup.set()
        return await job.future

    async def close(self) -> None:
        """Take no new jobs, run every queued one (without waiting out any delay), then stop."""
        self._closing = True
        self._wakeup.set()
        if self._task is not None:
            await self._task

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._queue:
                if self._closing:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
            if self.max_delay > 0:
                await self._wait_for_rows(loop)
            jobs = self._take()
            feeds = _concat([j.feeds for j in jobs])
            rows = sum(j.rows for j in jobs)
            started = time.perf_counter()
            try:
                outputs = await loop.run_in_executor(self._executor, self._run, feeds)
            except Exception as exc:  # the model failed: every request of the batch learns why
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(exc)
                continue
            if self._on_batch is not None:
                self._on_batch(rows, time.perf_counter() - started)
            start = 0
            for job in jobs:
                if not job.future.done():  # the caller may have gone away
                    job.future.set_result({k: v[start:start + job.rows] for k, v in outputs.items()}
                                          if len(jobs) > 1 else outputs)
                start += job.rows

    async def _wait_for_rows(self, loop: asyncio.AbstractEventLoop) -> None:
        """Let a partial batch wait for more rows until its oldest job is `max_delay` old."""
        deadline = self._queue[0].arrived + self.max_delay
        while self.queued_rows < self.max_batch_size and not self._closing:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except asyncio.TimeoutError:
                return

    def _take(self) -> list[_Job]:
        jobs = [self._queue.popleft()]
        rows = jobs[0].rows
        while self.merge and self._queue and rows + self._queue[0].rows <= self.max_batch_size:
            job = self._queue.popleft()
            jobs.append(job)
            rows += job.rows
        self.queued_rows -= rows
        return jobs


def _concat(feeds: list[Feeds]) -> Feeds:
    if len(feeds) == 1:
        return feeds[0]
    return {name: np.concatenate([f[name] for f in feeds]) for name in feeds[0]}
