"""The batcher alone, with a real (slow) run function and the server's real engine thread
(serving/runner.py): no HTTP, no onnxruntime."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import gc
import threading
import time
import types

import numpy as np
import pytest

from serving import batcher, placements
from serving.batcher import Batcher, BatcherClosed, QueueFull
from serving.runner import Runner
from serving.staging import BatchBuffers, NonFinite, concat


class Engine:
    """Doubles its input; each run holds the thread for `seconds` and records its batch size."""

    def __init__(self, seconds: float = 0.05, fail_on: float | None = None):
        self.seconds = seconds
        self.fail_on = fail_on
        self.batches: list[int] = []
        self.started = threading.Event()

    def run(self, parts):
        self.started.set()
        x = concat(parts)["x"]
        self.batches.append(len(x))
        time.sleep(self.seconds)
        if self.fail_on is not None and (x == self.fail_on).any():
            raise RuntimeError("model failed")
        return {"y": x * 2}


def rows(*values: float) -> dict[str, np.ndarray]:
    return {"x": np.array(values, dtype=np.float32)}


def run(coro):
    return asyncio.run(coro)


def make(engine: Engine, executor, **kw) -> Batcher:
    kw = {"max_batch_size": 8, "max_delay_ms": 0, "max_queue_rows": 64, **kw}
    return Batcher(engine.run, executor, **kw)


@pytest.fixture
def executor():
    runner = Runner()
    yield runner
    runner.shutdown()


def kill(runner: Runner) -> None:
    """What no exception of a run can do: the engine thread itself ends (an asynchronous
    SystemExit)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(runner._thread.ident), ctypes.py_object(SystemExit)
    )


def test_idle_engine_runs_at_once_and_arrivals_during_a_run_form_the_next_batch(executor):
    engine = Engine(seconds=0.2)

    async def main():
        b = make(engine, executor)
        b.start()
        first = asyncio.create_task(b.submit(rows(1), 1))
        # the first run is under way
        await asyncio.sleep(0.05)
        rest = [asyncio.create_task(b.submit(rows(v, v), 2)) for v in (2, 3, 4)]
        outs = await asyncio.gather(first, *rest)
        await b.close()
        return outs

    outs = run(main())
    # nobody waited for the first; the next three went together
    assert engine.batches == [1, 6]
    assert [o["y"].tolist() for o in outs] == [[2], [4, 4], [6, 6], [8, 8]]


def test_what_a_loop_takes_in_in_one_turn_runs_as_one_batch_even_if_the_engine_comes_free_in_the_middle(
    executor,
):
    engine = Engine(seconds=0.1)

    async def main():
        b = make(engine, executor)
        b.start()
        first = asyncio.create_task(b.submit(rows(1), 1))
        # the first run is under way
        await asyncio.sleep(0.02)

        # a front end in the middle of its turn (a system call: the GIL given away)
        async def busy_taking_in():
            # the engine's run ends meanwhile; request 2 is queued, request 3 not yet
            time.sleep(0.2)

        # all three first run in the same turn of the loop
        turn = [
            asyncio.create_task(b.submit(rows(2), 1)),
            asyncio.create_task(busy_taking_in()),
            asyncio.create_task(b.submit(rows(3), 1)),
        ]
        outs = await asyncio.gather(first, *turn)
        await b.close()
        return outs

    outs = run(main())
    # not [1, 1, 1]: the engine left the batch to the loop's turn
    assert engine.batches == [1, 2]
    assert [outs[0]["y"].tolist(), outs[1]["y"].tolist(), outs[3]["y"].tolist()] == [[2], [4], [6]]


class CountingRunner(Runner):
    """The real engine thread, counting how often it is told to look at a batcher."""

    def __init__(self):
        super().__init__()
        self.told = 0

    def ready(self, batcher) -> None:
        self.told += 1
        super().ready(batcher)


def test_the_engine_is_told_of_a_batch_waiting_for_arrivals_only_once_the_last_is_in():
    """Each loop turn's kick decides whether the batch is due, rather than waking the engine to
    decide: every wake is a thread switch and a GIL hand-off, and an engine woken at each kick of a
    busy loop would mostly go back to sleep (docs/benchmarks.md#servingbatcherpy)."""
    engine, runner = Engine(seconds=0.0), CountingRunner()

    async def main():
        b = make(engine, runner, arrival_wait_ms=3000)
        b.start()
        # three bodies on their way
        arrivals = [b.arriving() for _ in range(3)]
        started = time.monotonic()
        first_two = []
        for value, arrival in zip((1, 2), arrivals):
            first_two.append(asyncio.create_task(b.submit(rows(value), 1, arrival)))
            # a turn of the loop of its own: its kick has run
            await asyncio.sleep(0.05)
        told_while_waiting = runner.told
        last = await b.submit(rows(3), 1, arrivals[2])
        outs = await asyncio.gather(*first_two)
        await b.close()
        return (
            told_while_waiting,
            [o["y"].tolist() for o in [*outs, last]],
            time.monotonic() - started,
        )

    try:
        told_while_waiting, outs, took = run(main())
    finally:
        runner.shutdown()
    # (each kick woke the engine before: 1)
    assert told_while_waiting == 0
    assert engine.batches == [3] and outs == [[2], [4], [6]]
    # the last one in ended the 3 s wait
    assert took < 1.5


