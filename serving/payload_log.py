"""The payload log: a sample of requests and their answers, as JSON Lines, in a directory of bounded size.

Opt-in (`--payload-log DIR`). The request path only decides whether a request is in the sample (a hash
of its id) and hands the record's arrays to a bounded queue without waiting; a full queue drops the
record and counts it. One writer thread turns records into JSON (the costly part, off the event loop),
appends them to DIR/payloads-<UTC time>-<n>.jsonl, starts a new file past --payload-log-file-mb or when
another model version answers, and deletes the oldest payload files before a write would take the
directory past --payload-log-max-mb. With `mlflow=True`, each file is logged, once closed, as an
artifact under `payloads/` of the training run of the model that answered its requests.

One record per line:
    {"request_id": str, "time": "2025-01-31T12:00:00.123Z" (UTC, when answered),
     "endpoint": "/v2/models/{name}/infer" | "/v2/models/{name}/versions/{version}/infer" | "/invocations",
     "status": 200 | the 4xx/5xx of a request that failed at the model,
     "model": {"name": str, "version": str, "run_id": str | null, "weights_sha256": str | null},
     "inputs": {name: {"dtype": numpy dtype name, "shape": [int, ...], "data": nested lists}},
     "outputs": {name: {...the same}} | null (failed), "error": str (only when failed)}

Invariants (kept by the writer thread alone):
- the payload files in DIR (ours, `payloads-*.jsonl`, including those of earlier runs) never add up to
  more than `max_bytes`: the oldest closed ones are deleted before a write that would pass it;
- a file holds the records of one model version only, and is uploaded (mlflow) once, when closed;
- a record of the sample is either written once or counted as dropped (`queue_full`, `too_large`: bigger
  than one file may be, `error`: could not be written).

One directory per server process: another writer's files count against the cap and get deleted.
"""

from __future__ import annotations

import hashlib
import logging
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
MAX_PENDING_RECORDS = 10_000  # records waiting for the writer; beyond: dropped
MAX_PENDING_BYTES = 64 << 20  # array bytes held by waiting records (the queue's memory); beyond: dropped
_STOP = object()


class PayloadLogError(Exception):
    """The payload log directory cannot be used (not a directory, not writable)."""


def in_sample(request_id: str, fraction: float) -> bool:
    """Whether `request_id` is in a `fraction` sample: decided by its hash alone, so anyone can tell which
    ids are in (the first 8 hex digits of sha256(id), over 2^32, below `fraction`)."""
    return int(hashlib.sha256(request_id.encode()).hexdigest()[:8], 16) / 2 ** 32 < fraction


@dataclass
class Record:
    """What the request path hands over: references only, nothing serialized yet."""
    request_id: str
    time: float  # time.time() when answered
    endpoint: str
    status: int
    model: dict  # name, version, run_id, weights_sha256
    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray] | None
    error: str | None = None

    @property
    def nbytes(self) -> int:
        arrays = [*self.inputs.values(), *(self.outputs or {}).values()]
        return sum(getattr(a, "nbytes", 0) for a in arrays)


