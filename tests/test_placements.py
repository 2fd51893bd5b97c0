"""The batch buffers' rows (serving/placements.py) alone, over a real pool: one test for each race
that the batcher's two owners of the pool once had, each played in the order that had broken it.

Each past race named by the commit that fixed it. The places are driven the way the batcher drives
them (arriving, fill, next_span, take, batch, done); jobs are plain strings, since Placements never
looks inside one."""

from __future__ import annotations

import asyncio
import threading
import types

import numpy as np
import pytest

from serving.batcher import Batcher, QueueFull
from serving.placements import Placements
from serving.staging import BatchBuffers, NonFinite

X = types.SimpleNamespace(name="x", dtype=np.dtype(np.float32), shape=(None, 2))


class Owner:
    """What an arrival is for: told when one ends (a batcher wakes its engine there)."""

    def __init__(self):
        self.told: list = []

    def ended(self, arrival) -> None:
        self.told.append(arrival)


def placements(capacity: int = 8) -> tuple[Placements, BatchBuffers]:
    """Two buffers of 8 rows of one FP32 input "x" of 2 columns, and their placements."""
    pool = BatchBuffers([X], capacity=8, count=2)
    return Placements(pool, capacity), pool


def rows(value: float, n: int = 1) -> dict[str, np.ndarray]:
    return {"x": np.full((n, 2), value, np.float32)}


def received(p: Placements, value: float, n: int = 1):
    """A request whose body was received into its place (a binary V2 body)."""
    arrival = p.arriving(Owner(), rows=n)
    arrival.views["x"][:] = value
    return arrival


def run_next(p: Placements):
    """The engine's turn: the next span taken, and the rows its run reads."""
    span = p.next_span()
    jobs = p.take(span)
    return span, jobs, p.batch(span).feeds


def test_ed9b7ce_a_buffer_being_run_is_not_handed_out_when_its_last_other_place_dies():
    """A is being run; B, in the same buffer, was still arriving when its client went away. Every
    place of the buffer has now run or died, but the model still reads A's rows: the buffer went
    back to the pool, and the next request's body landed in them (A answered from C's values)."""
    p, pool = placements()
    a, b = received(p, 1.0, 2), p.arriving(Owner(), rows=2)
    p.fill(a.place, "A")
    span, jobs, reading = run_next(p)
    assert jobs == ["A"]
    p.forget(b)
    p.leave(b)
    c = received(p, 7.0, 2)
    assert reading["x"].tolist() == [[1.0, 1.0]] * 2, "C's body landed in the rows A's run reads"
    assert c.place.group.index != a.place.group.index
    assert p.free_buffers() == []
    p.done(span)
    # A's buffer is back in the pool now
    assert p.free_buffers() == [a.place.group.index]


def test_6d27c5f_a_moved_request_runs_from_its_new_rows_not_the_buffer_it_left():
    """S's neighbour ran while S's body was still arriving, so S was moved next to C, in the buffer
    being filled, to run with it. The buffer S left went back to the pool and took the next
    request's body; S's job must run from its new place, not from the rows it arrived in (a merged
    run that failed once ran each job alone from those: S answered from another client's values)."""
    p, _ = placements()
    a, s = received(p, 1.0), p.arriving(Owner(), rows=1)
    p.fill(a.place, "A")
    span, _, _ = run_next(p)
    p.done(span)
    c = received(p, 4.0)
    s.views["x"][:] = 3.0
    moved = p.fill(s.place, "S")
    # too big for C's buffer: takes the one S left
    x = p.arriving(Owner(), rows=7)
    assert x.place.group.index == s.place.group.index
    x.views["x"][:] = 99.0
    assert moved.views["x"].tolist() == [[3.0, 3.0]], "S's job reads another client's rows"
    assert moved.group is c.place.group
    p.fill(c.place, "C")
    _, jobs, reading = run_next(p)
    assert jobs == ["C", "S"] and reading["x"].tolist() == [[4.0, 4.0], [3.0, 3.0]]


