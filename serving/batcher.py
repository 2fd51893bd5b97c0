"""Dynamic batching: concurrent requests are gathered into one model run.

Knows neither HTTP nor onnxruntime: it is given `run(parts) -> outputs`, where `parts` are the batch's requests'
feeds (dicts of arrays whose first axis is the row axis; gathering them into one batch is the run's business:
the engine copies them straight into its batch buffer), and the server's Runner (serving/runner.py), the thread
that runs it. `submit` may be awaited from any event loop: a request's answer comes back to the loop it was
asked on.

Policy (measured, see DESIGN.md): never wait while the engine is idle. The batch is taken when the engine
thread is free to run it: what is queued then runs at once, as one batch of up to `max_batch_size` rows, and
requests that arrive during a run form the next batch. `max_delay_ms` > 0 lets a partial batch wait at most
that long (from its oldest request) for more rows, for models where a bigger batch pays.

Only jobs whose arrays match the batch's first job past the row axis (shape and dtype) are merged:
a model with another dynamic axis (image size, sequence length) gets requests of different shapes,
and those wait, in order, for a batch of their own. When a merged batch fails, each of its jobs runs
alone: one client's values (an index past an embedding's size) fail that client's request only. A
failure anywhere else fails that batch's requests and the batcher goes on; should the engine thread die
anyway, `alive` turns False (the server reports not ready), waiting requests fail and new ones are refused.

A run that takes longer than `run_timeout` fails its batch with RunTimedOut and `stalled` turns True
(the server reports not ready) until the run returns: the engine thread is still inside it, so
the next batch waits for it. Jobs whose callers gave up (a request deadline) are dropped, not run.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
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
    loop: asyncio.AbstractEventLoop
    arrived: float = field(default_factory=time.monotonic)


class Run:
    """One batch on the engine thread, as the runner's watchdog sees it."""

    def __init__(self, batcher: "Batcher", jobs: list[_Job]):
        self.batcher, self.jobs = batcher, jobs
        self.timeout = batcher.run_timeout
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._returned = False
        self.expired = False

    def timed_out(self) -> None:
        """The watchdog's call: the run is past its deadline. Its requests fail now; the batcher is stalled until
        the run returns."""
        with self._lock:
            if self._returned:
                return
            self.expired = True
        b = self.batcher
        b.stalled = True
        rows = sum(j.rows for j in self.jobs)
        log.error("a model run of %d rows has taken over %.0f s (--run-timeout); failing its requests, "
                  "not ready until it returns", rows, self.timeout)
        error = RunTimedOut(f"the model run took longer than {self.timeout:g} s (--run-timeout)")
        _deliver([(job, error, True) for job in self.jobs])

    def returned(self) -> bool:
        """The run is back; True if the watchdog had failed it meanwhile."""
        with self._lock:
            self._returned = True
            return self.expired


