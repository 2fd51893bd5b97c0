"""Dynamic batching: concurrent requests are gathered into one model run.

Knows neither HTTP nor onnxruntime: it is given `run(parts) -> outputs`, where `parts` are the batch's requests'
feeds (dicts of arrays whose first axis is the row axis; gathering them into one batch is the run's business),
and the server's Runner (serving/runner.py), the thread that runs it. `submit` may be awaited from any event loop:
a request's answer comes back to the loop it was asked on.

Batch buffers (a model of fixed shapes past the batch axis, given `buffers` and `run_buffer`): requests take
rows one after another in the buffer being filled, and the engine runs a buffer's rows as they are, with no copy
and no array made per batch. A front end that knows a request's size before its body arrives asks for its place
with the request (`arriving(rows)`): the body is received straight into those rows (the kernel's copy off the
socket is the only one). Other requests are copied into their place when submitted, on the thread that took them
in (their bytes still in its cache). Either way the values are checked for NaN and Inf there (a refusal at once).
A run takes the first run of consecutive complete places (one still arriving ends it; a place whose request was
refused is filled with a copy of a good row); it pads up to the engine's batch bucket in place when the rows after
it are free, else the engine copies. A request still arriving when its neighbours ran (the arrival wait ran out
first) would then run alone: it is copied into the buffer being filled instead, to run with the requests arriving
there (at c=32 over binary HTTP with 602 KB images, a third of all runs had been such runs of one row: 14 rows a
run on average, 19 with the copy). A buffer returns to the pool when every place in it ran or was refused. A
request that fits no buffer (more rows than a batch, or every buffer taken, e.g. by slow uploads) waits in the
queue, and the engine copies it when it runs.

Policy (measured, see DESIGN.md): never wait for requests that have not begun to arrive. The batch is taken when the
engine thread is free to run it: what is queued then runs at once, as one batch of up to `max_batch_size` rows, and
requests that arrive during a run form the next batch; a loop in the middle of a turn of taking requests in tells
the engine when the turn is over, if the batch is due then (so what it took in runs together, never waiting past the
turn, and the engine is not woken to find it should wait). While requests are
on their way (`arriving()`), the batch waits for them, at most `arrival_wait_ms` from when it could first have run:
a 602 KB image takes the event loop a tenth of a millisecond to take in, and 32 clients uploading at once would
otherwise make batches of the one or two that happened to be complete. The wait ends by itself when every client in
flight has its request in (no more can arrive before an answer goes out), and never starts for a lone client.
Requests on their way for which no model is named yet (`incoming`: ModelInfer messages grpc's C++ server is still
receiving, whose model is named inside; the server counts them only where one model version is loaded and no
token is required) make the batch wait likewise. `max_delay_ms` > 0 lets a partial batch wait at most that long
(from its oldest request) for more rows, arriving or not, for models where a bigger batch pays.

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
from functools import partial

import numpy as np

from serving.statistics import VersionStatistics

Feeds = dict[str, np.ndarray]
log = logging.getLogger("serving.batcher")


class QueueFull(Exception):
    """The queue holds `max_queue_rows` rows already; the caller should retry later."""


class BatcherClosed(Exception):
    """The batcher is shutting down (or was replaced by a new model) and takes no new work."""


class RunTimedOut(Exception):
    """A model run took longer than the batcher's run_timeout; it may still be running."""


class NotRowWise(Exception):
    """A batched run's outputs do not have the run's rows on their first axis: the model's rows are not independent
    (it was declared batchable wrongly). The run's requests fail with it (never an answer cut from the outputs),
    and the batcher runs every request alone from then on."""


@dataclass
class _Job:
    feeds: Feeds
    rows: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    arrived: float = field(default_factory=time.monotonic)


class _Place:
    """Rows start..start+rows of a group's buffer: a request's. Incomplete until its job is there (or it is dead)."""

    __slots__ = ("group", "start", "rows", "job", "dead", "ran", "views")

    def __init__(self, group: "_Group", start: int, rows: int, views: Feeds):
        self.group, self.start, self.rows, self.views = group, start, rows, views
        self.job: _Job | None = None
        self.dead = (
            False  # its request was refused, or went away before it arrived: nothing of it runs
        )
        self.ran = False

    @property
    def complete(self) -> bool:
        return self.job is not None or self.dead


