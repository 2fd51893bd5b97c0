"""A model version's batch rows: which rows of which batch buffer each request holds, and when a
buffer may be written, run and handed out again. `Placements` alone owns the pool
(staging.BatchBuffers): nothing else picks a buffer, frees one, writes padding into one or closes
the pool. It knows neither HTTP nor onnxruntime, and treats the jobs its owner
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

A place's state:
    RESERVED  its request is arriving: a body is being received into its rows
    COPYING   its request's rows are being copied in, outside the lock
    FILLED    its rows are in and its job attached: it may run
    DEAD      its request was refused, went away or was moved: nothing of it runs
    RAN       its run began (or, dead, a run passed it over)
A buffer's: in use or free, the order it was taken in, `sealed` (no new place: one of its runs
began, or it is full), `running` (a run reads it), `lent` (a run gathered into it: no places),
and its places. With the requests on their way (a count per process), that is all the state; the
futures live in the jobs.

The state is integers in a table (`Table`): in this process's memory, or in memory several
processes map (serving/arena.py: the engine's process and its front ends, each front end reserving
and filling places of the engine's pool itself, the engine taking spans). Each process keeps its
own handles on the table's buffers and places (`_Group`, `Place`: their views, and in the
engine's, the jobs), made again when a buffer is taken anew.

Invariants:
- no row is written while a run reads it: a run's buffer is sealed as the run is taken, its padding
  goes only into rows no place holds, and the buffer is not handed out again until `done`;
- a buffer returns to the pool only when every place in it ran or died and no run reads it;
- a job runs from its place's rows: a moved job from its new place's, never from the buffer it left;
- a place whose job was given up (`drop`) is dead before any run could take it: never computed;
- the pool closes (`close`) once every buffer is back: never under a run, a copy or a gather;
- `forget` says when the last request on its way is no longer on its way, however it ended;
- a place becomes visible to other processes in one write (its buffer's count of places), after
  its fields: a front end killed while holding the lock leaves nothing half made that anyone sees,
  and `gone(owner)` then kills its places still arriving and forgets its arrivals.

Locking: every state change is under the table's lock (a threading.Lock in one process, or the
process-shared one of serving/_ingest.c). The batcher calls in holding its own lock (that order
only: nothing here calls out). Rows are written outside any lock, each by the one holder of its
place: a front end (RESERVED), a copy (COPYING), the engine thread (a taken span's filler and
padding).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from serving.staging import BatchBuffers, Feeds, rows_of

RESERVED, COPYING, FILLED, DEAD, RAN = range(5)

# The table, in 8-byte words: LOCK_WORDS for the process-shared lock, then the header, then each
# buffer's words, then each buffer's places' words (a place per row at most).
LOCK_WORDS = 8
CLOSING, NOT_MERGING, ORDERS, TICKETS, ARRIVING, TURNS = range(6)
HEADER_WORDS = 8
# arrivals counted per process, and whether it is in a turn of handing requests over: 0 the
# engine's own, 1.. its front ends
OWNERS = 64
IN_USE, ORDER, SEALED, RUNNING, PLACES, LENT = range(6)
GROUP_WORDS = 6
START, ROWS, STATE, OWNER, TICKET = range(5)
PLACE_WORDS = 5


class Table:
    """A pool's state as integers in `memory` (writable, `Table.nbytes(count, places)` bytes at
    least, 16-byte aligned): `count` buffers of up to `places` places each; `lock` guards every
    change of it. `create`: the memory is new (zeroed) and this table sets it up."""

    def __init__(self, memory, count: int, places: int, lock, create: bool = True):
        self.count, self.places, self.lock = count, places, lock
        self.words = memoryview(memory)[: self.nbytes(count, places)].cast("B").cast("q")
        self.header = LOCK_WORDS
        self.arrivals = self.header + HEADER_WORDS
        self.turns = self.arrivals + OWNERS
        self.groups = self.turns + OWNERS
        self.place_words = self.groups + count * GROUP_WORDS
        if create:
            self.words[self.header + ORDERS] = 1

    @staticmethod
    def nbytes(count: int, places: int) -> int:
        return 8 * (
            LOCK_WORDS + HEADER_WORDS + 2 * OWNERS + count * (GROUP_WORDS + places * PLACE_WORDS)
        )

    @classmethod
    def private(cls, count: int, places: int) -> Table:
        """A table in this process's memory, under a threading.Lock."""
        return cls(bytearray(cls.nbytes(count, places)), count, places, threading.Lock())

    def group_at(self, index: int) -> int:
        return self.groups + index * GROUP_WORDS

    def place_at(self, index: int, k: int) -> int:
        return self.place_words + (index * self.places + k) * PLACE_WORDS


