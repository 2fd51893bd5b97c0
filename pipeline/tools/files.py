"""Small state files (mlflow_run.json, config.yaml, export_report.json): written atomically, read with
an error that names the file.

`Path.write_text` truncates first: a full disk or a crash mid-write leaves an empty file, and every
later command died on it with a JSONDecodeError traceback. Here the new content goes to a temporary
file beside it, is fsynced, and replaces the old one by rename: a reader sees the old file or the new
one, never a part. On an object store (a run directory at s3://...) one PUT does the same: the object
appears whole or not at all.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class StateFileError(RuntimeError):
    """A state file is missing, damaged or not what it should be; the message names it and the fix."""


def write_atomically(path: Path, text: str) -> None:
    from pipeline.components import object_store

    if object_store.is_url(path):
        object_store.write_bytes(path, text.encode())
        return
    path = Path(path)
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


def write_json(path: Path, payload: Any) -> None:
    write_atomically(path, json.dumps(payload, indent=2))


def read_json(path: Path, fix: str = "") -> Any:
    """The file's JSON, or StateFileError naming the file (and `fix`, what to do about it)."""
    from pipeline.components import object_store

    path = path if object_store.is_url(path) else Path(path)
    try:
        return json.loads(object_store.read_bytes(path) if object_store.is_url(path) else path.read_text())
    except FileNotFoundError:
        raise StateFileError(f"{path} is missing{'; ' + fix if fix else ''}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StateFileError(f"{path} is damaged ({type(exc).__name__}: {exc}); {fix or 'delete it or restore it'}") \
            from None
