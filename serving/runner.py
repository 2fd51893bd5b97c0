"""The thread that runs every model run (and every other engine task) of a server, one at a time, in
turn.

Why a thread of its own that *pulls* its work: a batch is formed the moment the engine can run it,
not earlier, and the engine never waits for an event loop to hand it the next one. An event loop
busy taking requests in (a large body costs it time in the kernel alone:
docs/benchmarks.md#servingrunnerpy) would otherwise leave the GPU idle between batches; and requests
that arrive while a run is under way all join the next batch.

    Runner.ready(batcher)   a batcher has queued work: it takes its turn (once, however often it is
                            told)
    Runner.submit(fn, ...)  any other engine task (a warm-up run, a load's first run): a turn of its
                            own; `Runner` is a concurrent.futures.Executor, so
                            `loop.run_in_executor(runner, fn)` works

Turns are first come, first served: a batcher runs one batch per turn and queues again behind the
others if it has more, so models flooded with requests take every other run, never all of them (a
request to a quiet model waits for at most the run in progress and one run of each other model ahead
of it).

A watchdog thread fails a run that takes longer than its batcher's `run_timeout` (the batcher's
requests get RunTimedOut, it reports `stalled` until the run returns: the engine thread is still
inside it). Should the thread itself die (nothing a run raises does that: only a BaseException such
as an async SystemExit), every batcher's waiting requests fail with BatcherClosed and `alive` turns
False: the server reports not ready.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import threading
import time
from concurrent.futures import Executor, Future
from typing import Any, Callable

log = logging.getLogger("serving.runner")
# the watchdog's longest look interval
WATCH_S = 1.0


class Runner(Executor):
    """One engine thread. Items in its FIFO are batchers (which take their batch when their turn
    comes) and tasks (callables with a Future)."""

    def __init__(self, name: str = "engine"):
        self._cv = threading.Condition()
        # batchers and _Task, in turn
        self._ready: collections.deque = collections.deque()
        # id() of the batchers in _ready: each in it at most once
        self._queued: set[int] = set()
        # (when, tie-break, batcher): re-queued then (max delay)
        self._timers: list[tuple[float, int, Any]] = []
        self._tie = itertools.count()
        self._stopping = False
        # every batcher that used this runner: failed together if the thread dies
        self._batchers: set = set()
        # the batch in progress (batcher.Run), for the watchdog
        self.running: Any = None
        self._thread = threading.Thread(target=self._main, name=f"{name}_0", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name=f"{name}-watchdog", daemon=True)
        self._watch_cv = threading.Condition()
        # how often the watchdog looks: a quarter of the shortest run_timeout
        self._watch_s = WATCH_S
        self._thread.start()
        self._watchdog.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- what the rest of the server calls ----

    def ready(self, batcher) -> None:
        """`batcher` has queued work: give it a turn (a no-op if it already has one coming)."""
        with self._cv:
            if id(batcher) not in self._queued:
                self._queued.add(id(batcher))
                self._ready.append(batcher)
                if batcher not in self._batchers:
                    self._batchers.add(batcher)
                    if batcher.run_timeout and batcher.run_timeout / 4 < self._watch_s:
                        self._watch_s = max(batcher.run_timeout / 4, 0.005)
                        # its wait so far may be a longer one
                        with self._watch_cv:
                            self._watch_cv.notify()
                self._cv.notify()

    def ready_at(self, batcher, when: float) -> None:
        """Give `batcher` a turn at time.monotonic() `when` (a partial batch waiting out
        --max-delay-ms)."""
        with self._cv:
            sooner = not self._timers or when < self._timers[0][0]
            heapq.heappush(self._timers, (when, next(self._tie), batcher))
            # (else the engine thread wakes before it anyway, and looks again then)
            if sooner:
                self._cv.notify()

    def submit(self, fn: Callable, /, *args, **kwargs) -> Future:
        future: Future = Future()
        with self._cv:
            if self._stopping or not self._thread.is_alive():
                raise RuntimeError("the engine thread has stopped")
            self._ready.append(_Task(future, fn, args, kwargs))
            self._cv.notify()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No new tasks; what is queued still runs. With `wait`, returns once the thread has
        ended."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        with self._watch_cv:
            self._watch_cv.notify()
        if wait and self._thread is not threading.current_thread():
            self._thread.join()

    def began(self, run) -> None:
        """A batch run starts (on the engine thread): the watchdog times it."""
        self.running = run

    def ended(self) -> None:
        self.running = None

    # ---- the engine thread ----

    def _next(self):
        with self._cv:
            while True:
                now = time.monotonic()
                while self._timers and self._timers[0][0] <= now:
                    _, _, batcher = heapq.heappop(self._timers)
                    if id(batcher) not in self._queued:
                        self._queued.add(id(batcher))
                        self._ready.append(batcher)
                if self._ready:
                    item = self._ready.popleft()
                    if not isinstance(item, _Task):
                        self._queued.discard(id(item))
                    return item
                if self._stopping:
                    return None
                self._cv.wait(self._timers[0][0] - now if self._timers else None)

    def _main(self) -> None:
        try:
            while (item := self._next()) is not None:
                if isinstance(item, _Task):
                    item.run()
                else:
                    try:
                        item.serve(self)
                    except Exception:  # noqa: BLE001
                        # a bug in serving one batch must not end the thread
                        log.exception("serving a batch failed")
        except BaseException as exc:  # noqa: BLE001
            # the thread is being killed: nothing will run the queued work
            log.error(
                "the engine thread has died (%r); failing every waiting request, reporting not ready",
                exc,
            )
            with self._cv:
                batchers, self._batchers = list(self._batchers), set()
                tasks = [t for t in self._ready if isinstance(t, _Task)]
                self._ready.clear()
            for batcher in batchers:
                batcher.runner_died()
            for task in tasks:
                task.future.set_exception(RuntimeError("the engine thread has died"))

    def _watch(self) -> None:
        """Fails a run past its batcher's run_timeout (see the module's docstring). It looks every
        quarter of the shortest run_timeout (at most every WATCH_S) rather than being told of each
        run: two thread switches per batch cost more than all the looking."""
        while True:
            with self._watch_cv:
                if self._stopping:
                    return
                self._watch_cv.wait(self._watch_s)
            run = self.running
            if (
                run is not None
                and run.timeout is not None
                and not run.expired
                and time.monotonic() - run.started > run.timeout
            ):
                run.timed_out()


class _Task:
    __slots__ = ("future", "fn", "args", "kwargs")

    def __init__(self, future: Future, fn: Callable, args: tuple, kwargs: dict):
        self.future, self.fn, self.args, self.kwargs = future, fn, args, kwargs

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            result = self.fn(*self.args, **self.kwargs)
        except BaseException as exc:  # noqa: BLE001
            # handed to whoever waits on the future
            self.future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        else:
            self.future.set_result(result)
