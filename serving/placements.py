"""A model version's batch rows: which rows of which batch buffer each request holds, and when a
buffer may be written, run and handed out again. `Placements` alone owns the pool
(staging.BatchBuffers): nothing else acquires a buffer, releases one, writes padding into one or
closes the pool. It knows neither HTTP nor onnxruntime, and treats the jobs its owner
(serving/batcher.py) attaches to places as opaque.

Requests take rows one after another in the buffer being filled: a *place* each. A front end that
knows a request's size before its body arrives asks for its place with the request (`arriving`, or
`place` once a body's header told its rows), and the body is received straight into those rows.
Another request is copied into a place of its own when submitted (`reserve_copy`, then `copy`
outside the lock). A run takes a *span* (`next_span`, `take`): the first run of consecutive complete
places of a buffer, from a job to a job; a place still arriving ends it, and a dead place inside it
is filled with a copy of a good row. `batch` pads the span up to the engine's batch bucket in place
where the rows after it are free, else in a free buffer. Requests that fit no place wait in the
owner's queue; `gather` copies a batch of them into a free buffer when it runs. A place whose buffer
was sealed while it arrived (its neighbours ran without it) would run alone: `fill` moves it into
the buffer being filled, to run with the requests arriving there.

A place's state (`Place.state`):
    RESERVED  its request is arriving: a body is being received into its rows
    COPYING   its request's rows are being copied in, outside the lock
    FILLED    its rows are in and its job attached: it may run
    DEAD      its request was refused, went away or was moved: nothing of it runs
    RAN       its run began (or, dead, a run passed it over)
A buffer's (`_Group`): the rows its places take, `sealed` (no new place: one of its runs began) and
`running` (a run reads it). That and the requests on their way are all the state; the futures live
in the jobs.

Invariants:
- no row is written while a run reads it: a run's buffer is sealed as the run is taken, its padding
  goes only into rows no place holds, and the buffer is not handed out again until `done`;
- a buffer returns to the pool only when every place in it ran or died and no run reads it;
- a job runs from its place's rows: a moved job from its new place's, never from the buffer it left;
- a place whose job was given up (`drop`) is dead before any run could take it: never computed;
- the pool closes (`close`) once every buffer is back: never under a run, a copy or a gather;
- `forget` says when the last request on its way is no longer on its way, however it ended.

Locking: every state change is under this object's own lock. The batcher calls in holding its own
lock (that order only: nothing here calls out). Rows are written outside any lock, each by the one
holder of its place: a front end (RESERVED), a copy (COPYING), the engine thread (a taken span's
filler and padding).

Why a few integers per place and per buffer, and the jobs opaque: front-end processes are to reserve
and fill rows of this pool mapped from shared memory themselves, the engine process taking spans;
this state is then what a small shared header holds, and the jobs stay with the engine.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

from serving.staging import BatchBuffers, Feeds, rows_of

RESERVED, COPYING, FILLED, DEAD, RAN = range(5)


class _Group:
    """The places taken one after another in batch buffer `index` (`rows` of its rows in all)."""

    __slots__ = ("index", "places", "rows", "sealed", "running")

    def __init__(self, index: int):
        self.index, self.places, self.rows = index, [], 0
        self.sealed = self.running = False


class Place:
    """Rows start..start+rows of a group's buffer: one request's. `views`: each input's rows there
    (where its body is received, and what its job runs from); `job`: what the owner attached when
    its rows were in."""

    __slots__ = ("group", "start", "rows", "views", "state", "job")

    def __init__(self, group: _Group, start: int, rows: int, views: Feeds):
        self.group, self.start, self.rows, self.views = group, start, rows, views
        self.state = RESERVED
        self.job: Any = None


class Arrival:
    """A request on its way to an owner (a batcher: its head in, its body arriving) and, when it has
    one, its place (`views`: each input's rows there, to receive its body into). Ended once: by the
    owner when the request is submitted, or by the front end (`end`) when it goes no further; the
    owner's `ended(arrival)` is told."""

    __slots__ = ("owner", "seq", "over", "place", "checked", "filled")

    def __init__(self, owner, seq: int, place: Place | None):
        self.owner, self.seq, self.over, self.place = owner, seq, False, place
        # its values were checked for NaN and Inf as they arrived
        self.checked = False
        # its body was received into its place (the feeds submitted are its views)
        self.filled = False

    @property
    def views(self) -> Feeds | None:
        return None if self.place is None else self.place.views

    def end(self) -> None:
        if not self.over:
            self.owner.ended(self)


class Span:
    """Consecutive places of one buffer, from a job to a job, that a run takes: rows
    start..start+rows (a dead place among them is filler). `after`: the index of the place after it;
    `free_up_to` (set by `take`): the row up to which the buffer is free after it, for padding."""

    __slots__ = ("group", "places", "after", "start", "rows", "free_up_to")

    def __init__(self, group: _Group, places: list[Place], after: int):
        self.group, self.places, self.after = group, places, after
        self.start, self.rows = places[0].start, sum(p.rows for p in places)
        self.free_up_to = self.start + self.rows

    @property
    def jobs(self) -> list:
        return [p.job for p in self.places if p.job is not None]

    @property
    def open(self) -> bool:
        """Its buffer still takes places: requests arriving there may join its run."""
        return not self.group.sealed


class Gathered:
    """A run's inputs: `feeds` of a batch bucket's rows, the first `rows` of them the requests' and
    the rest padding, in a batch buffer nothing else touches until `Placements.let_go`; or, where
    no buffer could hold them, `feeds` None and the requests' `parts` for the engine to gather
    itself."""

    __slots__ = ("feeds", "rows", "parts", "lent")

    def __init__(self, feeds: Feeds | None, rows: int, parts: list[Feeds], lent: int | None = None):
        self.feeds, self.rows, self.parts, self.lent = feeds, rows, parts, lent


class Placements:
    """The places of one model version's batch buffers (see the module's docstring).

    `buffers`: the pool (None: no request has a place, every one is gathered when it runs);
    `capacity`: the rows one buffer's places may hold in all, a batch's at most; `bucket_for(rows)`:
    the batch size a run of `rows` is padded to (the engine's buckets)."""

    def __init__(
        self,
        buffers: BatchBuffers | None,
        capacity: int,
        bucket_for: Callable[[int], int] = lambda rows: rows,
    ):
        self.buffers = buffers
        self.capacity = min(capacity, buffers.capacity) if buffers is not None else capacity
        self._bucket_for = bucket_for
        self._lock = threading.Lock()
        # oldest first; the last may be filling
        self._groups: collections.deque[_Group] = collections.deque()
        # the requests on their way (their seq)
        self._arrivals: set[int] = set()
        self._next_arrival = 0
        # buffers a run gathered into (gather, batch), back at let_go
        self._lent = 0
        # False once the owner runs every request alone: no new place, each place its own run
        self.merging = True
        self._closing = False

    # ---- the front ends' side ----

    def arriving(self, owner, rows: int | None = None) -> Arrival:
        """A request for `owner` has begun to arrive; with `rows`, it asks for a place to receive
        its body into."""
        with self._lock:
            place = None if rows is None else self._reserve(rows)
            arrival = Arrival(owner, self._next_arrival, place)
            self._arrivals.add(arrival.seq)
            self._next_arrival += 1
        return arrival

    def place(self, arrival: Arrival, rows: int) -> Feeds | None:
        """A place for an arrival that now knows its rows: its views, or None (no buffer free, too
        many rows, it has one already, or it is over)."""
        with self._lock:
            if arrival.over or arrival.place is not None:
                return None
            arrival.place = self._reserve(rows)
        return arrival.views

    def on_the_way(self) -> bool:
        """Whether requests are on their way (an arrival not over)."""
        return bool(self._arrivals)

    def forget(self, arrival: Arrival) -> bool:
        """The arrival is over (its request submitted, refused or gone); True if it was the last on
        its way."""
        with self._lock:
            arrival.over = True
            self._arrivals.discard(arrival.seq)
            return not self._arrivals

    def leave(self, arrival: Arrival, keep: Place | None = None) -> None:
        """An arrival's place that no rows came into (unless it is `keep`, the place its feeds are
        in) is dead."""
        place = arrival.place
        if place is not None and place is not keep:
            self.kill(place)

    # ---- the owner's, as a request is submitted ----

    def fill(self, place: Place, job) -> Place:
        """A request's rows are in its place: its job is attached, and it may run. Moved first where
        its buffer was sealed while it arrived and nothing left there could run with it (see
        _stranded): the place its job is in is returned, and the job runs from that place's
        views."""
        with self._lock:
            if _stranded(place):
                place = self._move(place)
            place.state, place.job = FILLED, job
        return place

    def reserve_copy(self, feeds: Feeds, rows: int) -> Place | None:
        """A place of its own for a request not received into one, to `copy` it into: None where it
        does not fit (another layout, too many rows, no buffer free)."""
        if self.buffers is None or not self.buffers.fits(feeds, rows):
            return None
        with self._lock:
            place = self._reserve(rows)
            if place is not None:
                place.state = COPYING
        return place

    def copy(self, place: Place, feeds: Feeds) -> None:
        """(outside every lock) A request's feeds into its COPYING place, checked: NonFinite for NaN
        or Inf."""
        self.buffers.put(place.group.index, place.start, feeds)

    def copied(self, place: Place, job) -> None:
        """The copy into `place` is done: its job is attached, and it may run."""
        with self._lock:
            place.state, place.job = FILLED, job

    def kill(self, place: Place) -> None:
        """A place whose request was refused or went away before it was filled: dead."""
        with self._lock:
            if place.state in (RESERVED, COPYING):
                place.state = DEAD
                self._release()

    # ---- the engine thread's ----

    def drop(self, given_up: Callable[[Any], bool]) -> list:
        """The jobs waiting in places that `given_up(job)` says nobody waits for any more (a request
        deadline): their places are dead, never run."""
        dropped = []
        with self._lock:
            for group in self._groups:
                for place in group.places:
                    if place.state == FILLED and given_up(place.job):
                        dropped.append(place.job)
                        place.state, place.job = DEAD, None
            if dropped:
                self._release()
        return dropped

    def next_span(self) -> Span | None:
        """The first run of consecutive places not run yet, each complete (FILLED or DEAD), from its
        first job to its last. Dead places before it are marked run on the way (a dead place between
        two jobs stays: the rows run must be contiguous)."""
        with self._lock:
            for group in self._groups:
                places, i = group.places, 0
                while i < len(places):
                    if places[i].state not in (FILLED, DEAD):
                        i += 1
                        continue
                    j = i
                    while j < len(places) and places[j].state in (FILLED, DEAD):
                        j += 1
                        # (no longer merging: places reserved before run one at a time)
                        if not self.merging and places[j - 1].state == FILLED:
                            break
                    # dead at its start: never computed
                    while i < j and places[i].state == DEAD:
                        places[i].state = RAN
                        i += 1
                    # nor at its end (left to a later look)
                    while j > i and places[j - 1].state == DEAD:
                        j -= 1
                    if i < j:
                        return Span(group, places[i:j], j)
                    # (all of it dead: marked run above, and i is past it)
        return None

    def pending(self) -> bool:
        """Whether a place holds a job not run yet."""
        with self._lock:
            return any(p.state == FILLED for g in self._groups for p in g.places)

    def copying(self) -> bool:
        """Whether a request is being copied into its place."""
        with self._lock:
            return any(p.state == COPYING for g in self._groups for p in g.places)

    def take(self, span: Span) -> list:
        """The span (from `next_span`, under the owner's lock since) is run: its places ran, its
        buffer sealed and read until `done`. Its jobs."""
        with self._lock:
            group = span.group
            group.sealed = group.running = True
            for place in span.places:
                place.state = RAN
            span.free_up_to = self._free_up_to(group, span.after)
        return span.jobs

    def batch(self, span: Span) -> Gathered:
        """(engine thread) A taken span's rows as a run takes them: a dead place's rows made copies
        of a good row (values the model certainly takes), padded up to the batch bucket in place
        where the rows after the span are free, else copied into a free buffer and padded there,
        else left to the engine."""
        index, buffers = span.group.index, self.buffers
        good = next(p for p in span.places if p.job is not None)
        for place in span.places:
            if place.job is None:
                buffers.fill(index, place.start, place.rows, good.start)
        size = self._bucket_for(span.rows)
        if span.start + size <= span.free_up_to:
            return Gathered(buffers.batch(index, span.rows, size, span.start), span.rows, [])
        return self._gathered([buffers.views(index, span.start, span.rows)], span.rows, size)

    def gather(self, parts: list[Feeds], rows: int) -> Gathered:
        """(engine thread) Queued requests' feeds, of `rows` rows in all, as one run: copied one
        after another into a free buffer (checked: NonFinite) and padded up to the batch bucket
        there, when they need a copy at all (several, or padding). `rows` is the requests' count
        (codec): a version that runs each request alone has no row axis to read it from."""
        size = self._bucket_for(rows)
        if len(parts) == 1 and size == rows:
            return Gathered(None, rows, parts)
        return self._gathered(parts, rows, size)

    def let_go(self, gathered: Gathered) -> None:
        """(engine thread) The run of `gathered` returned: the buffer it was gathered into goes back
        to the pool."""
        if gathered.lent is not None:
            with self._lock:
                self.buffers.release(gathered.lent)
                self._lent -= 1
                self._close_when_back()

    def done(self, span: Span) -> None:
        """(engine thread) The run of a taken span returned: its buffer may go back to the pool."""
        with self._lock:
            span.group.running = False
            self._release()

    # ---- the end ----

    def close(self) -> None:
        """No new place, no buffer lent to a run; the pool is closed once every buffer is back."""
        with self._lock:
            self._closing = True
            self._close_when_back()

    def clear(self) -> list:
        """The engine thread died: nothing runs again. Every place not run is dead (a copy under way
        keeps its place until `kill`), the pool closes, and the jobs that were waiting in places are
        returned."""
        jobs = []
        with self._lock:
            self._closing = True
            for group in self._groups:
                group.running = False
                for place in group.places:
                    if place.state == FILLED:
                        jobs.append(place.job)
                        place.job = None
                    if place.state in (RESERVED, FILLED):
                        place.state = DEAD
            self._release()
        return jobs

    # ---- under the lock ----

    def _reserve(self, rows: int) -> Place | None:
        """The next `rows` rows of the buffer being filled (a new buffer when it is full or sealed),
        or None when no buffer is free, the rows fit none, or no new place is to be had."""
        if self.buffers is None or self._closing or not self.merging or rows > self.capacity:
            return None
        group = self._groups[-1] if self._groups and not self._groups[-1].sealed else None
        if group is not None and group.rows + rows > self.capacity:
            group.sealed = True
            group = None
        if group is None:
            index = self.buffers.acquire()
            if index is None:
                return None
            group = _Group(index)
            self._groups.append(group)
        place = Place(group, group.rows, rows, self.buffers.views(group.index, group.rows, rows))
        group.places.append(place)
        group.rows += rows
        return place

    def _move(self, stranded: Place) -> Place:
        """A stranded place's rows copied into the buffer being filled: the place they are in now,
        or the stranded one where they can't be (no buffer free, or they would seal the one being
        filled for a place of their own). Copied under the lock, so that no other thread ever sees a
        half-moved request."""
        rows = stranded.rows
        filling = self._groups[-1] if self._groups and not self._groups[-1].sealed else None
        if rows >= self.capacity or (filling is not None and filling.rows + rows > self.capacity):
            return stranded
        try:
            moved = self._reserve(rows)
            if moved is None:
                return stranded
            try:
                self.buffers.put(moved.group.index, moved.start, stranded.views)
            except BaseException:
                moved.state = DEAD
                raise
        except BaseException:
            stranded.state = DEAD
            self._release()
            raise
        # its buffer may go back to the pool now: its job will run from the new place's views
        stranded.state = DEAD
        self._release()
        return moved

    def _free_up_to(self, group: _Group, after: int) -> int:
        """The row up to which the buffer is free after the places before index `after` (a run may
        pad into it): the next place still to be run or arriving, else the buffer's end."""
        for place in group.places[after:]:
            if place.state not in (RAN, DEAD):
                return place.start
        return self.buffers.capacity

    def _gathered(self, parts: list[Feeds], rows: int, size: int) -> Gathered:
        """`parts` copied into a free buffer and padded to `size` rows there; or left to the engine
        where none can hold them."""
        buffers, index = self.buffers, None
        if (
            buffers is not None
            and size <= buffers.capacity
            and all(buffers.fits(p, rows_of(p)) for p in parts)
        ):
            with self._lock:
                if not self._closing:
                    index = buffers.acquire()
                    self._lent += index is not None
        if index is None:
            return Gathered(None, rows, parts)
        gathered = Gathered(None, rows, parts, index)
        try:
            gathered.feeds = buffers.gather(index, parts, rows, size)
        except BaseException:
            self.let_go(gathered)
            raise
        return gathered

    def _release(self) -> None:
        """Buffers whose every place ran or died go back to the pool, but not one a run is reading
        (a place's state is RAN as its run begins: a request given up meanwhile would otherwise free
        it, and the next body would land in the rows the model is reading)."""
        done = [
            g
            for g in self._groups
            if not g.running and all(p.state in (DEAD, RAN) for p in g.places)
        ]
        for group in done:
            self._groups.remove(group)
            self.buffers.release(group.index)
            # Its places point at it and it at them: a cycle only the collector would free, with
            # each place's job and future, and its runs hold the event loops.
            group.places = []
        if done:
            self._close_when_back()

    def _close_when_back(self) -> None:
        if self._closing and not self._groups and not self._lent and self.buffers is not None:
            self.buffers.close()


def _stranded(place: Place) -> bool:
    """Whether a place just filled would run alone: its buffer is sealed and no place it could share
    a run with is left (its neighbours ran without it, while it was arriving; a dead place between
    is no boundary, a run takes it as filler). Its rows are then better copied next to the requests
    still arriving: one copy of a request, where a run of one row costs a GPU nearly what 8 or 16
    do."""
    if not place.group.sealed or place.state in (DEAD, RAN):
        return False
    places = place.group.places
    i = places.index(place)
    for side in (reversed(places[:i]), places[i + 1 :]):
        for other in side:
            if other.state == RAN:
                break
            if other.state != DEAD:
                return False
    return True
