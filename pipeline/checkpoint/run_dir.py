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

On an object store (a run directory at s3://..., see object_store.py) there is no flock, and the
owner may be on any host: `<run>/.owner` is a lease. It is created with a conditional PUT
(If-None-Match: *), so of two claimants exactly one creates it; it records the job (torchrun's
TORCHELASTIC_RUN_ID, the same across the elastic restarts of one job, on whichever host its rank 0
lands), host, pid and a heartbeat time, which a thread of the owner refreshes every HEARTBEAT_S
seconds. A claimant finding a record takes it over (a conditional PUT with If-Match on the ETag it
read, so of two takers one wins) only when the record is of its own job (an elastic restart), of a
process on this host that is gone, or stale (not written for LEASE_S: a job killed outright on
another host). Staleness is judged by the store's clock alone (its Date header minus the record's
LastModified), never by the heartbeat time the holder wrote: two hosts whose clocks disagree by more
than the lease would otherwise take a live job's record (a clock behind) or wait on a dead one (a
clock ahead). Any other claimant gets RunDirBusy naming the owner. The owner deletes the record when
it is done, with a conditional delete (If-Match: its own last ETag), so a record another job has
taken over meanwhile stays. Each lease writes a random nonce of its own into the record: a write the
store applied but answered with an error (botocore's retry then meets the new ETag and gets 412, or
finds the created record there) is told from a take-over by it, and its ETag adopted.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
from pathlib import Path

import pipeline.checkpoint.object_store as object_store
from pipeline.tools import logs

log = logging.getLogger(__name__)

OWNER_FILE = ".owner"
# how often the owner of a run directory on an object store refreshes its record
HEARTBEAT_S = 10.0
# a record not refreshed for this long belongs to a job that is gone
LEASE_S = 60.0
# run directory -> the open, locked file descriptor of its .owner
_held: dict[Path, int] = {}
# run directory on an object store -> the heartbeat keeping its record
_leases: dict[str, "_Lease"] = {}


class RunDirBusy(RuntimeError):
    """Another live process owns the run directory; the message names it."""


def this_process() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": process_start(os.getpid()),
        "command": _command(),
    }


def _command() -> str:
    """What a user would recognize: `pipeline train --config ...`, `pipeline.train ...` for a
    torchrun rank."""
    script = Path(sys.argv[0])
    name = script.name
    if script.parent.name == "pipeline":
        name = "pipeline" if script.stem == "__main__" else f"pipeline.{script.stem}"
    return " ".join([name, *sys.argv[1:]])[:300]


def process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a live pid from a reused
    one."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[19]
    except (OSError, IndexError):
        return None


def alive(owner: dict) -> bool | None:
    """True/False for an owner on this host; None for another host (nothing can be told from
    here)."""
    if owner.get("host") != socket.gethostname():
        return None
    pid = owner.get("pid")
    if not isinstance(pid, int):
        return False
    started = process_start(pid)
    if started is None:
        if not pid_alive(pid):
            return False
        # no /proc: trust a live pid only when no start time was recorded
        return owner.get("started") is None
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
    """Owns `run_dir` for the rest of this process; returns the previous owner's record (a process
    that is gone, or None if there was none). RunDirBusy if a live process that is not an ancestor
    owns it."""
    if object_store.is_url(run_dir):
        return _claim_on_store(object_store.StoreUrl(run_dir))
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
            # the launcher that spawned this process owns it for us
            return None
        raise RunDirBusy(
            f"{run_dir} is in use by {describe(owner)}: wait for it to finish or stop it, or give this "
            "run another train.run_name"
        ) from None
    previous = _read(path)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(this_process()).encode(), 0)
    os.fsync(fd)
    _held[key] = fd
    return previous


def claim_for_output(out_dir: Path) -> None:
    """A stage writing into a run directory (`<run_dir>/consolidated`, `<run_dir>/onnx`) owns it
    while it writes, as train and run do: RunDirBusy if a live process owns it. A run directory is
    one with an owner record (every training run leaves one); an output anywhere else is nobody's to
    claim."""
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
            pid = int(
                next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:"))
            )
        except (OSError, StopIteration, ValueError):
            break
    return pids


# --- on an object store: a lease ------------------------------------------------------------------


