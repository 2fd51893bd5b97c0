"""Dynamic batching: concurrent requests are gathered into one model run.

Knows neither HTTP nor onnxruntime: it is given `run(feeds) -> outputs` over dicts of arrays whose
first axis is the row axis, and an executor to call it in.

Policy (measured, see DESIGN.md): never wait while the engine is idle. What is queued when the
engine becomes free runs at once, as one batch of up to `max_batch_size` rows; requests that arrive
during a run form the next batch. `max_delay_ms` > 0 lets a partial batch wait at most that long
(from its oldest request) for more rows, for models where a bigger batch pays.

Only jobs whose arrays match the batch's first job past the row axis (shape and dtype) are merged:
a model with another dynamic axis (image size, sequence length) gets requests of different shapes,
and those wait, in order, for a batch of their own. When a merged batch fails, each of its jobs runs
alone: one client's values (an index past an embedding's size) fail that client's request only. A
failure anywhere else fails that batch's requests and the loop goes on; should the loop task end
anyway, `alive` turns False (the server reports not ready), waiting requests fail and new ones are
refused.

A run that takes longer than `run_timeout` fails its batch with RunTimedOut and `stalled` turns True
(the server reports not ready) until the run returns: the one engine thread is still inside it, so
the next batch waits for it. Jobs whose callers gave up (a request deadline) are dropped, not run.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np

Feeds = dict[str, np.ndarray]
log = logging.getLogger("serving.batcher")


class QueueFull(Exception):
    """The queue holds `max_queue_rows` rows already; the caller should retry later."""


class BatcherClosed(Exception):
    """The batcher is shutting down (or was replaced by a new model) and takes no new work."""


class RunTimedOut(Exception):
    """A model run took longer than the batcher's run_timeout; it may still be running."""


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
    - with `merge=False` (a model without a dynamic batch axis), every job runs alone;
    - a batch only holds jobs with the same input names, trailing shapes and dtypes as its first
      job; jobs skipped for that keep their order and lead a later batch;
    - every job's future is resolved: with its outputs, with the batch's error, or with
      BatcherClosed if the loop task ends.
    """

    def __init__(self, run: Callable[[Feeds], Feeds], executor: Executor, *, max_batch_size: int,
                 max_delay_ms: float, max_queue_rows: int, merge: bool = True,
                 on_batch: Callable[[int, float, list[float]], None] | None = None, run_timeout: float | None = None):
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
        self._batch: list[_Job] = []  # taken off the queue, not all answered yet
        self.run_timeout = run_timeout
        self.stalled = False  # a run is past run_timeout and still inside the engine

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="batcher")
        self._task.add_done_callback(self._loop_ended)

    @property
    def started(self) -> bool:
        return self._task is not None

    @property
    def alive(self) -> bool:
        """True while the loop task runs (from `start` until `close` returns, unless it died)."""
        return self._task is not None and not self._task.done()

    async def submit(self, feeds: Feeds, rows: int) -> Feeds:
        """Queue `rows` rows and wait for their outputs (same row order)."""
        if self._closing:
            raise BatcherClosed("the server is shutting down or switching models")
        if self._task is not None and self._task.done():
            raise BatcherClosed("the batcher has stopped (see the server log)")
        if self.queued_rows + rows > self.max_queue_rows:
            raise QueueFull(f"the queue is full ({self.queued_rows} of {self.max_queue_rows} rows waiting)")
        job = _Job(feeds, rows, asyncio.get_running_loop().create_future())
        self._queue.append(job)
        self.queued_rows += rows
        self._wakeup.set()
        return await job.future

    def flush(self) -> None:
        """From now on, never let a partial batch wait for more rows (shutdown has begun: run what is queued)."""
        self.max_delay = 0.0
        self._wakeup.set()

    async def close(self) -> None:
        """Take no new jobs, run every queued one (without waiting out any delay), then stop."""
        self._closing = True
        self._wakeup.set()
        if self._task is not None:
            await asyncio.wait({self._task})  # never raises: a loop that died was logged by _loop_ended

    def _loop_ended(self, task: asyncio.Task) -> None:
        """The loop task ended: normal after `close`; otherwise fail what waits, refuse what comes."""
        if task.cancelled() or task.exception() is not None:
            why = "was cancelled" if task.cancelled() else f"died: {task.exception()!r}"
            log.error("the batcher loop %s; failing %d waiting request(s), refusing new ones", why,
                      len(self._batch) + len(self._queue),
                      exc_info=None if task.cancelled() else task.exception())
        for job in [*self._batch, *self._queue]:
            if not job.future.done():
                job.future.set_exception(BatcherClosed("the batcher has stopped (see the server log)"))
        self._batch = []
        self._queue.clear()
        self.queued_rows = 0

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._queue:
                if self._closing:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
            self._batch = []
            try:
                if self.max_delay > 0:
                    await self._wait_for_rows(loop)
                else:
                    # One turn of the event loop before taking: requests whose handlers are already runnable
                    # (a burst that arrived together, over HTTP or gRPC) join this batch instead of the next.
                    # Measured on the tiny MLP at c=32: HTTP batches 16 -> 25-32 rows, gRPC 2.3 -> 4.5, each
                    # protocol 15-20 % more requests/s, c=1 latency unchanged; it waits for nothing.
                    await asyncio.sleep(0)
                self._batch = self._take()
                if self._batch:
                    await self._run_batch(loop, self._batch)
            except Exception as exc:  # the model (or anything else) failed: the batch learns why
                if not self._batch:
                    log.exception("the batcher failed before taking a batch")
                for job in self._batch:
                    if not job.future.done():  # the caller may have gone away
                        job.future.set_exception(exc)

    async def _run_batch(self, loop: asyncio.AbstractEventLoop, jobs: list[_Job]) -> None:
        try:
            outputs = await self._timed_run(loop, jobs)
        except RunTimedOut:
            raise
        except Exception:
            if len(jobs) == 1:
                raise
            # Whose values made the merged batch fail? Each alone answers: the others' requests succeed.
            for job in jobs:
                try:
                    result = await self._timed_run(loop, [job])
                except RunTimedOut:
                    raise
                except Exception as exc:
                    if not job.future.done():
                        job.future.set_exception(exc)
                else:
                    if not job.future.done():
                        job.future.set_result(result)
            return
        start = 0
        for job in jobs:
            if not job.future.done():  # the caller may have gone away
                job.future.set_result({k: v[start:start + job.rows] for k, v in outputs.items()}
                                      if len(jobs) > 1 else outputs)
            start += job.rows

    async def _timed_run(self, loop: asyncio.AbstractEventLoop, jobs: list[_Job]) -> Feeds:
        feeds = _concat([j.feeds for j in jobs])
        rows = sum(j.rows for j in jobs)
        started = time.perf_counter()
        running = loop.run_in_executor(self._executor, self._timed, feeds)
        try:
            outputs, began, ended = await asyncio.wait_for(asyncio.shield(running), self.run_timeout)
        except asyncio.TimeoutError:
            self.stalled = True
            log.error("a model run of %d rows has taken over %.0f s (--run-timeout); failing its requests, "
                      "not ready until it returns", rows, self.run_timeout)
            error = RunTimedOut(f"the model run took longer than {self.run_timeout:g} s (--run-timeout)")
            for job in jobs:
                if not job.future.done():
                    job.future.set_exception(error)
            await asyncio.wait({running})  # the engine thread is busy until then: the next batch waits
            self.stalled = False
            log.warning("the stalled model run returned after %.1f s; ready again", time.perf_counter() - started)
            raise error from None
        if self._on_batch is not None:
            # Queue time runs until the engine thread began this run (other models' runs may go first);
            # compute time is the run itself.
            self._on_batch(rows, ended - began, [began - j.arrived for j in jobs])
        return outputs

    def _timed(self, feeds: Feeds) -> tuple[Feeds, float, float]:
        """The run, on the engine thread, with when it began and ended (time.monotonic)."""
        began = time.monotonic()
        outputs = self._run(feeds)
        return outputs, began, time.monotonic()

    async def _wait_for_rows(self, loop: asyncio.AbstractEventLoop) -> None:
        """Let a partial batch wait for more rows until its oldest job is `max_delay` old (re-read on every
        wake-up: `flush` sets it to 0)."""
        while self.queued_rows < self.max_batch_size and not self._closing:
            remaining = self._queue[0].arrived + self.max_delay - time.monotonic()
            if remaining <= 0:
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except asyncio.TimeoutError:
                return

    def _take(self) -> list[_Job]:
        """The next batch: the oldest job, then following jobs of the same layout while they fit.

        A job of another layout is skipped and keeps its place; the first one of the right layout
        that does not fit ends the batch (it must not be overtaken by smaller ones behind it).
        """
        while self._queue and self._queue[0].future.done():  # its caller gave up: don't run it
            self.queued_rows -= self._queue.popleft().rows
        if not self._queue:
            return []
        first = self._queue.popleft()
        jobs, rows = [first], first.rows
        if self.merge:
            layout = _layout(first.feeds)
            skipped: list[_Job] = []
            while self._queue and rows < self.max_batch_size:
                job = self._queue[0]
                if job.future.done():  # its caller gave up
                    self.queued_rows -= self._queue.popleft().rows
                    continue
                if _layout(job.feeds) != layout:
                    skipped.append(self._queue.popleft())
                    continue
                if rows + job.rows > self.max_batch_size:
                    break
                jobs.append(self._queue.popleft())
                rows += job.rows
            self._queue.extendleft(reversed(skipped))
        self.queued_rows -= rows
        return jobs


def _layout(feeds: Feeds) -> tuple:
    """What must match for arrays to be concatenated along the row axis: names, trailing shapes, dtypes."""
    try:
        return tuple(sorted((name, a.shape[1:], a.dtype.str) for name, a in feeds.items()))
    except (AttributeError, TypeError):  # not arrays (a caller's bug): merged with nothing, fails alone
        return object()


def _concat(feeds: list[Feeds]) -> Feeds:
    if len(feeds) == 1:
        return feeds[0]
    return {name: np.concatenate([f[name] for f in feeds]) for name in feeds[0]}