class _Group:
    """The places taken one after another in batch buffer `index`; sealed once one of its runs began."""

    __slots__ = ("index", "places", "rows", "sealed")

    def __init__(self, index: int):
        self.index, self.places, self.rows, self.sealed = index, [], 0, False


class Arrival:
    """A request on its way to this batcher (its head in, its body arriving), and, when it has one, the place in a
    batch buffer its body is received into (`views`: each input's rows there). Ended once: by `submit`, or by the
    front end (`end`) when the request goes no further."""

    __slots__ = ("batcher", "seq", "over", "place", "checked", "filled")

    def __init__(self, batcher: "Batcher", seq: int, place: _Place | None):
        self.batcher, self.seq, self.over, self.place = batcher, seq, False, place
        self.checked = False  # its values were checked for NaN and Inf as they arrived
        self.filled = (
            False  # its body was received into its place (the feeds submitted are its views)
        )

    @property
    def views(self) -> Feeds | None:
        return None if self.place is None else self.place.views

    def end(self) -> None:
        if not self.over:
            self.batcher._end(self)


class Run:
    """One batch on the engine thread, as the runner's watchdog sees it (and its times, for the statistics)."""

    def __init__(self, batcher: "Batcher", jobs: list[_Job]):
        self.batcher, self.jobs = batcher, jobs
        self.timeout = batcher.run_timeout
        self.started = time.monotonic()
        self.ended = self.started
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
    - at most one `run` of this batcher is in flight (the runner has one thread, and a batcher holds at most
      one turn in its queue);
    - the queue never holds more than `max_queue_rows` rows (a job is refused, never truncated);
    - a job larger than `max_batch_size` rows runs alone, never split; the caller caps rows per
      request;
    - with `merge=False` (a model not known to be row-wise), every job runs alone; a run that raises NotRowWise
      turns `merge` off for good (one log line), and its jobs fail with it, never run again one by one;
    - a batch only holds jobs with the same input names, trailing shapes and dtypes as its first
      job; jobs skipped for that keep their order and lead a later batch;
    - no row of a batch buffer is written while a run reads it, and no run reads a place still arriving;
    - every job's future is resolved: with its outputs, with the batch's error, or with
      BatcherClosed if the engine thread dies.
    Its state is shared by the event loops that submit and the engine thread that takes: under `_lock`.
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
        run_buffer: Callable[[int, int, int, int], Feeds] | None = None,
        arrival_wait_ms: float = 0.0,
        incoming: Callable[[], int] | None = None,
        name: str = "the model",
        observe: Callable[[Feeds, Feeds], None] | None = None,
    ):
        self.name = name  # the version it runs, in its log lines
        # `observe(feeds, outputs)` is told of each batch the model ran (drift). It is handed to the
        # runs: only they see the rows as they ran, padding cut off, before the buffer is reused.
        if observe is not None:
            run = partial(run, observe=observe)
            run_buffer = run_buffer and partial(run_buffer, observe=observe)
        self._run = run
        self._buffers = (
            buffers if run_buffer is not None and merge else None
        )  # staging.BatchBuffers
        self._run_buffer = run_buffer  # (buffer, start, rows, free up to) -> outputs
        self._runner = runner
        self.max_batch_size = max_batch_size
        self.max_delay = max_delay_ms / 1000.0
        self.max_queue_rows = max_queue_rows
        self.merge = merge
        self._on_batch = on_batch
        self.run_timeout = run_timeout
        self.arrival_wait = arrival_wait_ms / 1000.0
        self._incoming = incoming  # requests on their way no model is named for yet (gRPC messages): see _should_wait
        self._lock = threading.Lock()
        self._queue: collections.deque[_Job] = collections.deque()  # jobs with no place in a buffer
        self._groups: collections.deque[_Group] = (
            collections.deque()
        )  # oldest first; the last may be filling
        self._arrivals: dict[int, Arrival] = {}  # the requests on their way, oldest first
        self._next_arrival = 0
        self._wait_until: float | None = None  # a batch waits for arrivals until then
        self._delay_until: float | None = (
            None  # the engine's turn asked for at the end of --max-delay-ms
        )
        self._kicks: set[asyncio.AbstractEventLoop] = (
            set()
        )  # loops that will tell the engine thread (see _kick)
        self.queued_rows = 0
        self._copying = (
            0  # requests being copied into their place, outside the lock (close waits for them)
        )
        self._batch: list[_Job] = []  # taken, being run
        self._running: _Group | None = (
            None  # the buffer a run is reading: not handed out again until it returns
        )
        self._closing = False
        self._closed = False
        self._dead = False
        self._started = False
        self._drain_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self.stalled = False  # a run is past run_timeout and still inside the engine
        # Triton's statistics of this version (serving/statistics.py), fed per successful run
        self.statistics = VersionStatistics()
        # (engine thread) when the run in progress was taken: its input phase begins
        self._taken = 0.0

    def start(self) -> None:
        self._started = True

    @property
    def buffers(self):
        """The batch buffers requests are placed in (staging.BatchBuffers), or None."""
        return self._buffers

    @property
    def started(self) -> bool:
        return self._started

    @property
    def alive(self) -> bool:
        """True from `start` until `close` returns, unless the engine thread died."""
        return self._started and not self._closed and not self._dead and self._runner.alive

    # ---- from the front ends (any event loop) ----

    def arriving(self, rows: int | None = None) -> Arrival:
        """A request for this batcher has begun to arrive (its head is in, its body on its way); with `rows`, it
        asks for a place in a batch buffer to receive its body into (see `Arrival.views`: None when there is none
        to be had)."""
        with self._lock:
            place = None
            if (
                rows is not None
                and self._buffers is not None
                and not self._closing
                and not self._dead
            ):
                place = self._reserve(rows)
            arrival = Arrival(self, self._next_arrival, place)
            self._arrivals[arrival.seq] = arrival
            self._next_arrival += 1
        return arrival

    def place(self, arrival: Arrival, rows: int) -> Feeds | None:
        """A place in a batch buffer for an arrival that now knows its rows (a V2 body whose header was read): the
        views to receive its body into, or None (no buffer free, too many rows, or it has one already)."""
        with self._lock:
            if (
                arrival.over
                or arrival.place is not None
                or self._buffers is None
                or self._closing
                or self._dead
            ):
                return None
            arrival.place = self._reserve(rows)
        return arrival.views

    def _end(self, arrival: Arrival) -> None:
        """An arrival that goes no further: its place (if any) is dead."""
        with self._lock:
            if self._forget(arrival):
                self._runner.ready(self)
            if arrival.place is not None and arrival.place.job is None:
                arrival.place.dead = True
                self._release_done_groups()

    def _forget(self, arrival: Arrival) -> bool:
        """(under _lock) True if the batch waited for this one, the last on its way: the engine is to look again
        (submit kicks its loop for it, whether the request is queued or refused)."""
        arrival.over = True
        self._arrivals.pop(arrival.seq, None)
        return not self._arrivals and self._wait_until is not None

    async def submit(self, feeds: Feeds, rows: int, arrival: Arrival | None = None) -> Feeds:
        """Queue `rows` rows and wait for their outputs (same row order). `arrival`: this request's (ended now); when
        it has a place, `feeds` are its views, filled. NonFinite (staging) for a value that is NaN or Inf."""
        loop = asyncio.get_running_loop()
        job = _Job(feeds, rows, loop.create_future(), loop)
        place = arrival.place if arrival is not None and not arrival.over else None
        if place is not None and not arrival.filled and not _same_memory(feeds, place.views):
            place = None  # not what was received into it (a reload's other batcher): copied like any other
        if place is not None and not arrival.checked:
            try:
                self._buffers.check(
                    feeds
                )  # here, on the thread that received it: its values are in this cache
            except BaseException:
                arrival.end()
                raise
        copy = False
        with self._lock:
            if arrival is not None:
                if not arrival.over and self._forget(arrival):
                    self._kick(
                        loop
                    )  # the batch waited for this one, the last: queued or refused below, it judges
                if (
                    arrival.place is not None
                    and arrival.place is not place
                    and arrival.place.job is None
                ):
                    arrival.place.dead = True
            try:
                self._admit(rows)
            except BaseException:
                if place is not None:
                    place.dead = True
                self._release_done_groups()
                raise
            if place is not None and _stranded(place):
                place = self._move(place, feeds, rows)
                job.feeds = (
                    place.views
                )  # (a merged run that fails runs each job again from its feeds)
            if place is not None:
                place.job = job
            else:
                if self._buffers is not None and self._buffers.fits(feeds, rows):
                    place = self._reserve(rows)
                copy = place is not None
                if place is None:
                    self._queue.append(job)
            self.queued_rows += rows
            self._copying += copy
        if copy:  # a place of its own: copied in (and checked) here, outside the lock
            try:
                self._buffers.put(place.group.index, place.start, feeds)
            except BaseException:
                with self._lock:
                    self._copying -= 1
                    place.dead = True
                    if not self._dead:  # (else runner_died counted it out with everything)
                        self.queued_rows -= rows
                    self._release_done_groups()
                    self._settle_drained()
                raise
            with self._lock:
                self._copying -= 1
                if (
                    self._dead
                ):  # the engine thread died meanwhile: runner_died failed what it could see
                    raise BatcherClosed("the batcher has stopped (see the server log)")
                place.job = job
        if (
            self._wait_until is None
            or not self._arrivals
            or self.queued_rows >= self.max_batch_size
        ):
            self._kick(loop)  # (a batch waiting for arrivals is told when they are in: see _forget)
        return await job.future

    def _kick(self, loop: asyncio.AbstractEventLoop) -> None:
        """Tell the engine thread there is work, once this turn of the submitting loop is over: the requests whose
        handlers run in the same turn (taken in together, or answered together) then make one batch, not one each
        (an engine woken at the first would take it alone, the loop giving up the GIL at its next system call)."""
        if loop not in self._kicks:
            self._kicks.add(loop)
            loop.call_soon(self._kicked, loop)

    def _kicked(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop's turn is over: the engine thread is told if the batch is due now (`_should_wait` arms the
        wait's own wake-up otherwise). Deciding here rather than waking the engine to decide: on a loop saturated
        with uploads a kick comes every turn, and an engine woken by each went back to sleep at 11 of 12 wakes
        (measured at c=32, 602 KB images: 0.6 wakes a request, each a thread switch and a GIL hand-off)."""
        self._kicks.discard(loop)
        with self._lock:
            if not self._closing:
                if self._batch:
                    return  # a run is under way: the engine looks at what is queued when it returns
                next_batch = self._next_batch()
                if next_batch is None or self._should_wait(self._runner, *next_batch[1:]):
                    return  # nothing left (the engine took it); or waiting: its timer or a later kick tells it
        self._runner.ready(self)

    def _kick_coming(self) -> bool:
        """(engine thread) Whether a running loop will give this batcher a turn at the end of its turn. The engine,
        free between two runs, then leaves the batch to it rather than taking the one or two requests complete so
        far: a loop saturated with uploads gives the GIL away at every system call, and an engine that took a batch
        at each would run batches of 1-3 rows (measured: 3.3 rows a run at c=32, 14.5 when left to the loop)."""
        return any(loop.is_running() for loop in tuple(self._kicks))

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

    def _move(self, stranded: _Place, feeds: Feeds, rows: int) -> _Place:
        """(under _lock) A stranded place's rows (see _stranded) copied into the buffer being filled: the place they
        are in now, or the stranded one where they can't be (no buffer free, or they would seal the one being
        filled for a place of their own). Copied here, under the lock, so that no other thread ever sees a
        half-moved request (a few in a hundred are moved: at c=32, ~3%)."""
        capacity = self._place_capacity()
        filling = self._groups[-1] if self._groups and not self._groups[-1].sealed else None
        if rows >= capacity or (filling is not None and filling.rows + rows > capacity):
            return stranded
        try:
            moved = self._reserve(rows)
            if moved is None:
                return stranded
            try:
                self._buffers.put(
                    moved.group.index, moved.start, feeds
                )  # (NonFinite: checked already)
            except BaseException:
                moved.dead = True
                raise
        except BaseException:
            stranded.dead = True
            self._release_done_groups()
            raise
        stranded.dead = True  # its buffer may go back to the pool now: the job's feeds are the new place's views
        self._release_done_groups()
        return moved

    def _place_capacity(self) -> int:
        """The rows one buffer's places may hold in all: a batch's, at most."""
        return min(self.max_batch_size, self._buffers.capacity)

    def _reserve(self, rows: int) -> _Place | None:
        """(under _lock) The next `rows` rows of the buffer being filled (a new buffer when it is full or sealed), or
        None when no buffer is free or the rows fit none."""
        capacity = self._place_capacity()
        if rows > capacity or not self.merge:
            return None
        group = self._groups[-1] if self._groups and not self._groups[-1].sealed else None
        if group is not None and group.rows + rows > capacity:
            group.sealed = True
            group = None
        if group is None:
            index = self._buffers.acquire()
            if index is None:
                return None
            group = _Group(index)
            self._groups.append(group)
        place = _Place(group, group.rows, rows, self._buffers.views(group.index, group.rows, rows))
        group.places.append(place)
        group.rows += rows
        return place

    def flush(self) -> None:
        """From now on, never let a partial batch wait for more rows (shutdown has begun: run what is queued)."""
        self.max_delay = 0.0
        self.arrival_wait = 0.0
        self._runner.ready(self)

    async def close(self) -> None:
        """Take no new jobs, run every queued one (without waiting out any delay), then stop."""
        loop = asyncio.get_running_loop()
        with self._lock:
            self._closing = True
            if self._dead or (not self._pending() and not self._batch and not self._copying):
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
                self._release_done_groups()  # (places whose callers all gave up)
                self._settle_drained()
                return
            span, rows, oldest, open_ = next_batch
            take_span = span is not None
            if self.merge and rows < self.max_batch_size and self._kick_coming():
                return  # a loop is taking requests in: what it takes this turn joins the batch (see _kick)
            if self._should_wait(runner, rows, oldest, open_):
                return
            if take_span:
                group, places, _ = span
                group.sealed = (
                    True  # no new place in it: the rows after this run's stay as they are
                )
                for place in places:
                    place.ran = True
                jobs = [p.job for p in places if p.job is not None]
                self.queued_rows -= sum(job.rows for job in jobs)
                free_up_to = self._free_up_to(group, span[2])
                self._running = group
            else:
                jobs = self._take()
            self._batch = jobs
        try:
            if take_span:
                self._run_span(runner, group, places, jobs, free_up_to)
            else:
                self._run_batch(runner, jobs)
        except Exception as exc:  # noqa: BLE001 - a bug of ours: the batch's requests still get an answer
            log.exception("running a batch failed")
            _deliver([(job, exc, True) for job in jobs])
        # (a BaseException, the thread being killed, leaves self._batch for runner_died to fail)
        with self._lock:
            self._batch, self._running = [], None
            self._release_done_groups()
            more = self._pending()
            if not more:
                self._settle_drained()
        if more:
            runner.ready(self)

    def _next_batch(self) -> tuple[tuple | None, int, float, bool] | None:
        """(under _lock) What the next run would take: (the span of places (_next_span), or None for the queue; its
        rows; its oldest request's arrival; whether its buffer still takes places). The span or the queue, whichever
        holds the oldest request. None when nothing is queued, and then no wait is left standing either: one whose
        requests were given up would keep the next request's kick from being sent (see submit)."""
        span = self._next_span()
        head = self._queue[0] if self._queue else None
        if span is None and head is None:
            self._wait_until = None
            return None
        oldest_placed = (
            min(p.job.arrived for p in span[1] if p.job is not None) if span is not None else 0.0
        )
        if span is not None and (head is None or oldest_placed <= head.arrived):
            return span, sum(p.rows for p in span[1]), oldest_placed, not span[0].sealed
        return None, self.queued_rows, head.arrived, True

    def _should_wait(self, runner, rows: int, oldest: float, open_: bool) -> bool:
        """(under _lock) Whether the batch waits: out --max-delay-ms, or for requests arriving (see the module's
        docstring); asks for a turn when the wait ends at the latest."""
        if self._closing or not self.merge or rows >= self.max_batch_size or not open_:
            self._wait_until = None
            return False
        now = time.monotonic()
        if self.max_delay > 0 and oldest + self.max_delay > now:
            if (
                self._delay_until != oldest + self.max_delay
            ):  # (asked once, however often it is asked)
                self._delay_until = oldest + self.max_delay
                runner.ready_at(self, self._delay_until)
            return True
        if self.arrival_wait <= 0 or not (
            self._arrivals or (self._incoming is not None and self._incoming())
        ):
            self._wait_until = None
            return False
        if self._wait_until is None:
            self._wait_until = now + self.arrival_wait
            runner.ready_at(self, self._wait_until)
        if now < self._wait_until:
            return True
        self._wait_until = None
        return False

    def _next_span(self) -> tuple[_Group, list[_Place], int] | None:
        """(under _lock) The first run of consecutive places not run yet, each complete (a job, or dead), from its
        first job to its last: (group, places, the index after them). Dead places before it are marked run on the
        way (a dead place between two jobs stays: the rows run must be contiguous)."""
        for group in self._groups:
            places, i = group.places, 0
            while i < len(places):
                if places[i].ran or not places[i].complete:
                    i += 1
                    continue
                j = i
                while j < len(places) and not places[j].ran and places[j].complete:
                    j += 1
                    if not self.merge and places[j - 1].job is not None:
                        break  # (no longer merging: places reserved before run one at a time)
                while i < j and places[i].job is None:  # dead at its start: never computed
                    places[i].ran = True
                    i += 1
                while j > i and places[j - 1].job is None:  # nor at its end (left to a later look)
                    j -= 1
                if i < j:
                    return group, places[i:j], j
                # (all of it dead: marked run above, and i is past it)
        return None

    def _free_up_to(self, group: _Group, after: int) -> int:
        """(under _lock) The row up to which the buffer is free after the places before index `after` (a run may pad
        into it): the next place still to be run or arriving, else the buffer's end."""
        for place in group.places[after:]:
            if not place.ran and not place.dead:
                return place.start
        return self._buffers.capacity

    def _pending(self) -> bool:
        """(under _lock) Jobs to run: queued, or complete in a place not run yet."""
        return bool(self._queue) or any(
            p.job is not None and not p.ran for g in self._groups for p in g.places
        )

    def _release_done_groups(self) -> None:
        """(under _lock) Buffers whose every place ran or was refused go back to the pool, but not the one a run is
        reading (a place's ran is set as its run begins): a request given up meanwhile (a client gone mid-body)
        would free it, and the next body would land in the rows the model is reading."""
        for group in [
            g
            for g in self._groups
            if g is not self._running and all(p.ran or p.dead for p in g.places)
        ]:
            self._groups.remove(group)
            self._buffers.release(group.index)
            # Its places point at it and it at them: a cycle that only the collector frees, with each place's job and
            # future. ~10 objects a request piled up so, and the collector's runs (every ~2,000 requests at c=32) took
            # 12 ms each on the loop, holding every request in flight.
            group.places = []

    def runner_died(self) -> None:
        """The engine thread is gone: fail what waits, refuse what comes."""
        with self._lock:
            self._dead = True
            jobs = [
                *self._batch,
                *self._queue,
                *(p.job for g in self._groups for p in g.places if p.job is not None and not p.ran),
            ]
            self._batch, self._queue, self._groups = [], collections.deque(), collections.deque()
            self.queued_rows = 0
            waiters, self._drain_waiters = self._drain_waiters, []
        error = BatcherClosed("the batcher has stopped (see the server log)")
        _deliver([(job, error, True) for job in jobs])
        for loop, done in waiters:
            _call_soon(loop, _resolve, done)

    def _settle_drained(self) -> None:
        """(under _lock) Closing and nothing left: wake those waiting in close()."""
        if self._closing and not self._pending() and not self._copying and not self._batch:
            self._closed = True
            waiters, self._drain_waiters = self._drain_waiters, []
            for loop, done in waiters:
                _call_soon(loop, _resolve, done)

    def _run_span(
        self, runner, group: _Group, places: list[_Place], jobs: list[_Job], free_up_to: int
    ) -> None:
        """Runs the places' rows of `group`'s buffer as they are (a refused place's rows filled with a good row) and
        answers each job; if it fails, each job runs again alone."""
        good = next(p for p in places if p.job is not None)
        for place in places:
            if (
                place.job is None
            ):  # refused: rows nobody will read, which must still be values the model takes
                self._buffers.fill(group.index, place.start, place.rows, good.start)
        start, rows = places[0].start, sum(p.rows for p in places)
        outcome = self._timed_run(
            runner, jobs, lambda: self._run_buffer(group.index, start, rows, free_up_to)
        )
        if outcome is None:  # timed out: its requests were failed by the watchdog
            return
        outputs, error, run = outcome
        if error is None:
            _deliver(
                [
                    (
                        p.job,
                        {
                            k: v[p.start - start : p.start - start + p.rows]
                            for k, v in outputs.items()
                        }
                        if len(places) > 1
                        else outputs,
                        False,
                    )
                    for p in places
                    if p.job is not None
                ]
            )
            self._executed(run)
            return
        self._one_by_one(runner, jobs, error)

    def _run_batch(self, runner, jobs: list[_Job]) -> None:
        """Runs `jobs` (gathered by the run) as one batch and answers each; if it fails, each job runs again alone."""
        outcome = self._timed_run(runner, jobs, lambda: self._run([job.feeds for job in jobs]))
        if outcome is None:  # timed out: its requests were failed by the watchdog
            return
        outputs, error, run = outcome
        if error is None:
            start, answers = 0, []
            for job in (
                jobs
            ):  # (the engine's outputs have exactly the batch's rows: its padding is cut off)
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

    def _one_by_one(self, runner, jobs: list[_Job], error: Exception) -> None:
        """A merged batch failed: whose values made it fail? Each alone answers: the others' requests succeed. Not
        after NotRowWise: those requests fail (their run proved the version was declared batchable wrongly)."""
        if len(jobs) == 1 or isinstance(error, NotRowWise):
            _deliver([(job, error, True) for job in jobs])
            return
        for job in jobs:
            if job.future.done():
                continue
            self._taken = time.monotonic()
            outcome = self._timed_run(runner, [job], lambda: self._run([job.feeds]))
            if outcome is None:
                return
            outputs, error, run = outcome
            _deliver([(job, error, True) if error is not None else (job, outputs, False)])
            if error is None:
                self._executed(run)

    def _timed_run(
        self, runner, jobs: list[_Job], run: Callable[[], Feeds]
    ) -> tuple[Feeds | None, Exception | None, Run] | None:
        """(outputs, None, the run) or (None, error, the run); None when the run outlived run_timeout (already
        answered)."""
        timed = Run(self, jobs)
        runner.began(timed)
        try:
            outputs, error = run(), None
        except Exception as exc:  # the model (or anything else) failed: the batch learns why
            outputs, error = None, exc
        finally:
            runner.ended()
        if isinstance(error, NotRowWise) and self.merge:
            with self._lock:
                self.merge = False
            log.error("%s: %s", self.name, error)
        ended = timed.ended = time.monotonic()
        if timed.returned():
            self.stalled = False
            log.warning(
                "the stalled model run returned after %.1f s; ready again", ended - timed.started
            )
            return None
        if self._on_batch is not None:
            # Queue time runs until the engine thread began this run (other models' runs may go first);
            # compute time is the run itself.
            try:
                self._on_batch(
                    sum(j.rows for j in jobs),
                    ended - timed.started,
                    [timed.started - j.arrived for j in jobs],
                )
            except Exception:  # noqa: BLE001 - a metric must never fail an answer
                log.exception("recording a batch's metrics failed")
        return outputs, error, timed

    def _executed(self, run: Run) -> None:
        """(engine thread) A successful run's answers were handed out: its rows and phases to the statistics. A
        model run unbatched counts one inference a request, as Triton counts a model of max_batch_size 0."""
        jobs = run.jobs
        rows = sum(job.rows for job in jobs) if self.merge else len(jobs)
        arrivals = [job.arrived for job in jobs]
        self.statistics.executed(
            rows, arrivals, self._taken, run.started, run.ended, time.monotonic()
        )

    def _drop_abandoned(self) -> None:
        """(under _lock) Jobs whose callers gave up (a request deadline): never run. Queued ones at the head; those
        in a batch buffer's place anywhere (the place turns dead: its rows are filled with a good row if its span
        runs)."""
        while self._queue and self._queue[0].future.done():
            self.queued_rows -= self._queue.popleft().rows
        for group in self._groups:
            for place in group.places:
                if place.job is not None and not place.ran and place.job.future.done():
                    self.queued_rows -= place.job.rows
                    place.job, place.dead = None, True

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


def _stranded(place: _Place) -> bool:
    """Whether a place just filled would run alone: its buffer is sealed and no place it could share a run with is
    left (its neighbours ran without it, while it was arriving; a refused place between is no boundary, a run
    takes it as filler). Its rows are then better copied next to the requests still arriving: one copy of a
    request, where a run of one row costs a GPU nearly what 8 or 16 do."""
    if not place.group.sealed or place.ran or place.dead:
        return False
    places = place.group.places
    i = places.index(place)
    for side in (reversed(places[:i]), places[i + 1 :]):
        for other in side:
            if other.ran:
                break
            if not other.dead:
                return False
    return True


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
    """What must match for arrays to be concatenated along the row axis: names, trailing shapes, dtypes."""
    try:
        return tuple(sorted((name, a.shape[1:], a.dtype.str) for name, a in feeds.items()))
    except (
        AttributeError,
        TypeError,
    ):  # not arrays (a caller's bug): merged with nothing, fails alone
        return (object(),)


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