def test_a_batch_waiting_for_an_arrival_that_is_refused_runs_at_once(executor):
    """The last request a batch waited for is refused as it is queued (the queue is full): no kick
    follows it, and the batch must not wait out the rest of its 3 s for a request that is not
    coming."""
    engine = Engine(seconds=0.0)

    async def main():
        b = make(engine, executor, arrival_wait_ms=3000, max_queue_rows=2)
        b.start()
        refused = b.arriving()
        started = time.monotonic()
        # waits for the request on its way
        waiting = asyncio.create_task(b.submit(rows(1), 1))
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFull):
            # 1 + 2 rows > 2
            await b.submit(rows(2, 3), 2, refused)
        out = await waiting
        took = time.monotonic() - started
        await b.close()
        return out["y"].tolist(), took

    out, took = run(main())
    assert out == [2] and engine.batches == [1]
    # (the wait's 3 s before)
    assert took < 1.5, took


def test_a_wait_whose_batch_was_given_up_does_not_hold_the_next_request(executor):
    """A batch waited for a slow upload, and its only request was given up (its caller's deadline)
    before the wait ran out. The next request, with the upload still on its way, waits at most its
    own arrival wait: the given-up batch's ended wait had stayed behind and kept the next request's
    kick from being sent at all."""
    engine = Engine(seconds=0.0)

    async def main():
        b = make(engine, executor, arrival_wait_ms=300)
        b.start()
        # on its way all along
        slow_upload = b.arriving()
        given_up = asyncio.create_task(b.submit(rows(1), 1))
        await asyncio.sleep(0.05)
        # (a request deadline)
        given_up.cancel()
        # the wait ran out, with nothing left to run
        await asyncio.sleep(0.5)
        started = time.monotonic()
        out = await asyncio.wait_for(b.submit(rows(2), 1), 5)
        took = time.monotonic() - started
        slow_upload.end()
        await b.close()
        return out["y"].tolist(), took

    out, took = run(main())
    assert out == [4] and engine.batches == [1]
    # its own 300 ms wait for the upload; it waited for the upload's end before
    assert took < 1.5, took


def test_batches_never_exceed_max_and_large_jobs_run_alone(executor):
    engine = Engine(seconds=0.05)

    async def main():
        b = make(engine, executor, max_batch_size=4)
        b.start()
        blocker = asyncio.create_task(b.submit(rows(0), 1))
        await asyncio.sleep(0.02)
        jobs = [
            asyncio.create_task(b.submit(rows(*[v] * n), n))
            for v, n in ((1, 3), (2, 2), (3, 6), (4, 1))
        ]
        outs = await asyncio.gather(blocker, *jobs)
        await b.close()
        return outs

    outs = run(main())
    # order kept; 3+2 > 4; the 6-row job alone
    assert engine.batches == [1, 3, 2, 6, 1]
    assert outs[3]["y"].tolist() == [6] * 6


def test_max_delay_gathers_a_partial_batch(executor):
    engine = Engine(seconds=0.0)

    async def main():
        b = make(engine, executor, max_delay_ms=300, max_batch_size=3)
        b.start()
        a = asyncio.create_task(b.submit(rows(1), 1))
        await asyncio.sleep(0.05)
        c = asyncio.create_task(b.submit(rows(2), 1))
        # fills the batch: runs before the delay ends
        d = asyncio.create_task(b.submit(rows(3), 1))
        await asyncio.gather(a, c, d)
        await b.close()

    run(main())
    assert engine.batches == [3]


