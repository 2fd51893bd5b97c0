"""Dynamic batching: concurrent requests are gathered into one model run.

Knows neither HTTP nor onnxruntime: it is given `run(parts) -> outputs`, where `parts` are the
batch's requests' feeds (dicts of arrays whose first axis is the row axis; gathering them into one
batch is the run's business), `run_gathered(feeds, rows) -> outputs` for a batch gathered in a batch
buffer (padded to a bucket), and the server's Runner (serving/runner.py), the thread that runs it.
`submit` may be awaited from any event loop: a request's answer comes back to the loop it was asked
on.

Batch buffers (a model of fixed shapes past the batch axis, given `buffers` and `run_gathered`): a
request takes rows in a batch buffer, received straight into them or copied in when submitted
(checked for NaN and Inf there), and the engine runs a buffer's rows as they are.
serving/placements.py owns those rows and the pool; the batcher asks it for a request's place
(`arriving(rows)`, `place`), hands it each job, and takes its runs from it. A request that fits no
buffer (more rows than a batch, or every buffer taken, e.g. by slow uploads) waits in the queue, and
is gathered into a free buffer (or by the engine) when it runs.

Policy (see DESIGN.md; the measurements behind it: docs/benchmarks.md#servingbatcherpy): never wait
for requests that have not begun to arrive. The batch
is taken when the engine thread is free to run it: what is queued then runs at once, as one batch of
up to `max_batch_size` rows, and requests that arrive during a run form the next batch; a loop in
the middle of a turn of taking requests in tells the engine when the turn is over, if the batch is
due then (so what it took in runs together, never waiting past the turn, and the engine is not woken
to find it should wait). While requests are on their way (`arriving()`), the batch waits for them,
at most `arrival_wait_ms` from when it could first have run: taking a large body in costs the event
loop time, and many clients uploading at once would otherwise make batches of the one or two that
happened to be complete. The wait ends by itself when every client in flight has
its request in (no more can arrive before an answer goes out), and never starts for a lone client.
A run takes consecutive rows of a buffer, so a request still arriving ends it, and the buffer's
rest (requests that came in behind the straggler, in rows reserved before the run sealed it) waits
likewise, for its own places still arriving only, at most `arrival_wait_ms` again: they then run
as one, not a few rows at a time (front-end processes, whose requests take places in turn, leave
such rests often).
Requests on their way for which no model is named yet (`incoming`: ModelInfer messages grpc's C++
server is still receiving, whose model is named inside; the server counts them only where one model
version is loaded and no token is required) make the batch wait likewise. `max_delay_ms` > 0 lets a
partial batch wait at most that long (from its oldest request) for more rows, arriving or not, for
models where a bigger batch pays.

Only jobs whose arrays match the batch's first job past the row axis (shape and dtype) are merged: a
model with another dynamic axis (image size, sequence length) gets requests of different shapes, and
those wait, in order, for a batch of their own. When a merged batch fails, each of its jobs runs
alone: one client's values (an index past an embedding's size) fail that client's request only. A
failure anywhere else fails that batch's requests and the batcher goes on; should the engine thread
die anyway, `alive` turns False (the server reports not ready), waiting requests fail and new ones
are refused.

A run that takes longer than `run_timeout` fails its batch with RunTimedOut and `stalled` turns True
(the server reports not ready) until the run returns: the engine thread is still inside it, so the
next batch waits for it. Jobs whose callers gave up (a request deadline) are dropped, not run.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from serving.placements import Arrival, Gathered, Placements, Span
from serving.staging import check_finite
from serving.statistics import VersionStatistics

Feeds = dict[str, np.ndarray]
# what may still join a batch (Batcher._next_batch): requests arriving anywhere (its buffer takes
# places, or it is the queue's); only places of its own buffer still arriving (a sealed buffer's
# rest); nothing
ANY_ARRIVAL, OWN_ARRIVALS, NOTHING = range(3)
log = logging.getLogger("serving.batcher")


class QueueFull(Exception):
    """The queue holds `max_queue_rows` rows already; the caller should retry later."""


class BatcherClosed(Exception):
    """The batcher is shutting down (or was replaced by a new model) and takes no new work."""


class RunTimedOut(Exception):
    """A model run took longer than the batcher's run_timeout; it may still be running."""


