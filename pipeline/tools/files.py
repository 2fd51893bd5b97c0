"""Small state files (mlflow_run.json, config.yaml, export_report.json): written atomically, read
with an error that names the file.

`Path.write_text` truncates first: a full disk or a crash mid-write leaves an empty file, and every
later command died on it with a JSONDecodeError traceback. Here the new content goes to a temporary
file beside it, is fsynced, and replaces the old one by rename: a reader sees the old file or the
new one, never a part. On an object store (a run directory at s3://...) one PUT does the same: the
object appears whole or not at all.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class StateFileError(RuntimeError):
    """A state file is missing, damaged or not what it should be; the message names it and the
    fix."""


def write_atomically(path: Path, text: str) -> None:
    """`path`: a local path, or a location on an object store (object_store.StoreUrl, whose
    write_text is one atomic PUT)."""
    if not isinstance(path, Path) and hasattr(path, "write_text"):
        path.write_text(text)
        return
    path = _local(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _local(path) -> Path:
    # a URL as a plain string would become a local file named "s3:/..."
    if "://" in str(path):
        raise TypeError(
            f"{path}: a location on an object store is an object_store.StoreUrl (object_store.location)"
        )
    return Path(path)


def write_json(path: Path, payload: Any) -> None:
    write_atomically(path, json.dumps(payload, indent=2))


def read_json(path: Path, fix: str = "") -> Any:
    """The file's JSON, or StateFileError naming the file (and `fix`, what to do about it). `path`:
    a local path, or a location on an object store (object_store.StoreUrl)."""
    path = path if hasattr(path, "read_text") else _local(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise StateFileError(f"{path} is missing{'; ' + fix if fix else ''}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StateFileError(
            f"{path} is damaged ({type(exc).__name__}: {exc}); {fix or 'delete it or restore it'}"
        ) from None