class _Group:
    """This process's handle on batch buffer `index` while it is in use (taken `order`th), and on
    its places (`places`: one after another from row 0)."""

    __slots__ = ("words", "at", "index", "order", "places")

    def __init__(self, table: Table, index: int, order: int):
        self.words, self.at = table.words, table.group_at(index)
        self.index, self.order = index, order
        self.places: list[Place] = []

    @property
    def sealed(self) -> bool:
        return bool(self.words[self.at + SEALED])

    @sealed.setter
    def sealed(self, value: bool) -> None:
        self.words[self.at + SEALED] = int(value)

    @property
    def running(self) -> bool:
        return bool(self.words[self.at + RUNNING])

    @running.setter
    def running(self, value: bool) -> None:
        self.words[self.at + RUNNING] = int(value)

    @property
    def rows(self) -> int:
        """The rows its places take (they follow one another from row 0)."""
        last = self.places[-1] if self.places else None
        return last.start + last.rows if last is not None else 0


class Place:
    """Rows start..start+rows of a group's buffer: one request's. `views`: each input's rows there
    (where its body is received, and what its job runs from); `job`: what the owner attached when
    its rows were in (in the engine's process)."""

    __slots__ = ("group", "k", "words", "at", "start", "rows", "ticket", "job", "_views", "_pool")

    def __init__(self, group: _Group, k: int, table: Table, pool: BatchBuffers | None):
        self.group, self.k, self.words = group, k, table.words
        self.at = table.place_at(group.index, k)
        self.start, self.rows = self.words[self.at + START], self.words[self.at + ROWS]
        self.ticket = self.words[self.at + TICKET]
        self.job: Any = None
        self._views: Feeds | None = None
        self._pool = pool

    @property
    def state(self) -> int:
        return self.words[self.at + STATE]

    @state.setter
    def state(self, value: int) -> None:
        self.words[self.at + STATE] = value

    @property
    def owner(self) -> int:
        """The process that reserved it (0: the engine's own)."""
        return self.words[self.at + OWNER]

    @property
    def views(self) -> Feeds:
        if self._views is None:
            self._views = self._pool.views(self.group.index, self.start, self.rows)
        return self._views