def test_full_queue_refuses_and_close_drains(executor):
    engine = Engine(seconds=0.1)

    async def main():
        b = make(engine, executor, max_queue_rows=4)
        b.start()
        running = asyncio.create_task(b.submit(rows(9), 1))
        # taken off the queue, running
        await asyncio.sleep(0.02)
        queued = [asyncio.create_task(b.submit(rows(1, 1), 2)) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(QueueFull):
            await b.submit(rows(1), 1)
        await b.close()
        with pytest.raises(BatcherClosed):
            await b.submit(rows(1), 1)
        return await asyncio.gather(running, *queued)

    outs = run(main())
    assert len(outs) == 3 and outs[1]["y"].tolist() == [2, 2]


def test_a_request_whose_values_fail_the_model_fails_alone_and_the_next_batch_still_runs(executor):
    """7 and 1 are merged into one batch; 7 makes the model raise (as an index past an embedding's
    size does): the batch runs again job by job, and only the request that carried 7 fails."""
    engine = Engine(seconds=0.05, fail_on=7)

    async def main():
        b = make(engine, executor)
        b.start()
        blocker = asyncio.create_task(b.submit(rows(0), 1))
        await asyncio.sleep(0.02)
        bad = [asyncio.create_task(b.submit(rows(v), 1)) for v in (7, 1)]
        results = await asyncio.gather(blocker, *bad, return_exceptions=True)
        after = await b.submit(rows(5), 1)
        await b.close()
        return results, after

    results, after = run(main())
    assert isinstance(results[1], RuntimeError) and results[2]["y"].tolist() == [2]
    assert after["y"].tolist() == [10]


def test_unbatchable_model_runs_jobs_one_by_one(executor):
    engine = Engine(seconds=0.05)

    async def main():
        b = make(engine, executor, merge=False)
        b.start()
        await asyncio.gather(*[b.submit(rows(v), 1) for v in range(4)])
        await b.close()

    run(main())
    assert engine.batches == [1, 1, 1, 1]


def test_mixed_trailing_shapes_never_merge_and_the_batcher_keeps_serving(executor):
    # A model with a dynamic axis besides the batch one (image size, sequence length): requests of
    # different trailing shapes cannot be concatenated. They must run in separate batches, never
    # kill the loop.
    engine = Engine(seconds=0.05)

    def x(shape, value, dtype=np.float32):
        return {"x": np.full(shape, value, dtype=dtype)}

    async def main():
        b = make(engine, executor)
        b.start()
        blocker = asyncio.create_task(b.submit(x((1, 2), 0), 1))
        # under way: the next three queue up together
        await asyncio.sleep(0.02)
        mixed = [
            asyncio.create_task(b.submit(feeds, 1))
            for feeds in (x((1, 2), 1), x((1, 3), 2), x((1, 2), 3), x((1, 2), 4, np.float64))
        ]
        outs = await asyncio.wait_for(asyncio.gather(blocker, *mixed), 5)
        later = await asyncio.wait_for(b.submit(x((2, 5), 5), 2), 5)
        assert b.alive and b.queued_rows == 0
        await b.close()
        return outs, later

    outs, later = run(main())
    # (1,2) float32 rows merge (skipping the others, which keep their order); then (1,3); then
    # float64.
    assert engine.batches == [1, 2, 1, 1, 2]
    for out, (shape, value, dtype) in zip(
        outs,
        [
            ((1, 2), 0, np.float32),
            ((1, 2), 1, np.float32),
            ((1, 3), 2, np.float32),
            ((1, 2), 3, np.float32),
            ((1, 2), 4, np.float64),
        ],
    ):
        np.testing.assert_array_equal(out["y"], np.full(shape, 2 * value, dtype=dtype))
        assert out["y"].dtype == dtype
    np.testing.assert_array_equal(later["y"], np.full((2, 5), 10, dtype=np.float32))


def test_a_dead_loop_fails_waiting_requests_refuses_new_ones_and_is_not_alive(executor):
    engine = Engine(seconds=0.05)

    async def main():
        b = make(engine, executor)
        b.start()
        assert b.alive
        running = asyncio.create_task(b.submit(rows(1), 1))
        await asyncio.sleep(0.02)
        waiting = asyncio.create_task(b.submit(rows(2), 1))
        await asyncio.sleep(0)
        # the engine thread dies when the run under way returns
        kill(executor)
        results = await asyncio.wait_for(
            asyncio.gather(running, waiting, return_exceptions=True), 5
        )
        assert not b.alive and b.queued_rows == 0
        with pytest.raises(BatcherClosed):
            await b.submit(rows(3), 1)
        # returns, does not raise
        await b.close()
        return results

    results = run(main())
    assert all(isinstance(r, BatcherClosed) for r in results)


def test_a_run_past_its_deadline_fails_its_requests_and_stalls_until_it_returns(executor):
    """A wedged run (a hung GPU kernel): its requests get RunTimedOut at once, `stalled` says so
    while the engine thread is still inside it, and the next request runs after it returns."""
    from serving.batcher import RunTimedOut

    engine = Engine(seconds=0.6)

    async def main():
        b = make(engine, executor, run_timeout=0.2)
        b.start()
        started = time.perf_counter()
        first = asyncio.create_task(b.submit(rows(1), 1))
        await asyncio.sleep(0.35)
        stalled_meanwhile = b.stalled
        with pytest.raises(RunTimedOut):
            await first
        failed_after = time.perf_counter() - started
        engine.seconds = 0.01
        # waits for the stalled run to return, then runs
        second = await b.submit(rows(3), 1)
        await b.close()
        return stalled_meanwhile, failed_after, second, b.stalled

    stalled_meanwhile, failed_after, second, stalled_at_end = run(main())
    assert stalled_meanwhile and failed_after < 0.5 and not stalled_at_end
    assert second["y"].tolist() == [6]


def test_a_request_whose_caller_gave_up_is_not_run(executor):
    engine = Engine(seconds=0.2)

    async def main():
        b = make(engine, executor)
        b.start()
        blocker = asyncio.create_task(b.submit(rows(0), 1))
        await asyncio.sleep(0.05)
        gave_up = asyncio.create_task(b.submit(rows(9, 9, 9), 3))
        await asyncio.sleep(0.01)
        # what a request deadline does
        gave_up.cancel()
        kept = asyncio.create_task(b.submit(rows(2), 1))
        await blocker
        out = await kept
        await b.close()
        return out, b.queued_rows

    out, queued = run(main())
    assert out["y"].tolist() == [4] and queued == 0
    # the 3 rows of the cancelled request never ran
    assert engine.batches == [1, 1]


# a model's input
X_OF_2_COLUMNS = types.SimpleNamespace(name="x", dtype=np.dtype(np.float32), shape=(None, 2))


class TwoColumnBuffers(BatchBuffers):
    """Two batch buffers of 8 rows for one FP32 input "x" of 2 columns (a model of that one input),
    saying how many of them were free when the pool was closed (once every buffer was back);
    `placements`: the batcher's, which hands them out (set by the test)."""

    def __init__(self):
        super().__init__([X_OF_2_COLUMNS], capacity=8, count=2)
        self.free_when_closed: int | None = None
        self.placements = None

    def close(self) -> None:
        if self.placements is not None:
            self.free_when_closed = len(self.placements.free_buffers())
        super().close()


def two_column_buffers() -> TwoColumnBuffers:
    return TwoColumnBuffers()


def where(buffers: BatchBuffers, feeds) -> tuple[int, int]:
    """(buffer index, first row) of a run's feeds in `buffers`."""
    x = feeds["x"]
    for index, buffer in enumerate(buffers._buffers):
        offset = x.ctypes.data - buffer["x"].ctypes.data
        if 0 <= offset < buffer["x"].nbytes:
            return index, offset // buffer["x"][0].nbytes
    raise AssertionError("the run's rows are in no batch buffer")


def test_a_buffer_being_run_is_not_handed_out_again_when_its_last_other_place_is_given_up(executor):
    """A batch buffer holds A (being run) and B (its body still arriving). B's client goes away
    mid-run: every place of the buffer is now run or dead, but the engine still reads A's rows. The
    buffer was released then, and the next request's body landed in A's rows while the model read
    them: A was answered from C's values."""
    buffers = two_column_buffers()
    running = threading.Event()

    def run_gathered(feeds, rows):
        running.set()
        # the model reading the rows meanwhile
        time.sleep(0.2)
        return {"y": feeds["x"][:rows] * 2}

    async def main():
        b = Batcher(
            lambda parts: {},
            executor,
            max_batch_size=8,
            max_delay_ms=0,
            max_queue_rows=64,
            buffers=buffers,
            run_gathered=run_gathered,
        )
        b.start()
        a, gone = b.arriving(rows=2), b.arriving(rows=2)
        a.views["x"][:] = 1.0
        a.filled = True
        answer = asyncio.create_task(b.submit(a.views, 2, a))
        while not running.is_set():
            await asyncio.sleep(0.005)
        # B's client disconnected mid-body
        gone.end()
        # the next request: its body lands in its place at once
        c = b.arriving(rows=2)
        c.views["x"][:] = 7.0
        c.filled = True
        other = asyncio.create_task(b.submit(c.views, 2, c))
        out = (await answer)["y"], (await other)["y"]
        await b.close()
        return out

    a_out, c_out = run(main())
    # A's own values, not C's 7s
    assert a_out.tolist() == [[2.0, 2.0], [2.0, 2.0]], a_out
    assert c_out.tolist() == [[14.0, 14.0], [14.0, 14.0]]


def test_requests_through_batch_buffers_leave_nothing_for_the_garbage_collector(executor):
    """A request's place, job and future are freed when its buffer goes back to the pool, not left
    in a cycle (a buffer's places pointed at it and it at them) for the collector: ~10 objects a
    request, and a collection every ~2,000 requests that held the event loop 12 ms."""
    buffers = two_column_buffers()

    def run_gathered(feeds, rows):
        return {"y": feeds["x"][:rows] * 2}

    async def main():
        b = Batcher(
            lambda parts: {},
            executor,
            max_batch_size=8,
            max_delay_ms=0,
            max_queue_rows=64,
            buffers=buffers,
            run_gathered=run_gathered,
        )
        b.start()
        # copied into their places, and received into them
        for _ in range(5):
            arrivals = [b.arriving(rows=1) for _ in range(3)]
            for arrival in arrivals:
                arrival.views["x"][:] = 1.0
                arrival.filled = True
            await asyncio.gather(
                *(b.submit(a.views, 1, a) for a in arrivals),
                *(b.submit({"x": np.ones((1, 2), np.float32)}, 1) for _ in range(3)),
            )
        await b.close()

    gc.collect()
    gc.disable()
    try:
        run(main())
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        left = collections.Counter(
            type(o).__name__
            for o in gc.garbage
            if isinstance(o, (placements.Place, placements._Group, batcher._Job))
        )
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not left, left


def test_a_request_given_up_in_a_batch_buffer_is_not_computed(executor):
    """Requests copied into a batch buffer's places: one whose caller gave up (a request deadline)
    before the run is left out of it, at a span's start as anywhere it can be, not computed as
    padding."""
    buffers = two_column_buffers()
    runs = []

    def run_gathered(feeds, rows):
        runs.append((where(buffers, feeds)[1], rows))
        return {"y": feeds["x"][:rows] * 2}

    async def main():
        b = Batcher(
            lambda parts: {},
            executor,
            max_batch_size=8,
            max_delay_ms=0,
            max_queue_rows=64,
            buffers=buffers,
            run_gathered=run_gathered,
        )
        b.start()
        gave_up = asyncio.create_task(b.submit({"x": np.full((2, 2), 9, np.float32)}, 2))
        kept = asyncio.create_task(b.submit({"x": np.full((2, 2), 1, np.float32)}, 2))
        # both copied into their places, rows 0-1 and 2-3
        await asyncio.sleep(0)
        # in the same turn of the loop: before the engine takes the batch
        gave_up.cancel()
        out = await kept
        await b.close()
        return out["y"], b.queued_rows

    out, queued = run(main())
    assert out.tolist() == [[2.0, 2.0], [2.0, 2.0]] and queued == 0
    # the kept request's rows only
    assert runs == [(2, 2)], runs


@pytest.mark.parametrize("merged_run_fails", [False, True])
def test_a_request_still_arriving_when_its_buffer_ran_joins_the_next_batch_instead_of_running_alone(
    executor, merged_run_fails
):
    """A, B and S took places one after another in a buffer; A and B's bodies came in, S's was still
    arriving when the arrival wait ran out, so A and B ran without it. S, in then, would have run
    alone (its buffer sealed, its neighbours run): on a GPU a run of one row costs nearly what one
    of 16 does. It is copied next to C, the request arriving in the next buffer, and runs with it.
    `merged_run_fails`: C's values fail that run, and each request runs again alone; S's first
    buffer is back in the pool by then, another request's body in it, and S's answer must still be
    from S's own values."""
    buffers = two_column_buffers()
    runs = []

    def fails_on_c(x):
        if merged_run_fails and (x == 4.0).any():
            raise RuntimeError("model failed")

    def run_gathered(feeds, rows):
        runs.append((*where(buffers, feeds), rows))
        x = feeds["x"][:rows]
        free = buffers.placements.free_buffers()
        if merged_run_fails and rows > 1 and len(free) == 1:
            # the free buffer takes another request's body in
            buffers.make(free[0])["x"][:] = 99.0
        fails_on_c(x)
        return {"y": x * 2}

    def run_alone(parts):
        x = concat(parts)["x"]
        fails_on_c(x)
        return {"y": x * 2}

    async def main():
        b = Batcher(
            run_alone,
            executor,
            max_batch_size=8,
            max_delay_ms=0,
            max_queue_rows=64,
            buffers=buffers,
            run_gathered=run_gathered,
            arrival_wait_ms=200,
        )
        buffers.placements = b._placements
        b.start()
        first = [b.arriving(rows=1) for _ in range(3)]
        answers = {}
        for name, arrival, value in (("a", first[0], 1.0), ("b", first[1], 2.0)):
            arrival.views["x"][:] = value
            arrival.filled = True
            answers[name] = asyncio.create_task(b.submit(arrival.views, 1, arrival))
        # after the arrival wait: A and B ran, S still arriving
        await answers["a"]
        # the next buffer's first place
        c = b.arriving(rows=1)
        straggler = first[2]
        straggler.views["x"][:] = 3.0
        straggler.filled = True
        answers["s"] = asyncio.create_task(b.submit(straggler.views, 1, straggler))
        await asyncio.sleep(0.05)
        c.views["x"][:] = 4.0
        c.filled = True
        answers["c"] = asyncio.create_task(b.submit(c.views, 1, c))
        await asyncio.wait(answers.values())
        out = {
            name: (str(task.exception()) if task.exception() else task.result()["y"].tolist())
            for name, task in answers.items()
        }
        await b.close()
        return out, b.queued_rows, buffers.free_when_closed

    out, queued, free = run(main())
    c_answer = "model failed" if merged_run_fails else [[8.0, 8.0]]
    assert out == {"a": [[2.0, 2.0]], "b": [[4.0, 4.0]], "s": [[6.0, 6.0]], "c": c_answer}, out
    # not [2, 1, 1]: S ran beside C
    assert [rows for _, _, rows in runs] == [2, 2], runs
    # both buffers back in the pool
    assert queued == 0 and free == 2


def rest_batcher(executor) -> tuple[Batcher, list]:
    """A batcher of two buffers of 8 rows, a 300 ms arrival wait, and the first column of each
    run's rows, in order."""
    runs = []

    def run_gathered(feeds, rows):
        runs.append(feeds["x"][:rows, 0].tolist())
        return {"y": feeds["x"][:rows] * 2}

    b = Batcher(
        lambda parts: {"y": concat(parts)["x"] * 2},
        executor,
        max_batch_size=8,
        max_delay_ms=0,
        max_queue_rows=64,
        buffers=two_column_buffers(),
        run_gathered=run_gathered,
        arrival_wait_ms=300,
    )
    b.start()
    return b, runs


def received(b: Batcher, arrival, value: float) -> asyncio.Task:
    """An arrival's body in its place, submitted."""
    arrival.views["x"][:] = value
    arrival.filled = True
    return asyncio.create_task(b.submit(arrival.views, 1, arrival))


@pytest.mark.parametrize("straggler", ["comes in", "goes away", "never comes"])
def test_the_rest_of_a_buffer_that_ran_waits_for_its_own_places_still_arriving(executor, straggler):
    """A, S and B took places one after another in a buffer; A's and B's bodies came in, S's was
    still arriving when the arrival wait ran out, so A ran without it (a run takes consecutive
    rows). B, behind S in a buffer now sealed, waits for S, the one request that can still join
    its run, rather than running alone at once: S and B then run as one (front-end processes, whose
    requests take places in turn, leave such rests often). S's client going
    away ends the wait at once; S never coming, the arrival wait. C, arriving in the next buffer, is
    no reason to wait."""

    async def main():
        b, runs = rest_batcher(executor)
        a, s, b_ = (b.arriving(rows=1) for _ in range(3))
        answers = {"a": received(b, a, 1.0), "b": received(b, b_, 2.0)}
        # A runs once the arrival wait is out, alone: S, still arriving, ends its span
        await answers["a"]
        ran_a = time.monotonic()
        # on its way in the next buffer: S is not the last on its way
        c = b.arriving(rows=1)
        await asyncio.sleep(0.05)
        # B waits for S
        assert not answers["b"].done()
        if straggler == "comes in":
            answers["s"] = received(b, s, 3.0)
        elif straggler == "goes away":
            s.end()
        await answers["b"]
        waited = time.monotonic() - ran_a
        if "s" in answers:
            assert (await answers["s"])["y"].tolist() == [[6.0, 6.0]]
        assert (await answers["b"])["y"].tolist() == [[4.0, 4.0]]
        if straggler == "never comes":
            s.end()
        c.end()
        await b.close()
        return waited, runs

    waited, runs = run(main())
    if straggler == "comes in":
        # not [[1], [2], [3]]: B alone, then S alone
        assert runs == [[1.0], [3.0, 2.0]], runs
    else:
        assert runs == [[1.0], [2.0]], runs
    if straggler == "never comes":
        assert 0.25 <= waited < 1.0, waited
    else:
        # at once, not at the wait's end
        assert waited < 0.2, waited


def sealed_buffer(*states: str, sealed: bool = True):
    """Placements of one buffer whose places are in these states: "ran", "job" (in, not run yet),
    "arriving", "dead" (refused, not run) or "S" (arriving: the one a test looks at)."""
    from serving.placements import DEAD, FILLED, RAN, RESERVED, Placements

    p = Placements(BatchBuffers([X_OF_2_COLUMNS], capacity=8, count=1), 8)
    owner = types.SimpleNamespace(ended=lambda arrival: None)
    places = [p.arriving(owner, rows=1).place for _ in states]
    named = {"ran": RAN, "dead": DEAD, "job": FILLED, "arriving": RESERVED, "S": RESERVED}
    for place, state in zip(places, states):
        place.state = named[state]
        place.job = object() if state == "job" else None
    places[0].group.sealed = sealed
    return p, places


def test_a_place_is_moved_only_when_nothing_left_in_its_buffer_can_run_with_it():
    from serving.placements import _stranded

    def buffer(*states: str, sealed: bool = True):
        places = sealed_buffer(*states, sealed=sealed)[1]
        return places[states.index("S")], places

    assert _stranded(*buffer("ran", "S"))
    assert _stranded(*buffer("S"))
    # the refused places around it run with nothing
    assert _stranded(*buffer("ran", "dead", "S", "dead"))
    # more places may come after it
    assert not _stranded(*buffer("ran", "S", sealed=False))
    # it runs with that one
    assert not _stranded(*buffer("ran", "S", "arriving"))
    # a refused place between is filler in their run
    assert not _stranded(*buffer("job", "dead", "S"))
    assert not _stranded(*buffer("S", "dead", "job"))


def test_the_rest_of_a_buffer_does_not_wait_with_a_full_batch_complete_behind_it(executor):
    """B waits for S (see above) only while the engine has nothing better to run: a full batch
    complete in the next buffer runs after B at once, not after S's wait."""

    async def main():
        b, runs = rest_batcher(executor)
        a, s, b_ = (b.arriving(rows=1) for _ in range(3))
        answers = [received(b, a, 1.0), received(b, b_, 2.0)]
        await answers[0]
        started = time.monotonic()
        full = [b.arriving(rows=1) for _ in range(8)]
        answers += [received(b, x, 5.0) for x in full]
        await asyncio.gather(*answers[1:])
        took = time.monotonic() - started
        s.end()
        await b.close()
        return took, runs

    took, runs = run(main())
    assert runs == [[1.0], [2.0], [5.0] * 8], runs
    assert took < 0.2, took


def test_a_span_waits_only_for_places_still_arriving_next_to_it():
    """Span.arriving: a place still arriving joins a span's run only across dead places; one beyond
    a place that ran never can. A dead place just after one still arriving is not marked run."""
    from serving.placements import DEAD, RAN

    def span(*states: str):
        """The next span of a sealed buffer of these places, and its places."""
        p, places = sealed_buffer(*states)
        return p.next_span(), places

    assert span("ran", "arriving", "job")[0].arriving
    assert span("job", "arriving")[0].arriving
    assert span("arriving", "dead", "job")[0].arriving
    # beyond a place that ran: it can never join
    assert not span("arriving", "ran", "job")[0].arriving
    assert not span("arriving", "ran", "dead", "job", "ran", "arriving")[0].arriving
    assert not span("ran", "job", "dead")[0].arriving
    # the dead place stays a boundary the straggler can cross, not one that ran
    found, places = span("arriving", "dead", "job")
    assert [p.k for p in found.places] == [2] and places[1].state == DEAD
    found, places = span("ran", "dead", "job")
    assert places[1].state == RAN


class HeldCopies(BatchBuffers):
    """Two batch buffers of 8 rows of "x" (2 columns) whose copy of a request `held(feeds)` picks
    waits for `go_on` (`copying` set meanwhile): the moment another loop is in the middle of a copy,
    held open."""

    def __init__(self, held):
        super().__init__([X_OF_2_COLUMNS], capacity=8, count=2)
        self.held, self.copying, self.go_on = held, threading.Event(), threading.Event()

    def put(self, index, start, feeds):
        if self.held(feeds):
            self.copying.set()
            self.go_on.wait(5)
        super().put(index, start, feeds)


@contextlib.contextmanager
def another_loop():
    """An event loop on a thread of its own, as the HTTP front end's other loops are."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def test_close_waits_for_a_request_another_loop_is_copying_into_its_place(executor):
    """A request is copied into its batch buffer place outside the batcher's lock. With several
    event loops, a close (a model unloaded, the server stopping) on one loop came in the middle of
    another's copy, found nothing pending and returned: the buffers were closed under the copy. It
    waits for the request, which is answered."""
    buffers = HeldCopies(held=lambda feeds: True)

    def run_gathered(feeds, rows):
        return {"y": feeds["x"][:rows] * 2}

    async def main(other):
        b = Batcher(
            lambda parts: {},
            executor,
            max_batch_size=8,
            max_delay_ms=0,
            max_queue_rows=64,
            buffers=buffers,
            run_gathered=run_gathered,
        )
        b.start()
        answer = asyncio.run_coroutine_threadsafe(
            b.submit({"x": np.full((2, 2), 3, np.float32)}, 2), other
        )
        await asyncio.to_thread(buffers.copying.wait, 5)
        closing = asyncio.create_task(b.close())
        await asyncio.sleep(0.1)
        closed_mid_copy = closing.done()
        buffers.go_on.set()
        await closing
        return closed_mid_copy, (await asyncio.wrap_future(answer))["y"].tolist()

    with another_loop() as other:
        closed_mid_copy, out = run(main(other))
    assert not closed_mid_copy
    assert out == [[6.0, 6.0], [6.0, 6.0]]


def test_close_waits_for_the_batch_running_when_a_request_being_copied_is_refused(executor):
    """Close came while a batch ran and another loop copied a request in; the copy found a NaN
    (refused). That refusal found nothing left to run and woke close, the batch still running: the
    model would be closed under it."""
    buffers = HeldCopies(held=lambda feeds: np.isnan(feeds["x"]).any())
    running = threading.Event()

    def run_gathered(feeds, rows):
        running.set()
        time.sleep(0.6)
        return {"y": feeds["x"][:rows] * 2}

    async def main(other):
        b = Batcher(
            lambda parts: {},
            executor,
            max_batch_size=8,
            max_delay_ms=0,
            max_queue_rows=64,
            buffers=buffers,
            run_gathered=run_gathered,
        )
        b.start()
        ran = asyncio.create_task(b.submit({"x": np.full((1, 2), 3, np.float32)}, 1))
        await asyncio.to_thread(running.wait, 5)
        refused = asyncio.run_coroutine_threadsafe(
            b.submit({"x": np.full((1, 2), np.nan, np.float32)}, 1), other
        )
        await asyncio.to_thread(buffers.copying.wait, 5)
        closing = asyncio.create_task(b.close())
        await asyncio.sleep(0.05)
        buffers.go_on.set()
        with pytest.raises(NonFinite):
            await asyncio.wrap_future(refused)
        await asyncio.sleep(0.1)
        closed_while_running = closing.done() and not ran.done()
        await closing
        return closed_while_running, (await ran)["y"].tolist()

    with another_loop() as other:
        closed_while_running, out = run(main(other))
    assert not closed_while_running
    assert out == [[6.0, 6.0]]


def test_two_models_on_one_engine_thread_take_turns_so_a_flood_cannot_starve_the_other():
    # Each model's batcher queues at most one run on the shared engine thread, whose queue is FIFO:
    # while model A is flooded, a request to model B waits for at most the one A run ahead of it.
    order: list[str] = []

    def engine(label):
        def run_(parts):
            order.append(label)
            time.sleep(0.01)
            return {"y": concat(parts)["x"]}

        return run_

    async def main():
        executor = Runner()
        waits = []
        flooded = Batcher(
            engine("A"), executor, max_batch_size=1, max_delay_ms=0, max_queue_rows=1000
        )
        probed = Batcher(
            engine("B"),
            executor,
            max_batch_size=1,
            max_delay_ms=0,
            max_queue_rows=1000,
            on_batch=lambda rows_, seconds, queue: waits.extend(queue),
        )
        flooded.start()
        probed.start()
        flood = [asyncio.ensure_future(flooded.submit(rows(i), 1)) for i in range(40)]
        # the flood is running
        await asyncio.sleep(0.05)
        started = time.monotonic()
        await probed.submit(rows(1.0), 1)
        probe_seconds = time.monotonic() - started
        await asyncio.gather(*flood)
        await flooded.close()
        await probed.close()
        executor.shutdown()
        return probe_seconds, waits

    probe_seconds, waits = run(main())
    b = order.index("B")
    assert order[:b].count("A") < 40 and "B" not in order[b + 1 :]
    # A resumes right after
    assert order[b - 1] == "A" and (b + 1 == len(order) or order[b + 1] == "A")
    # one A run ahead (10 ms), not the flood's remaining 300+ ms
    assert probe_seconds < 0.1, probe_seconds
    # its queue time, until the engine thread began its run
    assert len(waits) == 1 and waits[0] < 0.1
