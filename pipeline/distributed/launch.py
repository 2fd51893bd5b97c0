"""Launching a stage under torchrun on this machine: torchrun's arguments, and torchrun's agent run
in this process (`run_torchrun`), which returns its exit code. Multi-node jobs start torchrun
themselves (c10d rendezvous); a stage then just runs in each worker.

torchrun's agent runs here rather than in a process of its own because that process would only
import torch again to wait on the workers (a few CPU-seconds a launch). Once the workers start, a
SIGTERM (docker stop, a scheduler) or Ctrl-C reaches the agent's own handlers, which stop the
workers gracefully, each closing its run; before that, this process's own handlers apply. The
handlers the agent installed, the environment and the thread name are put back when it returns.

Bad input met by one rank is said once: the first rank to meet it writes its one line to the
launch's error file (`TRAINSERVE_ERROR_FILE`, made by `run_torchrun`) and prints it; the other
ranks, whose collectives then fail with "Connection closed by peer", find the file and exit quietly
with the same code, and the launch returns it too, without torchrun's report of the failed workers.
Any other failure is reported by torchrun as before.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import signal
import sys
import tempfile
import time

from pipeline.tools import stopping

ERROR_FILE = "TRAINSERVE_ERROR_FILE"
# The exit code of bad input everywhere in the CLI (pipeline/errors.py).
USER_ERROR = 2


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def torchrun_arguments(
    module: str, nproc_per_node: int, max_restarts: int, arguments: list[str]
) -> list[str]:
    """torchrun's arguments for `python -m module arguments...` on this machine (`--standalone`: a
    private rendezvous)."""
    return [
        "--standalone",
        f"--nproc-per-node={nproc_per_node}",
        f"--max-restarts={max_restarts}",
        "-m",
        module,
        *arguments,
    ]


def run_torchrun(argv: list[str]) -> int:
    """torchrun with `argv` (torchrun_arguments), its agent in this process: 0, USER_ERROR when a
    rank met bad input and said so, else 1 (a worker failed, or a signal stopped the workers)."""
    from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler
    from torch.multiprocessing import _get_thread_name, _set_thread_name

    folder = tempfile.mkdtemp(prefix="trainserve-launch-")
    environment = dict(os.environ)
    # The workers inherit this process's environment.
    os.environ.update(torchrun_env(os.path.join(folder, "error")))
    handlers = {sig: signal.getsignal(sig) for sig in signal.valid_signals()}
    thread_name = _get_thread_name()
    try:
        return torchrun(argv)
    finally:
        # Only the agent's handlers (--signals-to-handle): one this process set meanwhile stays.
        for sig, handler in handlers.items():
            if signal.getsignal(sig) is _terminate_process_handler:
                signal.signal(sig, handler)
        _set_thread_name(thread_name)
        # Key by key, not cleared and refilled: another thread may read the environment meanwhile.
        for key in set(os.environ) - set(environment):
            del os.environ[key]
        for key, value in environment.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
        shutil.rmtree(folder, ignore_errors=True)


def torchrun_env(error_file: str) -> dict[str, str]:
    """What torchrun's workers get on top of this process's environment."""
    # torchrun sets OMP_NUM_THREADS=1 with a warning; each rank sets its threads itself anyway.
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), ERROR_FILE: error_file}


def _attempt_file() -> str | None:
    """This attempt's error file: a torchrun restart (--max-restarts) starts with none said."""
    path = os.environ.get(ERROR_FILE)
    return f"{path}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}" if path else None


def say_error(line: str) -> None:
    """Prints a rank's line about bad input (its exit code is USER_ERROR), once for the whole
    launch: under `run_torchrun` only the first rank of an attempt to claim the error file prints;
    elsewhere every rank does."""
    path = _attempt_file()
    if path:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return
        except OSError:
            # the launcher's folder is gone or unwritable: say it anyway
            fd = None
        if fd is not None:
            with os.fdopen(fd, "w") as out:
                out.write(line + "\n")
    print(line, file=sys.stderr, flush=True)


def another_rank_said_why(wait: float = 10.0) -> bool:
    """Whether another rank of this launch has said why it stopped (say_error). A rank asks when its
    own collective failed: the rank that met bad input leaves the process group before it says so,
    so the answer may take a moment to appear. Not after torchrun's SIGTERM, though: torchrun
    stops the other ranks once one has exited, and a rank says why before it exits."""
    path = _attempt_file()
    if not path:
        return False
    deadline = time.monotonic() + wait
    while not os.path.exists(path):
        if time.monotonic() > deadline or stopping.sigterm_received():
            return os.path.exists(path)
        time.sleep(0.05)
    return True


class _QuietOnceSaid(logging.Filter):
    """Drops torchrun's log records once a rank has said why it stopped ("Sending process ...
    closing signal SIGTERM", "failed (exitcode: 2)"): they repeat what that line said, in torchrun's
    terms."""

    def __init__(self, path: str | None):
        super().__init__()
        self.path = path

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.said()

    def said(self) -> bool:
        """Whether a rank of any attempt said why it stopped."""
        return bool(self.path and glob.glob(glob.escape(self.path) + ".*"))


def torchrun(argv: list[str]) -> int:
    """torchrun (`torch.distributed.run`) with `argv`: 0, USER_ERROR without torchrun's report of
    the failed workers when a rank said why it stopped, else 1 with torchrun's report (or, for a
    failure of the agent itself, one line)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    quiet = _QuietOnceSaid(os.environ.get(ERROR_FILE))
    handlers = [
        handler
        for name in ("", "torch", "torch.distributed")
        for handler in logging.getLogger(name).handlers
    ]
    for handler in handlers:
        handler.addFilter(quiet)
    try:
        run(parse_args(argv))
    except ChildFailedError as failed:
        if quiet.said():
            return USER_ERROR
        print(f"torchrun: {failed}", file=sys.stderr, flush=True)
        return 1
    except (Exception, KeyboardInterrupt) as exc:
        # A signal (the agent has stopped the workers), an early Ctrl-C or the agent's own failure:
        # one line, and the launcher goes on to close a run left RUNNING.
        print(f"torchrun: {_why_stopped(exc)}", file=sys.stderr, flush=True)
        return 1
    finally:
        for handler in handlers:
            handler.removeFilter(quiet)
    return 0


def _why_stopped(exc: BaseException) -> str:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    if isinstance(exc, SignalException):
        # SIGTERM to the workers, then SIGKILL after the agent's grace period
        return f"stopped the workers on {exc.sigval.name}"
    if isinstance(exc, KeyboardInterrupt):
        # before the agent took SIGINT over: no worker had started
        return "interrupted before the workers started"
    # the rendezvous, a worker group in a bad state
    return f"{type(exc).__name__}: {exc}"