class PayloadLog:
    """The sample, the queue and the writer thread. `submit` is called on the event loop; everything else
    that touches files runs in the writer thread (`start` .. `close`)."""

    def __init__(self, directory: str | Path, *, sample: float, max_bytes: int, file_bytes: int,
                 mlflow: bool = False, max_pending_records: int = MAX_PENDING_RECORDS,
                 max_pending_bytes: int = MAX_PENDING_BYTES):
        if not 0.0 <= sample <= 1.0 or not 0 < file_bytes <= max_bytes:
            raise ValueError(f"need 0 <= sample <= 1 and 0 < file_bytes <= max_bytes, got {sample}, {file_bytes}, "
                             f"{max_bytes}")
        self.directory = Path(directory)
        self.sample = sample
        self.max_bytes = max_bytes
        self.file_bytes = file_bytes
        self.mlflow = mlflow
        self._queue: queue.Queue = queue.Queue(max_pending_records)
        self._max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0
        self._lock = threading.Lock()  # guards _pending_bytes (event loop adds, writer subtracts)
        self.written = 0
        self.dropped = {"queue_full": 0, "too_large": 0, "error": 0}
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / ".payload-log-probe"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise PayloadLogError(f"cannot write the payload log to {self.directory}: {exc}") from None
        # Files of earlier runs count against the cap (and are deleted first): the names sort by time.
        self._closed: list[tuple[Path, int]] = [(p, p.stat().st_size) for p in sorted(self.directory.iterdir())
                                                if FILE_PATTERN.match(p.name) and p.is_file()]
        self.bytes = sum(size for _, size in self._closed)  # in our files in the directory, the open one included
        self._trim(0)  # a smaller cap than last time holds from the start
        self._file = None
        self._file_path: Path | None = None
        self._file_size = 0
        self._file_model: dict | None = None
        self._sequence = 0
        self._thread: threading.Thread | None = None
        self._mlflow_client = None

    # ---- the request path (event loop) -----------------------------------------------------------

    def sampled(self, request_id: str) -> bool:
        return in_sample(request_id, self.sample)

    def submit(self, record: Record) -> None:
        """Queue a record for the writer, never waiting: when the queue is full it is dropped and counted."""
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

    def close(self, timeout: float = 60.0) -> None:
        """Write what is queued, close (and upload) the last file, stop the thread. Blocks: call it off the
        event loop, after the last request was answered."""
        if self._thread is None:
            return
        self._queue.put(_STOP)  # waits for room: nothing is dropped at shutdown
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("the payload log writer did not finish within %.0f s; its last records may be lost", timeout)
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
            except Exception:
                self.dropped["error"] += 1
                log.exception("cannot write payload record %s", item.request_id)
            if self._queue.empty() and self._file is not None:
                self._file.flush()  # readers (pipeline trace) see records once the writer is idle
        try:
            self._close_file()
        except Exception:
            log.exception("cannot close the payload log file %s", self._file_path)

    def _write(self, record: Record) -> None:
        line = dumps(_as_json(record)) + b"\n"
        if len(line) > self.file_bytes:
            self.dropped["too_large"] += 1
            log.warning("payload record %s takes %d bytes, more than a payload file may (%d): not logged",
                        record.request_id, len(line), self.file_bytes)
            return
        if self._file is not None and (self._file_size + len(line) > self.file_bytes
                                       or self._file_model != record.model):
            self._close_file()
        # The open file alone plus the line is at most file_bytes <= max_bytes: trimming always makes room.
        self._trim(len(line))
        if self._file is None:
            self._open_file(record.model)
        self._file.write(line)
        self._file_size += len(line)
        self.bytes += len(line)
        self.written += 1

    def _trim(self, incoming: int) -> None:
        """The cap: delete the oldest closed files until `incoming` more bytes fit."""
        while self.bytes + incoming > self.max_bytes and self._closed:
            path, size = self._closed.pop(0)
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            self.bytes -= size

    def _open_file(self, model: dict) -> None:
        self._sequence += 1
        now = time.time()
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"
        self._file_path = self.directory / f"payloads-{stamp}-{self._sequence:06d}.jsonl"
        self._file = open(self._file_path, "wb")  # noqa: SIM115 - open across calls, closed in _close_file
        self._file_size = 0
        self._file_model = model

    def _close_file(self) -> None:
        if self._file is None:
            return
        self._file.close()
        path, model = self._file_path, self._file_model
        self._closed.append((path, self._file_size))
        self._file = None
        if self.mlflow:
            self._upload(path, model)

    def _upload(self, path: Path, model: dict) -> None:
        """Log a closed file to the training run of the model that answered its requests; failures are
        logged, never raised (the server goes on, the file stays in the directory)."""
        run_id = model.get("run_id")
        if not run_id:
            log.warning("not logging %s to MLflow: model %s version %s names no training run "
                        "(trainserve.run_id metadata)", path.name, model.get("name"), model.get("version"))
            return
        try:
            if self._mlflow_client is None:
                import mlflow

                self._mlflow_client = mlflow.MlflowClient()
            self._mlflow_client.log_artifact(run_id, str(path), artifact_path="payloads")
            log.info("logged %s to MLflow run %s under payloads/", path.name, run_id)
        except Exception as exc:  # noqa: BLE001 - MlflowException, connection errors, ...
            log.warning("cannot log %s to MLflow run %s: %s", path.name, run_id, exc)


def _as_json(record: Record) -> dict:
    out = {"request_id": record.request_id, "time": _iso(record.time), "endpoint": record.endpoint,
           "status": record.status, "model": record.model, "inputs": _tensors(record.inputs),
           "outputs": None if record.outputs is None else _tensors(record.outputs)}
    if record.error is not None:
        out["error"] = record.error
    return out


def _tensors(arrays: dict[str, np.ndarray]) -> dict:
    return {name: {"dtype": a.dtype.name, "shape": list(a.shape), "data": np.ascontiguousarray(a)}
            for name, a in arrays.items()}


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"