class NotRowWise(Exception):
    """A batched run's outputs do not have the run's rows on their first axis: the model's rows are
    not independent (it was declared batchable wrongly). The run's requests fail with it (never an
    answer cut from the outputs), and the batcher runs every request alone from then on."""


@dataclass
class _Job:
    feeds: Feeds
    rows: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    arrived: float = field(default_factory=time.monotonic)


class Run:
    """One batch on the engine thread, as the runner's watchdog sees it (and its times, for the
    statistics)."""

    def __init__(self, batcher: "Batcher", jobs: list[_Job]):
        self.batcher, self.jobs = batcher, jobs
        self.timeout = batcher.run_timeout
        self.started = time.monotonic()
        self.ended = self.started
        self._lock = threading.Lock()
        self._returned = False
        self.expired = False

    def timed_out(self) -> None:
        """The watchdog's call: the run is past its deadline. Its requests fail now; the batcher is
        stalled until the run returns."""
        with self._lock:
            if self._returned:
                return
            self.expired = True
        self.batcher.stalled = True
        rows = sum(j.rows for j in self.jobs)
        log.error(
            "a model run of %d rows has taken over %.0f s (--run-timeout); failing its requests, "
            "not ready until it returns",
            rows,
            self.timeout,
        )
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
    - at most one `run` of this batcher is in flight (the runner has one thread, and a batcher holds
      at most one turn in its queue);
    - the queue never holds more than `max_queue_rows` rows (a job is refused, never truncated);
    - a job larger than `max_batch_size` rows runs alone, never split; the caller caps rows per
      request;
    - with `merge=False` (a model not known to be row-wise), every job runs alone; a run that raises
      NotRowWise turns `merge` off for good (one log line), and its jobs fail with it, never run
      again one by one;
    - a batch only holds jobs with the same input names, trailing shapes and dtypes as its first
      job; jobs skipped for that keep their order and lead a later batch;
    - the batch buffers' rows are serving/placements.py's, with its invariants: no row is written
      while a run reads it; a buffer returns to the pool only when every place ran or died;
    - every job's future is resolved: with its outputs, with the batch's error, or with
      BatcherClosed if the engine thread dies.
    Its state is shared by the event loops that submit and the engine thread that takes: under
    `_lock`, which is taken before the placements' own, never after.
    """

    def __init__(
        self,
        run: Callable[[list[Feeds]], Feeds],
        runner,
        *,
        max_batch_size: int,
        max_delay_ms: float,
        max_queue_rows: int,
        merge: bool = True,
        on_batch: Callable[[int, float, list[float]], None] | None = None,
        run_timeout: float | None = None,
        buffers=None,
        run_gathered: Callable[[Feeds, int], Feeds] | None = None,
        bucket_for: Callable[[int], int] = lambda rows: rows,
        arrival_wait_ms: float = 0.0,
        incoming: Callable[[], int] | None = None,
        name: str = "the model",
        observe: Callable[[Feeds, Feeds], None] | None = None,
        placements: Placements | None = None,
    ):
        # the version it runs, in its log lines
        self.name = name
        # `observe(feeds, outputs)` is told of each batch the model ran (drift). It is handed to the
        # runs: only they see the rows as they ran, padding cut off, before the buffer is reused.
        if observe is not None:
            run = partial(run, observe=observe)
            run_gathered = run_gathered and partial(run_gathered, observe=observe)
        self._run = run
        # (feeds of a batch bucket's rows, the requests' rows among them) -> outputs
        self._run_gathered = run_gathered
        # the batch buffers' rows (`buffers`: a staging.BatchBuffers), the requests on their way;
        # or `placements` the caller made (an arena's, serving/arena.py: front-end processes place
        # requests in its rows too)
        self._placements = placements or Placements(
            buffers if run_gathered is not None and merge else None, max_batch_size, bucket_for
        )
        self._runner = runner
        self.max_batch_size = max_batch_size
        self.max_delay = max_delay_ms / 1000.0
        self.max_queue_rows = max_queue_rows
        self.merge = merge
        self._on_batch = on_batch
        self.run_timeout = run_timeout
        self.arrival_wait = arrival_wait_ms / 1000.0
        # requests on their way no model is named for yet (gRPC messages): see _should_wait
        self._incoming = incoming
        self._lock = threading.Lock()
        # jobs with no place in a buffer
        self._queue: collections.deque[_Job] = collections.deque()
        # a batch waits for arrivals until then
        self._wait_until: float | None = None
        # the engine's turn asked for at the end of --max-delay-ms
        self._delay_until: float | None = None
        # loops that will tell the engine thread (see _kick)
        self._kicks: set[asyncio.AbstractEventLoop] = set()
        self.queued_rows = 0
        # taken, being run
        self._batch: list[_Job] = []
        self._closing = False
        self._closed = False
        self._dead = False
        self._started = False
        self._drain_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        # a run is past run_timeout and still inside the engine
        self.stalled = False
        # Triton's statistics of this version (serving/statistics.py), fed per successful run
        self.statistics = VersionStatistics()
        # (engine thread) when the run in progress was taken: its input phase begins
        self._taken = 0.0

    def start(self) -> None:
        self._started = True

    @property
    def buffers(self):
        """The batch buffers requests are placed in (staging.BatchBuffers), or None."""
        return self._placements.buffers

    @property
    def started(self) -> bool:
        return self._started

    @property
    def alive(self) -> bool:
        """True from `start` until `close` returns, unless the engine thread died."""
        return self._started and not self._closed and not self._dead and self._runner.alive

    # ---- from the front ends (any event loop) ----

    def arriving(self, rows: int | None = None) -> Arrival:
        """A request for this batcher has begun to arrive (its head is in, its body on its way);
        with `rows`, it asks for a place in a batch buffer to receive its body into (see
        `Arrival.views`: None when there is none to be had)."""
        return self._placements.arriving(self, rows)

    def place(self, arrival: Arrival, rows: int) -> Feeds | None:
        """A place in a batch buffer for an arrival that now knows its rows (a V2 body whose header
        was read): the views to receive its body into, or None (no buffer free, too many rows, or it
        has one already)."""
        return self._placements.place(arrival, rows)

    @property
    def placements(self) -> Placements:
        return self._placements

    def adopt(self, source: int, index: int, k: int, ticket: int) -> Arrival:
        """A front-end process's arrival (counted under `source`, in place `k` of buffer `index`
        when it has one), handed to this process: to submit, or to end (Placements.adopt)."""
        return self._placements.adopt(self, source, index, k, ticket)

    def look_again(self) -> None:
        """Arrivals or a turn counted in another process were forgotten (it died): a batch that
        waited for them, or was left to that turn (_kick_coming), is looked at now."""
        self._runner.ready(self)

    def ended(self, arrival: Arrival) -> None:
        """An arrival that goes no further (Arrival.end): its place (if any) is dead."""
        with self._lock:
            if self._forget(arrival):
                self._runner.ready(self)
            self._placements.leave(arrival)

    def _forget(self, arrival: Arrival) -> bool:
        """(under _lock) True if the batch may have waited for this one: the last on its way, or one
        in a sealed buffer (whose rest waits for its own places only: OWN_ARRIVALS). The engine is
        to look again (submit kicks its loop for it, whether the request is queued or refused)."""
        last = self._placements.forget(arrival)
        sealed = arrival.place is not None and arrival.place.group.sealed
        return (last or sealed) and self._wait_until is not None

    async def submit(self, feeds: Feeds, rows: int, arrival: Arrival | None = None) -> Feeds:
        """Queue `rows` rows and wait for their outputs (same row order). `arrival`: this request's
        (ended now); when it has a place, `feeds` are its views, filled. NonFinite (staging) for a
        value that is NaN or Inf."""
        loop = asyncio.get_running_loop()
        job = _Job(feeds, rows, loop.create_future(), loop)
        place = arrival.place if arrival is not None and not arrival.over else None
        if place is not None and not arrival.filled and not _same_memory(feeds, place.views):
            # not what was received into it (a reload's other batcher): copied like any other
            place = None
        if place is not None and not arrival.checked:
            try:
                # here, on the thread that received it: its values are in this cache
                check_finite(feeds)
            except BaseException:
                arrival.end()
                raise
        placements, copy = self._placements, None
        with self._lock:
            if arrival is not None:
                if not arrival.over and self._forget(arrival):
                    # the batch waited for this one, the last: queued or refused below, it judges
                    self._kick(loop)
                placements.leave(arrival, keep=place)
            try:
                self._admit(rows)
            except BaseException:
                if place is not None:
                    placements.kill(place)
                raise
            if place is not None:
                place = placements.fill(place, job)
                if place is None:
                    # (killed meanwhile: the front-end process that held it went away)
                    raise BatcherClosed("the request's front end went away")
                # its place's rows (a moved request's new place: its old one may be handed out)
                job.feeds = place.views
            else:
                copy = placements.reserve_copy(feeds, rows)
                if copy is None:
                    self._queue.append(job)
            self.queued_rows += rows
        if copy is not None:
            # a place of its own: copied in (and checked) here, outside the lock
            try:
                placements.copy(copy, feeds)
            except BaseException:
                with self._lock:
                    # (read before the place dies: its buffer may then be handed out again)
                    sealed = copy.group.sealed
                    placements.kill(copy)
                    # (else runner_died counted it out with everything)
                    if not self._dead:
                        self.queued_rows -= rows
                    self._settle_drained()
                if sealed:
                    # the rest of its buffer may have waited for it (OWN_ARRIVALS)
                    self._kick(loop)
                raise
            with self._lock:
                if self._dead:
                    # the engine thread died meanwhile: runner_died failed what it could see
                    placements.kill(copy)
                    raise BatcherClosed("the batcher has stopped (see the server log)")
                placements.copied(copy, job)
        if (
            self._wait_until is None
            or not placements.on_the_way()
            or self.queued_rows >= self.max_batch_size
            or (copy is not None and copy.group.sealed)
        ):
            # (a batch waiting for arrivals is told when they are in: see _forget; the rest of a
            # sealed buffer, when a copy into it is done)
            self._kick(loop)
        return await job.future

    def _kick(self, loop: asyncio.AbstractEventLoop) -> None:
        """Tell the engine thread there is work, once this turn of the submitting loop is over: the
        requests whose handlers run in the same turn (taken in together, or answered together) then
        make one batch, not one each (an engine woken at the first would take it alone, the loop
        giving up the GIL at its next system call)."""
        if loop not in self._kicks:
            self._kicks.add(loop)
            loop.call_soon(self._kicked, loop)

    def _kicked(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop's turn is over: the engine thread is told if the batch is due now
        (`_should_wait` arms the wait's own wake-up otherwise). Deciding here rather than waking the
        engine to decide: on a loop saturated with uploads a kick comes every turn, and an engine
        woken by each would mostly go back to sleep, each wake a thread switch and a GIL hand-off
        (docs/benchmarks.md#servingbatcherpy)."""
        self._kicks.discard(loop)
        with self._lock:
            if not self._closing:
                if self._batch:
                    # a run is under way: the engine looks at what is queued when it returns
                    return
                next_batch = self._next_batch()
                if next_batch is None or self._should_wait(self._runner, *next_batch[1:]):
                    # nothing left (the engine took it); or waiting: its timer or a later kick tells
                    # it
                    return
        self._runner.ready(self)

    def _kick_coming(self) -> bool:
        """(engine thread) Whether a running loop will give this batcher a turn at the end of its
        turn. The engine, free between two runs, then leaves the batch to it rather than taking the
        one or two requests complete so far: a loop saturated with uploads gives the GIL away at
        every system call, and an engine that took a batch at each would run batches of a few rows
        (docs/benchmarks.md#servingbatcherpy). Likewise a front-end process in a turn of handing
        requests over (Placements.turns_under_way): its records come at the turn's end, and their
        submits kick."""
        return (
            any(loop.is_running() for loop in tuple(self._kicks))
            or self._placements.turns_under_way()
        )

    def _admit(self, rows: int) -> None:
        """(under _lock) Refusals of a new job."""
        if self._closing:
            raise BatcherClosed("the server is shutting down or switching models")
        if self._dead or not self._runner.alive:
            raise BatcherClosed("the batcher has stopped (see the server log)")
        if self.queued_rows + rows > self.max_queue_rows:
            raise QueueFull(
                f"the queue is full ({self.queued_rows} of {self.max_queue_rows} rows waiting)"
            )

    def flush(self) -> None:
        """From now on, never let a partial batch wait for more rows (shutdown has begun: run what
        is queued)."""
        self.max_delay = 0.0
        self.arrival_wait = 0.0
        self._runner.ready(self)

    async def close(self) -> None:
        """Take no new jobs, run every queued one (without waiting out any delay), then stop; the
        batch buffers are given back once the last of them is."""
        loop = asyncio.get_running_loop()
        with self._lock:
            self._closing = True
            self._placements.close()
            if self._dead or not (self._pending() or self._batch or self._placements.copying()):
                self._closed = True
                return
            done = loop.create_future()
            self._drain_waiters.append((loop, done))
        self._runner.ready(self)
        await done

    # ---- on the engine thread ----

    def serve(self, runner) -> None:
        """This batcher's turn: take a batch (or, waiting, ask for a turn later) and run it."""
        self._taken = time.monotonic()
        with self._lock:
            self._drop_abandoned()
            next_batch = self._next_batch()
            if next_batch is None:
                self._settle_drained()
                return
            span, rows, oldest, joining = next_batch
            if self.merge and rows < self.max_batch_size and self._kick_coming():
                # a loop is taking requests in: what it takes this turn joins the batch (see _kick)
                return
            if self._should_wait(runner, rows, oldest, joining):
                return
            if span is not None:
                jobs = self._placements.take(span)
                self.queued_rows -= sum(job.rows for job in jobs)
            else:
                jobs = self._take()
            self._batch = jobs
        try:
            if span is not None:
                self._run_span(runner, span, jobs)
            else:
                self._run_batch(runner, jobs)
        except Exception as exc:  # noqa: BLE001
            # a bug of ours: the batch's requests still get an answer
            log.exception("running a batch failed")
            _deliver([(job, exc, True) for job in jobs])
        # (a BaseException, the thread being killed, leaves self._batch for runner_died to fail)
        with self._lock:
            self._batch = []
            if span is not None:
                self._placements.done(span)
            more = self._pending()
            if not more:
                self._settle_drained()
        if more:
            runner.ready(self)

    def _next_batch(self) -> tuple[Span | None, int, float, int] | None:
        """(under _lock) What the next run would take: (the span of places (Placements.next_span),
        or None for the queue; its rows; its oldest request's arrival; what may still join it,
        ANY_ARRIVAL, OWN_ARRIVALS or NOTHING). The span or the queue, whichever holds the oldest
        request. None when nothing is queued, and then no wait is left standing either: one whose
        requests were given up would keep the next request's kick from being sent (see submit)."""
        span = self._placements.next_span()
        head = self._queue[0] if self._queue else None
        if span is None and head is None:
            self._wait_until = None
            return None
        oldest_placed = min(job.arrived for job in span.jobs) if span is not None else 0.0
        if span is not None and (head is None or oldest_placed <= head.arrived):
            if span.open:
                joining = ANY_ARRIVAL
            elif span.arriving and self._complete_rows() - span.rows < self.max_batch_size:
                joining = OWN_ARRIVALS
            else:
                # (a full batch could run behind it: the engine does not sit idle for its rest)
                joining = NOTHING
            return span, span.rows, oldest_placed, joining
        return None, self.queued_rows, head.arrived, ANY_ARRIVAL

    def _should_wait(self, runner, rows: int, oldest: float, joining: int) -> bool:
        """(under _lock) Whether the batch waits: out --max-delay-ms, or for requests arriving (see
        the module's docstring); asks for a turn when the wait ends at the latest."""
        if self._closing or not self.merge or rows >= self.max_batch_size or joining == NOTHING:
            self._wait_until = None
            return False
        now = time.monotonic()
        if joining == ANY_ARRIVAL and self.max_delay > 0 and oldest + self.max_delay > now:
            # (asked once, however often it is asked)
            if self._delay_until != oldest + self.max_delay:
                self._delay_until = oldest + self.max_delay
                runner.ready_at(self, self._delay_until)
            return True
        arriving = (
            joining == OWN_ARRIVALS
            or self._placements.on_the_way()
            or (self._incoming is not None and self._incoming())
        )
        if self.arrival_wait <= 0 or not arriving:
            self._wait_until = None
            return False
        if self._wait_until is None:
            self._wait_until = now + self.arrival_wait
            runner.ready_at(self, self._wait_until)
        if now < self._wait_until:
            return True
        self._wait_until = None
        return False

    def _complete_rows(self) -> int:
        """(under _lock) Rows of the requests that could run now: queued, or filled in a place."""
        return sum(job.rows for job in self._queue) + self._placements.filled_rows()

    def _pending(self) -> bool:
        """(under _lock) Jobs to run: queued, or complete in a place not run yet."""
        return bool(self._queue) or self._placements.pending()

    def runner_died(self) -> None:
        """The engine thread is gone: fail what waits, refuse what comes."""
        with self._lock:
            self._dead = True
            jobs = [*self._batch, *self._queue, *self._placements.clear()]
            self._batch, self._queue = [], collections.deque()
            self.queued_rows = 0
            waiters, self._drain_waiters = self._drain_waiters, []
        error = BatcherClosed("the batcher has stopped (see the server log)")
        _deliver([(job, error, True) for job in jobs])
        for loop, done in waiters:
            _call_soon(loop, _resolve, done)

    def _settle_drained(self) -> None:
        """(under _lock) Closing and nothing left: wake those waiting in close()."""
        if (
            self._closing
            and not self._pending()
            and not self._placements.copying()
            and not self._batch
        ):
            self._closed = True
            waiters, self._drain_waiters = self._drain_waiters, []
            for loop, done in waiters:
                _call_soon(loop, _resolve, done)

    def _run_span(self, runner, span: Span, jobs: list[_Job]) -> None:
        """Runs a taken span's rows as they are (Placements.batch) and answers each job; if it
        fails, each job runs again alone."""
        placements = self._placements
        outcome = self._timed_run(runner, jobs, lambda: self._run_rows(placements.batch(span)))
        # timed out: its requests were failed by the watchdog
        if outcome is None:
            return
        outputs, error, run = outcome
        if error is None:
            start, whole = span.start, len(span.places) == 1
            _deliver(
                [
                    (
                        p.job,
                        outputs
                        if whole
                        else {
                            k: v[p.start - start : p.start - start + p.rows]
                            for k, v in outputs.items()
                        },
                        False,
                    )
                    for p in span.places
                    if p.job is not None
                ]
            )
            self._executed(run)
            return
        self._one_by_one(runner, jobs, error)

    def _run_batch(self, runner, jobs: list[_Job]) -> None:
        """Runs queued `jobs` as one batch and answers each; if it fails, each job runs again
        alone."""
        outcome = self._timed_run(
            runner,
            jobs,
            lambda: self._run_rows(
                self._placements.gather([j.feeds for j in jobs], sum(j.rows for j in jobs))
            ),
        )
        # timed out: its requests were failed by the watchdog
        if outcome is None:
            return
        outputs, error, run = outcome
        if error is None:
            start, answers = 0, []
            # (the engine's outputs have exactly the batch's rows: its padding is cut off)
            for job in jobs:
                answers.append(
                    (
                        job,
                        outputs
                        if len(jobs) == 1
                        else {k: v[start : start + job.rows] for k, v in outputs.items()},
                        False,
                    )
                )
                start += job.rows
            _deliver(answers)
            self._executed(run)
            return
        self._one_by_one(runner, jobs, error)

    def _run_rows(self, gathered: Gathered) -> Feeds:
        """(engine thread) A batch through the engine: gathered in a batch buffer (which goes back
        once the run returns), or its parts for the engine to gather."""
        if gathered.feeds is None:
            return self._run(gathered.parts)
        try:
            return self._run_gathered(gathered.feeds, gathered.rows)
        finally:
            self._placements.let_go(gathered)

    def _one_by_one(self, runner, jobs: list[_Job], error: Exception) -> None:
        """A merged batch failed: whose values made it fail? Each alone answers: the others'
        requests succeed. Not after NotRowWise: those requests fail (their run proved the version
        was declared batchable wrongly)."""
        if len(jobs) == 1 or isinstance(error, NotRowWise):
            _deliver([(job, error, True) for job in jobs])
            return
        for job in jobs:
            if job.future.done():
                continue
            self._taken = time.monotonic()
            outcome = self._timed_run(
                runner,
                [job],
                lambda: self._run_rows(self._placements.gather([job.feeds], job.rows)),
            )
            if outcome is None:
                return
            outputs, error, run = outcome
            _deliver([(job, error, True) if error is not None else (job, outputs, False)])
            if error is None:
                self._executed(run)

    def _timed_run(
        self, runner, jobs: list[_Job], run: Callable[[], Feeds]
    ) -> tuple[Feeds | None, Exception | None, Run] | None:
        """(outputs, None, the run) or (None, error, the run); None when the run outlived
        run_timeout (already answered)."""
        timed = Run(self, jobs)
        runner.began(timed)
        try:
            outputs, error = run(), None
        except Exception as exc:
            # the model (or anything else) failed: the batch learns why
            outputs, error = None, exc
        finally:
            runner.ended()
        if isinstance(error, NotRowWise) and self.merge:
            with self._lock:
                self.merge = self._placements.merging = False
            log.error("%s: %s", self.name, error)
        ended = timed.ended = time.monotonic()
        if timed.returned():
            self.stalled = False
            log.warning(
                "the stalled model run returned after %.1f s; ready again", ended - timed.started
            )
            return None
        if self._on_batch is not None:
            # Queue time runs until the engine thread began this run (other models' runs may go
            # first); compute time is the run itself.
            try:
                self._on_batch(
                    sum(j.rows for j in jobs),
                    ended - timed.started,
                    [timed.started - j.arrived for j in jobs],
                )
            except Exception:  # noqa: BLE001
                # a metric must never fail an answer
                log.exception("recording a batch's metrics failed")
        return outputs, error, timed

    def _executed(self, run: Run) -> None:
        """(engine thread) A successful run's answers were handed out: its rows and phases to the
        statistics. A model run unbatched counts one inference a request, as Triton counts a model
        of max_batch_size 0."""
        jobs = run.jobs
        rows = sum(job.rows for job in jobs) if self.merge else len(jobs)
        arrivals = [job.arrived for job in jobs]
        self.statistics.executed(
            rows, arrivals, self._taken, run.started, run.ended, time.monotonic()
        )

    def _drop_abandoned(self) -> None:
        """(under _lock) Jobs whose callers gave up (a request deadline): never run. Queued ones at
        the head; those in a batch buffer's place anywhere (Placements.drop)."""
        while self._queue and self._queue[0].future.done():
            self.queued_rows -= self._queue.popleft().rows
        for job in self._placements.drop(_given_up):
            self.queued_rows -= job.rows

    def _take(self) -> list[_Job]:
        """(under _lock) The next batch: the oldest job, then following jobs of the same layout
        while they fit.

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
                # its caller gave up
                if job.future.done():
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


def _given_up(job: _Job) -> bool:
    return job.future.done()


def _same_memory(feeds: Feeds, views: Feeds) -> bool:
    """Whether a request's feeds are its place's rows (received into them), not copies elsewhere."""
    if len(feeds) != len(views):
        return False
    for name, view in views.items():
        x = feeds.get(name)
        if (
            x is None
            or x.shape != view.shape
            or x.__array_interface__["data"][0] != view.__array_interface__["data"][0]
        ):
            return False
    return True


def _layout(feeds: Feeds) -> tuple:
    """What must match for arrays to be concatenated along the row axis: names, trailing shapes,
    dtypes."""
    try:
        return tuple(sorted((name, a.shape[1:], a.dtype.str) for name, a in feeds.items()))
    except (
        AttributeError,
        TypeError,
    ):
        # not arrays (a caller's bug): merged with nothing, fails alone
        return (object(),)


def _deliver(answers: list[tuple[_Job, object, bool]]) -> None:
    """Each job's answer (outputs, or an exception when the flag says so), on the loop it was asked
    on: one wake-up per loop and batch."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for job, value, is_error in answers:
        by_loop.setdefault(job.loop, []).append((job.future, value, is_error))
    for loop, items in by_loop.items():
        _call_soon(loop, _settle, items)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        # that loop has closed (shutdown): nobody waits there any more
        pass


def _settle(items) -> None:
    for future, value, is_error in items:
        # the caller may have gone away
        if not future.done():
            if is_error:
                future.set_exception(value)
            else:
                future.set_result(value)


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
