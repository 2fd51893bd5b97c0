"""Who owns a run directory (`outputs/<run name>/`), and whether a process that said it owned
something is still alive.

One process owns a run directory at a time. `claim(run_dir)` takes an exclusive flock on
`<run_dir>/.owner`, held until the process exits however it exits (the kernel drops it), and writes
who holds it: host, pid, the process's start time (a reused pid is not the same process), command.
A second claimant gets RunDirBusy naming the owner, unless the owner is one of its own ancestors:
`pipeline run` and `pipeline train --nproc-per-node` claim before they spawn torchrun, and rank 0
claims again under them (under a plain torchrun, rank 0's claim is the only one).

Two runs started in the same second once shared one directory and deleted each other's checkpoints;
now the second stops, and default run names carry a random suffix besides.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
from pathlib import Path

OWNER_FILE = ".owner"
_held: dict[Path, int] = {}  # run directory -> the open, locked file descriptor of its .owner


class RunDirBusy(RuntimeError):
    """Another live process owns the run directory; the message names it."""


def this_process() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": process_start(os.getpid()),
            "command": _command()}


def _command() -> str:
    """What a user would recognize: `pipeline train --config ...`, `pipeline.train ...` for a torchrun rank."""
    script = Path(sys.argv[0])
    name = script.name
    if script.parent.name == "pipeline":
        name = "pipeline" if script.stem == "__main__" else f"pipeline.{script.stem}"
    return " ".join([name, *sys.argv[1:]])[:300]


def process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a live pid from a reused one."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[19]
    except (OSError, IndexError):
        return None


def alive(owner: dict) -> bool | None:
    """True/False for an owner on this host; None for another host (nothing can be told from here)."""
    if owner.get("host") != socket.gethostname():
        return None
    pid = owner.get("pid")
    if not isinstance(pid, int):
        return False
    started = process_start(pid)
    if started is None:
        if not pid_alive(pid):
            return False
        return owner.get("started") is None  # no /proc: trust a live pid only when no start time was recorded
    return owner.get("started") in (None, started)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe(owner: dict | None) -> str:
    if not owner:
        return "another process (it left no owner record)"
    return f"pid {owner.get('pid')} on {owner.get('host')} ({owner.get('command', '?')})"


def claim(run_dir: Path) -> dict | None:
    """Owns `run_dir` for the rest of this process; returns the previous owner's record (a process that
    is gone, or None if there was none). RunDirBusy if a live process that is not an ancestor owns it."""
    run_dir = Path(run_dir)
    key = run_dir.resolve()
    if key in _held:
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / OWNER_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = _read(path)
        os.close(fd)
        if owner and owner.get("host") == socket.gethostname() and owner.get("pid") in _ancestors():
            return None  # the launcher that spawned this process owns it for us
        raise RunDirBusy(f"{run_dir} is in use by {describe(owner)}: wait for it to finish or stop it, or give this "
                         "run another train.run_name") from None
    previous = _read(path)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(this_process()).encode(), 0)
    os.fsync(fd)
    _held[key] = fd
    return previous


def claim_for_output(out_dir: Path) -> None:
    """A stage writing into a run directory (`<run_dir>/consolidated`, `<run_dir>/onnx`) owns it while it writes,
    as train and run do: RunDirBusy if a live process owns it. A run directory is one with an owner record
    (every training run leaves one); an output anywhere else is nobody's to claim."""
    run_dir = Path(out_dir).parent
    if (run_dir / OWNER_FILE).exists():
        claim(run_dir)


def owner_of(run_dir: Path) -> dict | None:
    """The live owner of `run_dir` (its record), or None when no process holds it."""
    path = Path(run_dir) / OWNER_FILE
    if not path.exists() or Path(run_dir).resolve() in _held:
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read(path) or {}
    finally:
        os.close(fd)
    return None


def _read(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_text() or "null")
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _ancestors() -> set[int]:
    pids, pid = set(), os.getppid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            pid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        except (OSError, StopIteration, ValueError):
            break
    return pids