class Batcher:
    """Gathers jobs (a request's rows) into batches that its runner's thread runs, one at a time.

    Invariants:
    - at most one `run` of this batcher is in flight (the runner has one thread, and a batcher holds at most
      one turn in its queue);
    - the queue never holds more than `max_queue_rows` rows (a job is refused, never truncated);
    - a job larger than `max_batch_size` rows runs alone, never split; the caller caps rows per
      request;
    - with `merge=False` (a model without a dynamic batch axis), every job runs alone;
    - a batch only holds jobs with the same input names, trailing shapes and dtypes as its first
      job; jobs skipped for that keep their order and lead a later batch;
    - every job's future is resolved: with its outputs, with the batch's error, or with
      BatcherClosed if the engine thread dies.
    Its queue is shared by the event loops that submit and the engine thread that takes: under `_lock`.
    """

    def __init__(self, run: Callable[[list[Feeds]], Feeds], runner, *, max_batch_size: int,
                 max_delay_ms: float, max_queue_rows: int, merge: bool = True,
                 on_batch: Callable[[int, float, list[float]], None] | None = None, run_timeout: float | None = None):
        self._run = run
        self._runner = runner
        self.max_batch_size = max_batch_size
        self.max_delay = max_delay_ms / 1000.0
        self.max_queue_rows = max_queue_rows
        self.merge = merge
        self._on_batch = on_batch
        self.run_timeout = run_timeout
        self._lock = threading.Lock()
        self._queue: collections.deque[_Job] = collections.deque()
        self.queued_rows = 0
        self._batch: list[_Job] = []  # taken off the queue, being run
        self._closing = False
        self._closed = False
        self._dead = False
        self._started = False
        self._drain_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self.stalled = False  # a run is past run_timeout and still inside the engine

    def start(self) -> None:
        self._started = True

    @property
    def started(self) -> bool:
        return self._started

    @property
    def alive(self) -> bool:
        """True from `start` until `close` returns, unless the engine thread died."""
        return self._started and not self._closed and not self._dead and self._runner.alive

    async def submit(self, feeds: Feeds, rows: int) -> Feeds:
        """Queue `rows` rows and wait for their outputs (same row order)."""
        loop = asyncio.get_running_loop()
        job = _Job(feeds, rows, loop.create_future(), loop)
        with self._lock:
            if self._closing:
                raise BatcherClosed("the server is shutting down or switching models")
            if self._dead or not self._runner.alive:
                raise BatcherClosed("the batcher has stopped (see the server log)")
            if self.queued_rows + rows > self.max_queue_rows:
                raise QueueFull(f"the queue is full ({self.queued_rows} of {self.max_queue_rows} rows waiting)")
            self._queue.append(job)
            self.queued_rows += rows
        self._runner.ready(self)
        return await job.future

    def flush(self) -> None:
        """From now on, never let a partial batch wait for more rows (shutdown has begun: run what is queued)."""
        self.max_delay = 0.0
        self._runner.ready(self)

    async def close(self) -> None:
        """Take no new jobs, run every queued one (without waiting out any delay), then stop."""
        loop = asyncio.get_running_loop()
        with self._lock:
            self._closing = True
            if self._dead or (not self._queue and not self._batch):
                self._closed = True
                return
            done = loop.create_future()
            self._drain_waiters.append((loop, done))
        self._runner.ready(self)
        await done

    # ---- on the engine thread ----

    def serve(self, runner) -> None:
        """This batcher's turn: take a batch (or, waiting out max_delay, ask for a turn later) and run it."""
        with self._lock:
            self._drop_abandoned()
            if not self._queue:
                self._settle_drained()
                return
            if self.max_delay > 0 and not self._closing and self.queued_rows < self.max_batch_size:
                due = self._queue[0].arrived + self.max_delay
                if due > time.monotonic():
                    runner.ready_at(self, due)
                    return
            self._batch = jobs = self._take()
        try:
            self._run_batch(runner, jobs)
        except Exception as exc:  # noqa: BLE001 - a bug of ours: the batch's requests still get an answer
            log.exception("running a batch failed")
            _deliver([(job, exc, True) for job in jobs])
        # (a BaseException, the thread being killed, leaves self._batch for runner_died to fail)
        with self._lock:
            self._batch = []
            more = bool(self._queue)
            if not more:
                self._settle_drained()
        if more:
            runner.ready(self)

    def runner_died(self) -> None:
        """The engine thread is gone: fail what waits, refuse what comes."""
        with self._lock:
            self._dead = True
            jobs = [*self._batch, *self._queue]
            self._batch, self._queue = [], collections.deque()
            self.queued_rows = 0
            waiters, self._drain_waiters = self._drain_waiters, []
        error = BatcherClosed("the batcher has stopped (see the server log)")
        _deliver([(job, error, True) for job in jobs])
        for loop, done in waiters:
            _call_soon(loop, _resolve, done)

    def _settle_drained(self) -> None:
        """(under _lock) Closing and nothing left: wake those waiting in close()."""
        if self._closing and not self._queue:
            self._closed = True
            waiters, self._drain_waiters = self._drain_waiters, []
            for loop, done in waiters:
                _call_soon(loop, _resolve, done)

    def _run_batch(self, runner, jobs: list[_Job]) -> None:
        """Runs `jobs` as one batch and answers each; a merged batch that fails runs again job by job."""
        outcome = self._timed_run(runner, jobs)
        if outcome is None:  # timed out: its requests were failed by the watchdog
            return
        outputs, error = outcome
        if error is None:
            start, answers = 0, []
            for job in jobs:  # (the engine's outputs have exactly the batch's rows: its padding is cut off)
                answers.append((job, outputs if len(jobs) == 1 else
                                {k: v[start:start + job.rows] for k, v in outputs.items()}, False))
                start += job.rows
            _deliver(answers)
            return
        if len(jobs) == 1:
            _deliver([(jobs[0], error, True)])
            return
        # Whose values made the merged batch fail? Each alone answers: the others' requests succeed.
        for job in jobs:
            if job.future.done():
                continue
            outcome = self._timed_run(runner, [job])
            if outcome is None:
                return
            outputs, error = outcome
            _deliver([(job, error, True) if error is not None else (job, outputs, False)])

    def _timed_run(self, runner, jobs: list[_Job]) -> tuple[Feeds | None, Exception | None] | None:
        """(outputs, None) or (None, error); None when the run outlived run_timeout (already answered)."""
        run = Run(self, jobs)
        runner.began(run)
        try:
            outputs, error = self._run([job.feeds for job in jobs]), None
        except Exception as exc:  # the model (or anything else) failed: the batch learns why
            outputs, error = None, exc
        finally:
            runner.ended()
        ended = time.monotonic()
        if run.returned():
            self.stalled = False
            log.warning("the stalled model run returned after %.1f s; ready again", ended - run.started)
            return None
        if self._on_batch is not None:
            # Queue time runs until the engine thread began this run (other models' runs may go first);
            # compute time is the run itself.
            try:
                self._on_batch(sum(j.rows for j in jobs), ended - run.started, [run.started - j.arrived for j in jobs])
            except Exception:  # noqa: BLE001 - a metric must never fail an answer
                log.exception("recording a batch's metrics failed")
        return outputs, error

    def _drop_abandoned(self) -> None:
        """(under _lock) Jobs at the head whose callers gave up (a request deadline): never run."""
        while self._queue and self._queue[0].future.done():
            self.queued_rows -= self._queue.popleft().rows

    def _take(self) -> list[_Job]:
        """(under _lock) The next batch: the oldest job, then following jobs of the same layout while they fit.

        A job of another layout is skipped and keeps its place; the first one of the right layout
        that does not fit ends the batch (it must not be overtaken by smaller ones behind it).
        """
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
        return (object(),)


def concat(parts: list[Feeds]) -> Feeds:
    """The parts as one batch (a new array per input; the engine gathers into its own buffer instead)."""
    if len(parts) == 1:
        return parts[0]
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def _deliver(answers: list[tuple[_Job, object, bool]]) -> None:
    """Each job's answer (outputs, or an exception when the flag says so), on the loop it was asked on: one
    wake-up per loop and batch."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for job, value, is_error in answers:
        by_loop.setdefault(job.loop, []).append((job.future, value, is_error))
    for loop, items in by_loop.items():
        _call_soon(loop, _settle, items)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that loop has closed (shutdown): nobody waits there any more
        pass


def _settle(items) -> None:
    for future, value, is_error in items:
        if not future.done():  # the caller may have gone away
            if is_error:
                future.set_exception(value)
            else:
                future.set_result(value)


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