def test_696be8d_the_pool_is_not_closed_under_a_copy():
    """A request is copied into its place outside every lock (on its event loop). The batcher closed
    (a model unloaded) in the middle of the copy, found nothing pending, and the pool was closed
    under it. It closes once the copied request has run and its buffer is back."""
    p, pool = placements()
    place = p.reserve_copy(rows(3.0, 2), 2)
    p.close()
    assert pool._buffers, "closed under the copy"
    p.copy(place, rows(3.0, 2))
    p.copied(place, "J")
    span, jobs, reading = run_next(p)
    assert jobs == ["J"] and reading["x"].tolist() == [[3.0, 3.0]] * 2
    assert pool._buffers
    p.done(span)
    # closed now: every buffer is back
    assert not pool._buffers


def test_f6fbc8f_the_pool_is_not_closed_while_a_run_reads_it_when_a_copy_is_refused():
    """A run reads buffer 0; a request being copied into buffer 1 holds a NaN and is refused; then
    nothing waits and nothing is copied: the batcher's close took that as drained and closed the
    model (and its pool) under the run. The pool closes once the run is done."""
    p, pool = placements()
    a = received(p, 1.0)
    p.fill(a.place, "A")
    span, _, reading = run_next(p)
    refused = p.reserve_copy(rows(np.nan), 1)
    p.close()
    with pytest.raises(NonFinite):
        p.copy(refused, rows(np.nan))
    p.kill(refused)
    assert not p.pending() and not p.copying()
    assert pool._buffers, "closed under the run"
    assert reading["x"].tolist() == [[1.0, 1.0]]
    p.done(span)
    assert not pool._buffers


def test_73b1e9f_a_request_given_up_in_a_place_is_never_computed():
    """A request copied into a place whose caller gave up (a request deadline) before its run is
    dropped from it: left out of the rows run at a span's start, and inside a span its rows are a
    copy of a good row's, not its own values computed. It had cost a full model run."""
    p, _ = placements()
    for value, job in ((9.0, "gone"), (1.0, "kept"), (8.0, "gone too"), (2.0, "kept too")):
        place = p.reserve_copy(rows(value, 2), 2)
        p.copy(place, rows(value, 2))
        p.copied(place, job)
    dropped = p.drop(lambda job: job.startswith("gone"))
    span, jobs, reading = run_next(p)
    assert jobs == ["kept", "kept too"]
    # not from row 0: the first one is not computed
    assert (span.start, span.rows) == (2, 6)
    assert reading["x"][:, 0].tolist() == [1.0, 1.0, 1.0, 1.0, 2.0, 2.0]
    assert dropped == ["gone", "gone too"]


def test_4ff513d_the_last_arrival_refused_wakes_a_batch_that_waited_for_it():
    """A batch waits for a request on its way (the arrival wait, 60 s here). That request is refused
    as it is queued (the queue is full): no kick followed it, and the batch waited out its whole
    wait for a request that was not coming. The engine is told at once. With a runner driven by
    hand: no engine thread, no sleep."""
    told = threading.Event()
    runner = types.SimpleNamespace(
        alive=True, ready=lambda batcher: told.set(), ready_at=lambda batcher, when: None
    )

    async def main():
        b = Batcher(
            lambda parts: {},
            runner,
            max_batch_size=8,
            max_delay_ms=0,
            max_queue_rows=2,
            arrival_wait_ms=60_000,
        )
        b.start()
        refused = b.arriving()
        waiting = asyncio.ensure_future(b.submit(rows(1.0), 1))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        waited = b._wait_until is not None and not told.is_set()
        with pytest.raises(QueueFull):
            await b.submit(rows(2.0, 2), 2, refused)
        await asyncio.sleep(0)
        waiting.cancel()
        return waited, told.is_set(), b._placements.on_the_way()

    waited, told_after, still_on_the_way = asyncio.run(main())
    assert waited, "the batch did not wait for the request on its way"
    assert not still_on_the_way
    assert told_after, "the refused last arrival left the batch waiting"
