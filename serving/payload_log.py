"""The payload log: a sample of requests and their answers, as JSON Lines, in a directory of bounded
size.

Opt-in (`--payload-log DIR`). The request path only decides whether a request is in the sample (a
hash of its id) and hands the record's arrays to a bounded queue without waiting; a full queue drops
the record and counts it. One writer thread turns records into JSON (the costly part, off the event
loop), appends them to DIR/payloads-<UTC time>-<n>.jsonl (one open file per model version, at most
MAX_OPEN_FILES, so that versions answering in turn do not start a file each), starts a new file past
--payload-log-file-mb, and deletes the oldest payload files before a write would take the directory
past --payload-log-max-mb. The directory is made 0700 and the files 0600: they hold what clients
sent. With `mlflow=True`, each file is logged, once closed, as an artifact under `payloads/` of the
training run of the model that answered its requests.

One record per line:
    {"request_id": str, "time": "2025-01-31T12:00:00.123Z" (UTC, when answered),
     "endpoint": "/v2/models/{name}/infer" | "/v2/models/{name}/versions/{version}/infer" | "/invocations",
     "status": 200 | the 4xx/5xx of a request that failed at the model,
     "model": {"name": str, "version": str, "run_id": str | null, "weights_sha256": str | null,
               "onnx_sha256": str, "source": "models:/<registered name>/<version>" | the file or URI served},
     "inputs": {name: {"dtype": numpy dtype name, "shape": [int, ...], "data": nested lists}},
     "outputs": {name: {...the same}} | null (failed), "error": str (only when failed)}

Invariants (kept by the writer thread alone):
- the payload files in DIR (ours, `payloads-*.jsonl`, including those of earlier runs) never add up
  to more than `max_bytes`: the oldest closed ones are deleted before a write that would pass it;
- a file holds the records of one model version only, and is uploaded (mlflow) once, when closed;
- a record of the sample is either written once or counted as dropped (`queue_full`, `too_large`:
  bigger than one file may be, `error`: could not be written, e.g. a full disk). A failed write
  leaves no partial line behind and never stops the writer; failures are logged once per streak, not
  once per record;
- a directory removed while the server runs is noticed at the next write (a file with no link left
  is abandoned), made again and said so in the log.

One directory per server process: another writer's files count against the cap and get deleted.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import queue
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from serving.codec import dumps

log = logging.getLogger("serving.payload_log")

FILE_PATTERN = re.compile(r"^payloads-.+\.jsonl$")
# records waiting for the writer; beyond: dropped
MAX_PENDING_RECORDS = 10_000
# array bytes held by waiting records (the queue's memory); beyond: dropped
MAX_PENDING_BYTES = 64 << 20
# versions written to at once; past it the least recently used file is closed
MAX_OPEN_FILES = 8
# a streak of failed writes is logged at its start, then at most this often
ERROR_REPEAT_S = 60.0
_STOP = object()


class PayloadLogError(Exception):
    """The payload log directory cannot be used (not a directory, not writable)."""


def in_sample(request_id: str, fraction: float) -> bool:
    """Whether `request_id` is in a `fraction` sample: decided by its hash alone, so anyone can tell
    which ids are in (the first 8 hex digits of sha256(id), over 2^32, below `fraction`)."""
    return int(hashlib.sha256(request_id.encode()).hexdigest()[:8], 16) / 2**32 < fraction


def model_summary(info) -> dict:
    """The model as a record names it (a loader.ModelInfo): `pipeline trace` follows its lineage,
    not the served name."""
    return {
        "name": info.name,
        "version": info.version,
        "run_id": info.lineage.get("run_id"),
        "weights_sha256": info.lineage.get("weights_sha256"),
        "onnx_sha256": info.lineage.get("onnx_sha256"),
        "source": info.resolved_source,
    }


@dataclass
class Record:
    """What the request path hands over: references only, nothing serialized yet."""

    request_id: str
    # time.time() when answered
    time: float
    endpoint: str
    status: int
    # name, version, run_id, weights_sha256
    model: dict
    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray] | None
    error: str | None = None

    @property
    def nbytes(self) -> int:
        arrays = [*self.inputs.values(), *(self.outputs or {}).values()]
        return sum(getattr(a, "nbytes", 0) for a in arrays)


class PayloadLog:
    """The sample, the queue and the writer thread. `submit` is called on the event loop; everything
    else that touches files runs in the writer thread (`start` .. `close`)."""

    def __init__(
        self,
        directory: str | Path,
        *,
        sample: float,
        max_bytes: int,
        file_bytes: int,
        mlflow: bool = False,
        max_pending_records: int = MAX_PENDING_RECORDS,
        max_pending_bytes: int = MAX_PENDING_BYTES,
    ):
        if not 0.0 <= sample <= 1.0 or not 0 < file_bytes <= max_bytes:
            raise ValueError(
                f"need 0 <= sample <= 1 and 0 < file_bytes <= max_bytes, got {sample}, {file_bytes}, "
                f"{max_bytes}"
            )
        self.directory = Path(directory)
        self.sample = sample
        self.max_bytes = max_bytes
        self.file_bytes = file_bytes
        self.mlflow = mlflow
        self._queue: queue.Queue = queue.Queue(max_pending_records)
        self._max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0
        # guards _pending_bytes (event loop adds, writer subtracts)
        self._lock = threading.Lock()
        self.written = 0
        self.dropped = {"queue_full": 0, "too_large": 0, "error": 0}
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            probe = self.directory / ".payload-log-probe"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise PayloadLogError(
                f"cannot write the payload log to {self.directory}: {exc}"
            ) from None
        # Files of earlier runs count against the cap (and are deleted first): the names sort by
        # time.
        self._closed: list[tuple[Path, int]] = [
            (p, p.stat().st_size)
            for p in sorted(self.directory.iterdir())
            if FILE_PATTERN.match(p.name) and p.is_file()
        ]
        # in our files in the directory, the open ones included
        self.bytes = sum(size for _, size in self._closed)
        # model version -> its file; least recently written first
        self._open: dict[tuple, _OpenFile] = {}
        # a smaller cap than last time holds from the start
        self._trim(0)
        # writes failed in a row (a full disk, a removed directory that can't be made)
        self._failing = 0
        self._failure_logged = 0.0
        self._sequence = 0
        self._thread: threading.Thread | None = None
        self._mlflow_client = None

    # ---- the request path (event loop) -----------------------------------------------------------

    def sampled(self, request_id: str) -> bool:
        return in_sample(request_id, self.sample)

    def keeps(self, slot, request_id: str) -> bool:
        """An observer of answers (serving/core.py): whether a request's inputs outlive its run."""
        return self.sampled(request_id)

    def answered(self, answer) -> None:
        """An observer of answers: a request of the sample, answered or refused, queued."""
        if self not in answer.keepers:
            return
        self.submit(
            Record(
                answer.request_id,
                time.time(),
                answer.endpoint,
                answer.status,
                model_summary(answer.slot.model.info),
                answer.inputs,
                answer.results,
                answer.error,
            )
        )

    def submit(self, record: Record) -> None:
        """Queue a record for the writer, never waiting: when the queue is full it is dropped and
        counted."""
        size = record.nbytes
        with self._lock:
            if self._pending_bytes + size > self._max_pending_bytes and self._pending_bytes:
                self.dropped["queue_full"] += 1
                return
            self._pending_bytes += size
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            with self._lock:
                self._pending_bytes -= size
                self.dropped["queue_full"] += 1

    def stats(self) -> dict:
        return {"written": self.written, "dropped": dict(self.dropped), "bytes": self.bytes}

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="payload-log", daemon=True)
        self._thread.start()
        log.info(
            "payload log: %.0f%% of requests to %s (at most %d bytes, files of %d)",
            self.sample * 100,
            self.directory,
            self.max_bytes,
            self.file_bytes,
        )

    def close(self, timeout: float = 60.0) -> None:
        """Write what is queued, close (and upload) the open files, stop the thread. Blocks, at most
        about `timeout` seconds: call it off the event loop, after the last request was answered."""
        if self._thread is None:
            return
        deadline = time.monotonic() + timeout
        # waits for room (nothing is dropped at shutdown), but not forever: the writer may be stuck
        try:
            self._queue.put(_STOP, timeout=timeout if self._thread.is_alive() else 0)
        except queue.Full:
            pass
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            log.error(
                "the payload log writer did not finish within %.0f s; its last records may be lost",
                timeout,
            )
        self._thread = None

    # ---- the writer thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                break
            with self._lock:
                self._pending_bytes -= item.nbytes
            try:
                self._write(item)
            except Exception as exc:  # noqa: BLE001
                # the writer outlives every failure: it counts them
                self.dropped["error"] += 1
                self._failed(item, exc)
            else:
                if self._failing:
                    log.warning("payload log: writing again after %d failed records", self._failing)
                    self._failing = 0
        for key in list(self._open):
            try:
                self._close_file(key)
            except Exception:  # noqa: BLE001
                log.exception("cannot close a payload log file in %s", self.directory)

    def _failed(self, record: Record, exc: Exception) -> None:
        """Log a streak of failures at its start and then once a minute, not once per record: a full
        disk fails every record, and a traceback each would flood the server's log."""
        self._failing += 1
        now = time.monotonic()
        if self._failing == 1 or now - self._failure_logged >= ERROR_REPEAT_S:
            self._failure_logged = now
            if isinstance(exc, OSError):
                hint = (
                    " (the disk is full: free space or lower --payload-log-max-mb)"
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT)
                    else ""
                )
                log.error(
                    "cannot write payload record %s to %s: %s%s; %d failed in a row, dropped and counted "
                    '(trainserve_payload_log_dropped_total{reason="error"})',
                    record.request_id,
                    self.directory,
                    exc,
                    hint,
                    self._failing,
                )
            else:
                log.error(
                    "cannot write payload record %s (%d failed in a row)",
                    record.request_id,
                    self._failing,
                    exc_info=exc,
                )

    def _write(self, record: Record) -> None:
        line = dumps(_as_json(record)) + b"\n"
        if len(line) > self.file_bytes:
            self.dropped["too_large"] += 1
            log.warning(
                "payload record %s takes %d bytes, more than a payload file may (%d): not logged",
                record.request_id,
                len(line),
                self.file_bytes,
            )
            return
        self._check_directory()
        key = _model_key(record.model)
        current = self._open.pop(key, None)
        if current is not None:
            # now the most recently written
            self._open[key] = current
            if current.size + len(line) > self.file_bytes:
                self._close_file(key)
                current = None
        # The line's own file plus the line is at most file_bytes <= max_bytes: trimming always
        # makes room.
        self._trim(len(line), keep=key)
        if current is None:
            current = self._open_file(record.model)
        current.append(line)
        self.bytes += len(line)
        self.written += 1

    def _check_directory(self) -> None:
        """Notice a directory (or a file of ours) removed under us: records written to an unlinked
        file are lost when it is closed, so such files are dropped now and the directory is made
        again."""
        gone = [key for key, f in self._open.items() if f.unlinked()]
        if not gone and self.directory.is_dir():
            return
        for key in gone:
            f = self._open.pop(key)
            f.file.close()
            self.bytes -= f.size
        if not self.directory.is_dir():
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._closed = []
            self.bytes = sum(f.size for f in self._open.values())
            log.warning(
                "the payload log directory %s was removed while the server ran: made it again "
                "(the records in the removed files are gone)",
                self.directory,
            )
        elif gone:
            log.warning(
                "%d open payload log file(s) in %s were removed while the server ran: starting new "
                "ones",
                len(gone),
                self.directory,
            )

    def _trim(self, incoming: int, keep: tuple | None = None) -> None:
        """The cap: delete the oldest closed files until `incoming` more bytes fit; when only open
        files are left, close the least recently written other than `keep`'s, so that it can go
        too."""
        while self.bytes + incoming > self.max_bytes:
            if self._closed:
                path, size = self._closed.pop(0)
                try:
                    path.unlink()
                except FileNotFoundError:
                    pass
                self.bytes -= size
            else:
                others = [key for key in self._open if key != keep]
                if not others:
                    return
                self._close_file(others[0])

    def _open_file(self, model: dict) -> "_OpenFile":
        if len(self._open) >= MAX_OPEN_FILES:
            self._close_file(next(iter(self._open)))
        self._sequence += 1
        now = time.time()
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"
        path = self.directory / f"payloads-{stamp}-{self._sequence:06d}.jsonl"
        # 0600 from the start (not chmod after): what clients sent is no other local user's to read.
        fd = os.open(
            path,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | getattr(os, "O_CLOEXEC", 0),
            0o600,
        )
        # closed in _close_file
        opened = _OpenFile(path, open(fd, "wb", buffering=0), model)  # noqa: SIM115
        self._open[_model_key(model)] = opened
        return opened

    def _close_file(self, key: tuple) -> None:
        f = self._open.pop(key, None)
        if f is None:
            return
        f.file.close()
        self._closed.append((f.path, f.size))
        if self.mlflow:
            self._upload(f.path, f.model)

    def _upload(self, path: Path, model: dict) -> None:
        """Log a closed file to the training run of the model that answered its requests; failures
        are logged, never raised (the server goes on, the file stays in the directory)."""
        run_id = model.get("run_id")
        if not run_id:
            log.warning(
                "not logging %s to MLflow: model %s version %s names no training run "
                "(no run_id in its lineage metadata)",
                path.name,
                model.get("name"),
                model.get("version"),
            )
            return
        try:
            if self._mlflow_client is None:
                import mlflow

                self._mlflow_client = mlflow.MlflowClient()
            self._mlflow_client.log_artifact(run_id, str(path), artifact_path="payloads")
            log.info("logged %s to MLflow run %s under payloads/", path.name, run_id)
        except Exception as exc:  # noqa: BLE001
            # MlflowException, connection errors, ...
            log.warning("cannot log %s to MLflow run %s: %s", path.name, run_id, exc)