class Arrival:
    """A request on its way to an owner (a batcher: its head in, its body arriving) and, when it has
    one, its place (`views`: each input's rows there, to receive its body into). Ended once: by the
    owner when the request is submitted, or by the front end (`end`) when it goes no further; the
    owner's `ended(arrival)` is told. `source`: the process it is counted under
    (Placements.owner)."""

    __slots__ = ("owner", "source", "over", "place", "checked", "filled")

    def __init__(self, owner, source: int, place: Place | None):
        self.owner, self.source, self.over, self.place = owner, source, False, place
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
    `free_up_to` (set by `take`): the row up to which the buffer is free after it, for padding;
    `arriving`: a place still arriving may yet join its run (next to it, past dead places only)."""

    __slots__ = ("group", "places", "after", "start", "rows", "free_up_to", "arriving")

    def __init__(self, group: _Group, places: list[Place], after: int, arriving: bool = False):
        self.group, self.places, self.after = group, places, after
        self.start, self.rows = places[0].start, sum(p.rows for p in places)
        self.free_up_to = self.start + self.rows
        self.arriving = arriving

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
    the batch size a run of `rows` is padded to (the engine's buckets). `table`: where the state
    is (default: this process's own); `owner`: the number this process's arrivals and places are
    counted under in it (0: the engine's process, which alone closes the pool)."""

    def __init__(
        self,
        buffers: BatchBuffers | None,
        capacity: int,
        bucket_for: Callable[[int], int] = lambda rows: rows,
        table: Table | None = None,
        owner: int = 0,
    ):
        self.buffers = buffers
        self.capacity = min(capacity, buffers.capacity) if buffers is not None else capacity
        self._bucket_for = bucket_for
        count = buffers.count if buffers is not None else 0
        places = buffers.capacity if buffers is not None else 0
        self.table = Table.private(count, places) if table is None else table
        self._lock = self.table.lock
        self._words = self.table.words
        self._header = self.table.header
        self.owner = owner
        # this process's handles on the buffers in use, by index
        self._handles: dict[int, _Group] = {}

    @property
    def merging(self) -> bool:
        """False once the owner runs every request alone: no new place, each place its own run."""
        return not self._words[self._header + NOT_MERGING]

    @merging.setter
    def merging(self, value: bool) -> None:
        self._words[self._header + NOT_MERGING] = int(not value)

    @property
    def _closing(self) -> bool:
        return bool(self._words[self._header + CLOSING])

    # ---- the front ends' side ----

    def arriving(self, owner, rows: int | None = None) -> Arrival:
        """A request for `owner` has begun to arrive; with `rows`, it asks for a place to receive
        its body into."""
        with self._lock:
            place = None if rows is None else self._reserve(rows)
            self._count_arrival(self.owner, 1)
        return Arrival(owner, self.owner, place)

    def place(self, arrival: Arrival, rows: int) -> Feeds | None:
        """A place for an arrival that now knows its rows: its views, or None (no buffer free, too
        many rows, it has one already, or it is over)."""
        with self._lock:
            if arrival.over or arrival.place is not None:
                return None
            arrival.place = self._reserve(rows)
        return arrival.views

    def on_the_way(self) -> bool:
        """Whether requests are on their way (an arrival not over), in any process."""
        return self._words[self._header + ARRIVING] > 0

    def turn_begun(self) -> None:
        """(a front end) It has handed over a request in this turn of its event loop and will hand
        over the rest of the turn's at its end (`turn_over`): a batch that could run leaves the
        requests to that (`turns_under_way`), as the engine leaves them to a loop of its own
        process in the middle of a turn (Batcher._kick_coming)."""
        with self._lock:
            self._turn(self.owner, 1)

    def turn_over(self) -> None:
        """(a front end) Its turn's requests are about to be handed over (before they are: the
        engine then looks again when they come)."""
        with self._lock:
            self._turn(self.owner, 0)

    def turns_under_way(self) -> bool:
        """Whether a front end is in a turn of handing requests over (a look, not under the
        lock)."""
        return self._words[self._header + TURNS] > 0

    def arriving_now(self) -> int:
        """How many requests are on their way, in every process (a look, not under the lock)."""
        return self._words[self._header + ARRIVING]

    def forget(self, arrival: Arrival) -> bool:
        """The arrival is over (its request submitted, refused or gone); True if it was the last on
        its way."""
        with self._lock:
            if not arrival.over:
                arrival.over = True
                self._count_arrival(arrival.source, -1)
            return not self._words[self._header + ARRIVING]

    def leave(self, arrival: Arrival, keep: Place | None = None) -> None:
        """An arrival's place that no rows came into (unless it is `keep`, the place its feeds are
        in) is dead."""
        place = arrival.place
        if place is not None and place is not keep:
            self.kill(place)

    def adopt(self, owner, source: int, index: int, k: int, ticket: int) -> Arrival:
        """(the engine's process) The arrival a front end (`source`) counted and placed in place `k`
        of buffer `index` (reserved with `ticket`), now handed over: its place, or none where it is
        no longer that request's (its buffer was let go meanwhile)."""
        with self._lock:
            place = None
            if 0 <= index < self.table.count and self._words[self.table.group_at(index) + IN_USE]:
                group = self._group(index)
                if k < len(group.places) and group.places[k].ticket == ticket:
                    place = group.places[k]
        return Arrival(owner, source, place)

    def gone(self, owner: int) -> bool:
        """(the engine's process) The process counted as `owner` is gone: its places still arriving
        are dead, its arrivals no longer on their way. True if none is on its way now."""
        with self._lock:
            words, at = self._words, self.table.arrivals + owner
            words[self._header + ARRIVING] -= words[at]
            words[at] = 0
            self._turn(owner, 0)
            for group in self._groups():
                for place in group.places:
                    if place.owner == owner and place.state in (RESERVED, COPYING):
                        place.state = DEAD
            self._release()
            return not words[self._header + ARRIVING]

    # ---- the owner's, as a request is submitted ----

    def fill(self, place: Place, job) -> Place | None:
        """A request's rows are in its place: its job is attached, and it may run. Moved first where
        its buffer was sealed while it arrived and nothing left there could run with it (see
        _stranded): the place its job is in is returned, and the job runs from that place's
        views. None where the place died meanwhile (its front end's process went away)."""
        with self._lock:
            if place.state not in (RESERVED, COPYING):
                return None
            if self._stranded(place):
                place = self._move(place)
            place.state, place.job = FILLED, job
        return place

    def reserve_copy(self, feeds: Feeds, rows: int) -> Place | None:
        """A place of its own for a request not received into one, to `copy` it into: None where it
        does not fit (another layout, too many rows, no buffer free)."""
        if self.buffers is None or not self.buffers.fits(feeds, rows):
            return None
        with self._lock:
            place = self._reserve(rows, COPYING)
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
            for group in self._groups():
                for place in group.places:
                    if place.state == FILLED and given_up(place.job):
                        dropped.append(place.job)
                        place.state, place.job = DEAD, None
            if dropped:
                self._release()
        return dropped

    def next_span(self) -> Span | None:
        """The first run of consecutive places not run yet, each complete (FILLED or DEAD), from its
        first job to its last. Dead places before it are marked run on the way, unless a place
        still arriving is before them (a dead place between two jobs stays: the rows run must be
        contiguous). Its `arriving`: whether a place still arriving may join it (_joinable)."""
        with self._lock:
            merging = self.merging
            for group in self._groups():
                places, i = group.places, 0
                while i < len(places):
                    if places[i].state not in (FILLED, DEAD):
                        i += 1
                        continue
                    j = i
                    while j < len(places) and places[j].state in (FILLED, DEAD):
                        j += 1
                        # (no longer merging: places reserved before run one at a time)
                        if not merging and places[j - 1].state == FILLED:
                            break
                    # dead at its start: never computed; marked run unless a place still
                    # arriving is before it, which may yet run with the span across it
                    after_arriving = i > 0 and places[i - 1].state in (RESERVED, COPYING)
                    while i < j and places[i].state == DEAD:
                        if not after_arriving:
                            places[i].state = RAN
                        i += 1
                    # nor at its end (left to a later look)
                    while j > i and places[j - 1].state == DEAD:
                        j -= 1
                    if i < j:
                        return Span(group, places[i:j], j, _joinable(places, i, j))
                    # (all of it dead: i is past it)
        return None

    def filled_rows(self) -> int:
        """The rows of the places filled and not run yet."""
        with self._lock:
            return sum(p.rows for g in self._groups() for p in g.places if p.state == FILLED)

    def pending(self) -> bool:
        """Whether a place holds a job not run yet."""
        with self._lock:
            return any(p.state == FILLED for g in self._groups() for p in g.places)

    def copying(self) -> bool:
        """Whether a request is being copied into its place."""
        with self._lock:
            return any(p.state == COPYING for g in self._groups() for p in g.places)

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
                self._words[self.table.group_at(gathered.lent) + IN_USE] = 0
                self._close_when_back()

    def done(self, span: Span) -> None:
        """(engine thread) The run of a taken span returned: its buffer may go back to the pool."""
        with self._lock:
            span.group.running = False
            self._release()

    def free_buffers(self) -> list[int]:
        """The buffers no place and no run holds (their indexes): a look, not under the lock."""
        return [
            i for i in range(self.table.count) if not self._words[self.table.group_at(i) + IN_USE]
        ]

    # ---- the end ----

    def close(self) -> None:
        """No new place, no buffer lent to a run; the pool is closed once every buffer is back."""
        with self._lock:
            self._words[self._header + CLOSING] = 1
            self._close_when_back()

    def clear(self) -> list:
        """The engine thread died: nothing runs again. Every place not run is dead (a copy under way
        keeps its place until `kill`), the pool closes, and the jobs that were waiting in places are
        returned."""
        jobs = []
        with self._lock:
            self._words[self._header + CLOSING] = 1
            for group in self._groups():
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

    def _groups(self) -> list[_Group]:
        """The buffers holding places, oldest first (the last may be filling), each with its places
        as they are now."""
        words, table = self._words, self.table
        found = []
        for index in range(table.count):
            at = table.group_at(index)
            if words[at + IN_USE] and not words[at + LENT]:
                found.append(self._group(index))
        found.sort(key=lambda group: group.order)
        return found

    def _group(self, index: int) -> _Group:
        """This process's handle on buffer `index` (in use), its places caught up with the
        table's."""
        words, table = self._words, self.table
        at = table.group_at(index)
        order = words[at + ORDER]
        group = self._handles.get(index)
        if group is None or group.order != order:
            group = self._handles[index] = _Group(table, index, order)
        places = group.places
        for k in range(len(places), words[at + PLACES]):
            places.append(Place(group, k, table, self.buffers))
        return group

    def _take_buffer(self, lent: bool = False) -> int | None:
        """A free buffer, taken (for places; `lent`: for a run to gather into), or None. Its words
        are set before it is marked in use: a taker that dies halfway leaves it free."""
        words, table = self._words, self.table
        for index in range(table.count):
            at = table.group_at(index)
            if not words[at + IN_USE]:
                self.buffers.make(index)
                words[at + ORDER] = words[self._header + ORDERS]
                words[self._header + ORDERS] += 1
                words[at + SEALED] = words[at + LENT] = int(lent)
                words[at + RUNNING] = words[at + PLACES] = 0
                words[at + IN_USE] = 1
                return index
        return None

    def _reserve(self, rows: int, state: int = RESERVED) -> Place | None:
        """The next `rows` rows of the buffer being filled (a new buffer when it is full or sealed),
        or None when no buffer is free, the rows fit none, or no new place is to be had."""
        if self.buffers is None or self._closing or not self.merging or rows > self.capacity:
            return None
        groups = self._groups()
        group = groups[-1] if groups and not groups[-1].sealed else None
        if group is not None and group.rows + rows > self.capacity:
            group.sealed = True
            group = None
        if group is None:
            index = self._take_buffer()
            if index is None:
                return None
            group = self._group(index)
        words, k = self._words, len(group.places)
        at = self.table.place_at(group.index, k)
        words[at + START], words[at + ROWS] = group.rows, rows
        words[at + STATE], words[at + OWNER] = state, self.owner
        words[at + TICKET] = words[self._header + TICKETS]
        words[self._header + TICKETS] += 1
        # the one write that makes it a place (see the module's invariants)
        words[self.table.group_at(group.index) + PLACES] = k + 1
        place = Place(group, k, self.table, self.buffers)
        group.places.append(place)
        return place

    def _turn(self, owner: int, under_way: int) -> None:
        words, at = self._words, self.table.turns + owner
        words[self._header + TURNS] += under_way - words[at]
        words[at] = under_way

    def _count_arrival(self, source: int, n: int) -> None:
        self._words[self.table.arrivals + source] += n
        self._words[self._header + ARRIVING] += n

    def _move(self, stranded: Place) -> Place:
        """A stranded place's rows copied into the buffer being filled: the place they are in now,
        or the stranded one where they can't be (no buffer free, or they would seal the one being
        filled for a place of their own). Copied under the lock, so that no other thread ever sees a
        half-moved request."""
        rows = stranded.rows
        groups = self._groups()
        filling = groups[-1] if groups and not groups[-1].sealed else None
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

    def _stranded(self, place: Place) -> bool:
        """Whether a place just filled would run alone (see _stranded)."""
        return _stranded(place, self._group(place.group.index).places)

    def _free_up_to(self, group: _Group, after: int) -> int:
        """The row up to which the buffer is free after the places before index `after` (a run may
        pad into it): the next place still to be run or arriving, else the buffer's end."""
        for place in self._group(group.index).places[after:]:
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
                    index = self._take_buffer(lent=True)
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
            for g in self._groups()
            if not g.running and all(p.state in (DEAD, RAN) for p in g.places)
        ]
        for group in done:
            self._words[self.table.group_at(group.index) + IN_USE] = 0
            del self._handles[group.index]
            # Its places point at it and it at them: a cycle only the collector would free, with
            # each place's job and future, and its runs hold the event loops.
            group.places = []
        if done:
            self._close_when_back()

    def _close_when_back(self) -> None:
        if (
            self.owner == 0
            and self._closing
            and self.buffers is not None
            and not any(
                self._words[self.table.group_at(i) + IN_USE] for i in range(self.table.count)
            )
        ):
            self.buffers.close()


def _joinable(places: list[Place], i: int, j: int) -> bool:
    """Whether a place still arriving may join the run of places[i:j]: the nearest place on either
    side that is not dead is arriving (a place that ran is a boundary)."""
    for side in (reversed(places[:i]), places[j:]):
        for other in side:
            if other.state != DEAD:
                if other.state in (RESERVED, COPYING):
                    return True
                break
    return False


def _stranded(place: Place, places: list[Place]) -> bool:
    """Whether a place just filled would run alone: its buffer is sealed and no place it could share
    a run with is left (its neighbours ran without it, while it was arriving; a dead place between
    is no boundary, a run takes it as filler). Its rows are then better copied next to the requests
    still arriving: one copy of a request, where a run of one row costs a GPU nearly what 8 or 16
    do."""
    if not place.group.sealed or place.state in (DEAD, RAN):
        return False
    i = place.k
    for side in (reversed(places[:i]), places[i + 1 :]):
        for other in side:
            if other.state == RAN:
                break
            if other.state != DEAD:
                return False
    return True