def job_id() -> str | None:
    """torchrun's run id (--rdzv-id; standalone: one per launch), the same across its elastic
    restarts."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return run_id if run_id and run_id != "none" else None


def _claim_on_store(run_dir: object_store.StoreUrl) -> dict | None:
    if run_dir in _leases:
        return None
    record = run_dir / OWNER_FILE
    # this lease's own: a record holding it is ours, whatever the store answered
    nonce = secrets.token_hex(8)
    # a lost race with another claimant: look again
    for _ in range(5):
        mine = {**this_process(), "job": job_id(), "heartbeat": time.time(), "lease": nonce}
        try:
            answer = object_store.write_bytes(record, json.dumps(mine).encode(), mode="create")
            _leases[run_dir] = _Lease(record, answer, nonce)
            return None
        except FileExistsError:
            pass
        except OSError as exc:
            # AWS answers two creates racing with 409 ConditionalRequestConflict: look again
            log.warning("claiming %s: %s; trying again", record, exc)
            time.sleep(0.5)
            continue
        written = object_store.last_written(record)
        try:
            owner = json.loads(object_store.read_bytes(record)) if written else None
        except FileNotFoundError:
            owner = None
        except ValueError:
            owner = {}
        if owner is None:
            # released meanwhile
            continue
        tag, age = written
        # our own create: the store applied it, then answered an error (its retry
        if owner.get("lease") == nonce:
            # found the record there): ours
            _leases[run_dir] = _Lease(record, {"ETag": tag}, nonce)
            return None
        why = _why_take_over(owner, age)
        if why is None:
            raise RunDirBusy(
                f"{run_dir} is in use by job {owner.get('job') or '?'}: {describe(owner)}, alive "
                f"{age:.0f} s ago (its record {record} is refreshed every {HEARTBEAT_S:g} s and taken "
                f"as stale after {LEASE_S:g} s): wait for it to finish or stop it, or give this run "
                "another train.run_name"
            )
        try:
            answer = object_store.write_bytes(record, json.dumps(mine).encode(), IfMatch=tag)
        except OSError:
            # 412: another claimant took it over between our read and our write
            continue
        log.warning("taking over %s from %s: %s", run_dir, describe(owner), why)
        _leases[run_dir] = _Lease(record, answer, nonce)
        return owner
    raise RunDirBusy(
        f"{run_dir}: its owner record {record} keeps changing under other claimants; another job is "
        "starting there: wait for it, or give this run another train.run_name"
    )


def _why_take_over(owner: dict, age: float) -> str | None:
    """Why `owner`'s record, last written `age` seconds ago by the store's clock, may be taken over,
    or None when a live job of another owner holds it."""
    if owner.get("job") and owner.get("job") == job_id():
        return f"a restart of the same job ({owner['job']})"
    if owner.get("host") == socket.gethostname() and alive(owner) is False:
        return "its process is gone"
    if age > LEASE_S:
        return f"not refreshed for {age:.0f} s (more than {LEASE_S:g} s, by the store's clock)"
    return None


class _Lease:
    """Refreshes this process's owner record (If-Match: our own last ETag) until released. A write
    the store applied but answered with an error (its retry then meets our own new ETag: 412) is
    told from a take-over by the record's nonce: still ours, its ETag is adopted."""

    def __init__(self, record: object_store.StoreUrl, answer, nonce: str):
        self.record, self.etag, self.nonce = record, (answer or {}).get("ETag"), nonce
        # the last write of our record that the store took
        self.refreshed = time.monotonic()
        # the holder that took the record over
        self.lost_to: dict | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="run-dir-lease", daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        while not self.stop.wait(HEARTBEAT_S):
            mine = {
                **this_process(),
                "job": job_id(),
                "heartbeat": time.time(),
                "lease": self.nonce,
            }
            try:
                answer = object_store.write_bytes(
                    self.record, json.dumps(mine).encode(), IfMatch=self.etag
                )
                self.etag = (answer or {}).get("ETag")
                self.refreshed = time.monotonic()
            except OSError as exc:
                # taken over (a 412), or the store is away for a moment
                try:
                    written = object_store.last_written(self.record)
                    holder = json.loads(object_store.read_bytes(self.record))
                except (OSError, ValueError):
                    written, holder = None, None
                if holder and written and holder.get("lease") == self.nonce:
                    log.info(
                        "the store took this job's heartbeat of %s but answered %s: still ours, going on",
                        self.record,
                        logs.first_line(exc),
                    )
                    self.etag, self.refreshed = written[0], time.monotonic() - written[1]
                    continue
                if holder and (holder.get("host"), holder.get("pid")) != (
                    mine["host"],
                    mine["pid"],
                ):
                    log.error(
                        "the run directory %s was taken over by %s: this process no longer owns it",
                        self.record.parent,
                        describe(holder),
                    )
                    self.lost_to = holder
                    return
                log.warning(
                    "could not refresh the owner record %s (will retry): %s", self.record, exc
                )

    def check(self) -> None:
        """Raises RunDirBusy unless this process still owns the run directory: taken over, or not
        refreshed for so long that another job may take it over (LEASE_S) before this write is done.
        Two owners would delete each other's checkpoints (pruning, clearing marker-less steps): the
        one that lost stops instead."""
        run_dir = self.record.parent
        if self.lost_to is not None:
            raise RunDirBusy(
                f"{run_dir} was taken over by job {self.lost_to.get('job') or '?'} "
                f"({describe(self.lost_to)}): this job no longer owns it and stops writing there"
            )
        silent = time.monotonic() - self.refreshed
        if silent > LEASE_S - HEARTBEAT_S:
            raise RunDirBusy(
                f"{run_dir}: this job's owner record {self.record} could not be refreshed for "
                f"{silent:.0f} s (another job may take a record over after {LEASE_S:g} s): stopping "
                "rather than risk two jobs writing one run; resume it once the store answers again"
            )

    def release(self) -> None:
        self.stop.set()
        self.thread.join()
        try:
            # still ours: nobody took it over
            if self.etag:
                object_store.remove_if_unchanged(self.record, self.etag)
        except OSError as exc:
            log.warning("could not remove the owner record %s: %s", self.record, exc)


def check_still_owned(run_dir) -> None:
    """Before this process changes a run directory on an object store (a save, its publish,
    pruning): raises RunDirBusy when its lease was lost (see _Lease.check). Nothing to check for a
    local flock or no lease."""
    lease = _leases.get(str(run_dir))
    if lease is not None:
        lease.check()


def release(run_dir) -> None:
    """Ends this process's lease on a run directory on an object store (a local flock ends with the
    process)."""
    lease = _leases.pop(str(run_dir), None)
    if lease is not None:
        lease.release()
