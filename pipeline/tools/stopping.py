"""SIGTERM as a clean exit that never lands in the middle of a write to the tracking store.

torchrun stops the surviving ranks with SIGTERM when one dies; preemption and `docker stop` do the
same. The train stage turns the signal into `SystemExit` so its failure path marks the MLflow run
FAILED. An exception raised at an arbitrary bytecode is dangerous inside MLflow, though: landing in
a SQLAlchemy transaction it left the SQLite store locked, the FAILED status could not be written,
and the run stayed RUNNING (a red CI run). So inside `deferred()` the exit waits for the block to
end.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import sys
import threading

# how many deferred() blocks the main thread is in
_depth = 0
# a signal that arrived inside one
_pending: int | None = None
# Whether a SIGTERM has arrived, ignored or not: a rank waiting to hear why a peer stopped
# (launch.another_rank_said_why) need not wait once torchrun has asked it to stop.
_received = False


def exit_on_sigterm():
    """Installs the handler; returns the previous one, for `signal.signal` to put back."""
    return signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum, _frame) -> None:
    global _pending
    _note_sigterm(signum, _frame)
    # One exit is enough: a second SIGTERM must not cut short the failure path the first one
    # started.
    ignore_sigterm()
    if _depth:
        _pending = signum
        return
    sys.exit(128 + signum)


def ignore_sigterm() -> None:
    """SIGTERM does nothing from here on but say that it came (sigterm_received)."""
    signal.signal(signal.SIGTERM, _note_sigterm)


def _note_sigterm(_signum, _frame) -> None:
    global _received
    _received = True


def sigterm_received() -> bool:
    return _received


@contextlib.contextmanager
def deferred():
    """A SIGTERM arriving inside this block exits when the block ends, not in the middle of it.

    Signals reach the main thread only; in another thread (background uploads) this does nothing."""
    global _depth, _pending
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if not _depth and _pending is not None:
            signum, _pending = _pending, None
            sys.exit(128 + signum)


def uninterrupted(fn):
    """Decorator: the whole call runs inside `deferred()`."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with deferred():
            return fn(*args, **kwargs)

    return wrapper