class _OpenFile:
    """One version's open payload file. Unbuffered: a record is one write, and readers (pipeline
    trace) see it at once."""

    def __init__(self, path: Path, file, model: dict):
        self.path, self.file, self.model, self.size = path, file, model, 0

    def append(self, line: bytes) -> None:
        """Write `line` whole or not at all: a failed or short write (a full disk) is cut back off,
        so that the file holds only complete lines."""
        try:
            written = self.file.write(line)
            if written != len(line):
                raise OSError(errno.ENOSPC, f"only {written} of {len(line)} bytes written")
        except OSError:
            try:
                os.ftruncate(self.file.fileno(), self.size)
            except OSError:
                pass
            raise
        self.size += len(line)

    def unlinked(self) -> bool:
        return os.fstat(self.file.fileno()).st_nlink == 0


def _model_key(model: dict) -> tuple:
    return tuple(sorted(model.items()))


def _as_json(record: Record) -> dict:
    out = {
        "request_id": record.request_id,
        "time": _iso(record.time),
        "endpoint": record.endpoint,
        "status": record.status,
        "model": record.model,
        "inputs": _tensors(record.inputs),
        "outputs": None if record.outputs is None else _tensors(record.outputs),
    }
    if record.error is not None:
        out["error"] = record.error
    return out


def _tensors(arrays: dict[str, np.ndarray]) -> dict:
    return {
        name: {"dtype": a.dtype.name, "shape": list(a.shape), "data": np.ascontiguousarray(a)}
        for name, a in arrays.items()
    }


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"
