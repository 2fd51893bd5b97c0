"""Every checkpoint uploaded to the MLflow run in the background (`checkpoint.log_to_mlflow: all`).

Uploading a large checkpoint takes minutes. Done on rank 0 inside the loop it would stall every rank
and, past the process group's 10-minute timeout, abort the job. So rank 0 snapshots each new
checkpoint by hard links (pruning by `keep_last` may delete the original while it uploads) and one
daemon thread uploads the snapshots in order. A rank that dies mid-upload leaves a checkpoint
without its marker in MLflow, which `checkpoint_store.download_checkpoint` never takes for a
complete one.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
from pathlib import Path

from pipeline.checkpoint import store as checkpoint_store

log = logging.getLogger(__name__)


def snapshot(source: Path, destination: Path) -> Path:
    """A copy of the checkpoint directory that costs no space: hard links, or a real copy where the
    filesystem has none."""
    shutil.rmtree(destination, ignore_errors=True)
    try:
        shutil.copytree(source, destination, copy_function=os.link)
    except OSError:
        shutil.rmtree(destination, ignore_errors=True)
        shutil.copytree(source, destination)
    return destination


class BackgroundUploads:
    """`submit(checkpoint)` returns at once; `finish()` waits for all of them and reports
    failures."""

    def __init__(self, run_id: str, staging: Path):
        self.run_id, self.staging = run_id, staging
        # snapshots a killed attempt left behind
        shutil.rmtree(staging, ignore_errors=True)
        # checkpoint name -> error
        self.failed: dict[str, str] = {}
        self.submitted: set[str] = set()
        self._todo: queue.Queue[Path | None] = queue.Queue()
        # A daemon: a failing rank exits without waiting for uploads (the marker goes up last).
        self._thread = threading.Thread(
            target=self._upload_in_order, name="checkpoint-uploads", daemon=True
        )
        self._thread.start()

    def submit(self, checkpoint: Path) -> None:
        self.submitted.add(checkpoint.name)
        self._todo.put(snapshot(checkpoint, self.staging / checkpoint.name))

    def finish(self) -> dict[str, str]:
        self._todo.put(None)
        self._thread.join()
        shutil.rmtree(self.staging, ignore_errors=True)
        return self.failed

    def _upload_in_order(self) -> None:
        while (snap := self._todo.get()) is not None:
            try:
                checkpoint_store.log_checkpoint(snap, self.run_id)
                log.info("uploaded checkpoint %s to MLflow run %s", snap.name, self.run_id)
            except Exception as exc:
                # the next checkpoint may well go up; the caller decides at the end
                self.failed[snap.name] = f"{type(exc).__name__}: {exc}"
                log.warning("checkpoint %s was not uploaded to MLflow: %s", snap.name, exc)
            finally:
                shutil.rmtree(snap, ignore_errors=True)
