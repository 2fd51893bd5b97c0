"""Launching a stage under torchrun on this machine: the command, its environment, and a launcher
that passes a SIGTERM on to torchrun (so the workers stop gracefully) and returns torchrun's exit
code. Multi-node jobs start torchrun themselves (c10d rendezvous); a stage then just runs in each
worker.

Bad input met by one rank is said once: the first rank to meet it writes its one line to the
launch's error file (`TRAINSERVE_ERROR_FILE`, made by `run_torchrun`) and prints it; the other
ranks, whose collectives then fail with "Connection closed by peer", find the file and exit quietly
with the same code, and torchrun, run through this module (`python -m pipeline.distributed.launch`),
exits with it too, without its report of the failed workers. Any other failure is reported by
torchrun as before.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ERROR_FILE = "TRAINSERVE_ERROR_FILE"
# The exit code of bad input everywhere in the CLI (pipeline/errors.py).
USER_ERROR = 2


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def torchrun_command(
    module: str, nproc_per_node: int, max_restarts: int, arguments: list[str]
) -> list[str]:
    """`python -m module arguments...` under torchrun on this machine (`--standalone`: a private
    rendezvous), torchrun itself run through this module's `torchrun()`."""
    return [
        sys.executable,
        "-m",
        "pipeline.distributed.launch",
        "--standalone",
        f"--nproc-per-node={nproc_per_node}",
        f"--max-restarts={max_restarts}",
        "-m",
        module,
        *arguments,
    ]


def torchrun_env(error_file: str | None = None) -> dict[str, str]:
    # torchrun sets OMP_NUM_THREADS=1 with a warning; each rank sets its threads itself anyway.
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if error_file:
        env[ERROR_FILE] = error_file
    return env


def run_torchrun(cmd: list[str]) -> int:
    """torchrun's exit code (USER_ERROR when a rank met bad input and said so). docker stop / a
    scheduler's SIGTERM reaches only this launcher: it is passed on, so torchrun stops the workers
    gracefully (each closes its run) rather than losing them with us."""
    folder = tempfile.mkdtemp(prefix="trainserve-launch-")
    try:
        torchrun = subprocess.Popen(cmd, env=torchrun_env(os.path.join(folder, "error")))
        previous = signal.signal(signal.SIGTERM, lambda *_: torchrun.send_signal(signal.SIGTERM))
        try:
            return torchrun.wait()
        except KeyboardInterrupt:
            # Ctrl-C reached torchrun too (same process group): let it finish
            return torchrun.wait()
        finally:
            signal.signal(signal.SIGTERM, previous)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


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
    so the answer may take a moment to appear."""
    path = _attempt_file()
    if not path:
        return False
    deadline = time.monotonic() + wait
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
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
    """torchrun (`torch.distributed.run`) with `argv`, returning USER_ERROR without its report of
    the failed workers when a rank said why it stopped; any other failure is raised as torchrun
    raises it."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    quiet = _QuietOnceSaid(os.environ.get(ERROR_FILE))
    for name in ("", "torch", "torch.distributed"):
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(quiet)
    try:
        run(parse_args(argv))
    except ChildFailedError:
        if quiet.said():
            return USER_ERROR
        raise
    return 0


if __name__ == "__main__":
    sys.exit(torchrun(sys.argv[1:]))
