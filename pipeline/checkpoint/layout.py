"""The storage layout of checkpoints, the same on local disk and on an object store, whatever the
format writes inside a step directory:

    <run_dir>/checkpoints/
        step_00000120/            a complete checkpoint (published by rename; on a store, by its
                                  marker)
            trainserve.json       its own description: format, step, config, components, the model's
                                  state manifest, code, train state (rank 0), the step's validation
                                  metrics
            COMPLETE              the marker, written last: every file's name, size and sha256
            ...                   the format's files (DCP: .metadata and one __<rank>_0.distcp per
                                  rank)
        best.json                 the best checkpoint so far (monitor.py): never pruned
        .tmp-step_00000140/       a save in progress; never loaded, removed by the next save

Invariant: a directory named step_* holds a COMPLETE marker whose sizes match the files, or it is
not a checkpoint; a crash at any point of a save leaves the previous checkpoint intact. On an object
store (train.output_dir=s3://..., object_store.py) there is no rename, so a checkpoint is published
by its marker alone: listing, `latest`, resume and consolidation take only step directories whose
marker matches the objects present, and a step directory without one is garbage that the next save
of that step (or pruning) removes, marker first.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

import pipeline.checkpoint.object_store as object_store
import pipeline.checkpoint.run_dir as run_dir
from pipeline.checkpoint.object_store import StoreUrl, is_url

# raised here, defined with the others
from pipeline.errors import CheckpointError  # noqa: F401
from serving.lineage import file_sha256

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
META = "trainserve.json"
STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durably(path: Path, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


# --- finding checkpoints --------------------------------------------------------------------


def verify_complete(path: Path) -> dict:
    """Returns the marker if `path` is a complete checkpoint, else raises naming what is wrong."""
    if is_url(path):
        return _verify_complete_on_store(StoreUrl(path))
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint '{path}' does not exist or is not a directory")
    marker = path / MARKER
    if not marker.is_file():
        raise CheckpointError(
            f"checkpoint '{path}' has no {MARKER} marker: the save did not finish; "
            "use another checkpoint or `latest`"
        )
    try:
        listing = json.loads(marker.read_text())
    except json.JSONDecodeError:
        raise CheckpointError(f"checkpoint '{path}': {MARKER} marker is corrupt") from None
    return check_listing(
        path, listing, {f.name: f.stat().st_size for f in path.iterdir() if f.is_file()}
    )


def check_listing(where, listing, present: dict[str, int]) -> dict:
    """The marker `listing` against the files `present` (name -> size) in the checkpoint `where`,
    local or on an object store: every file it names there at its size, .metadata among them.
    Returns the listing."""
    for name, size in marker_files(listing, where).items():
        if name not in present:
            raise CheckpointError(f"checkpoint '{where}': file '{name}' is missing")
        if present[name] != size:
            raise CheckpointError(
                f"checkpoint '{where}': file '{name}' has {present[name]} bytes, "
                f"the marker says {size}: truncated or overwritten"
            )
    if ".metadata" not in listing["files"]:
        raise CheckpointError(f"checkpoint '{where}' has no .metadata: not a DCP checkpoint")
    return listing


def marker_files(listing, where) -> dict[str, int]:
    """The marker's {file name: size}, its shape checked: a marker is untrusted input, and valid
    JSON of another shape ({} or []) must read as a broken checkpoint, not end the caller in a
    KeyError."""
    files = listing.get("files") if isinstance(listing, dict) else None
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and type(v) is int for k, v in files.items()
    ):
        raise CheckpointError(
            f"checkpoint '{where}': {MARKER} marker is not a listing of files and sizes"
        )
    return files


def _verify_complete_on_store(url: StoreUrl) -> dict:
    """verify_complete for a step directory on an object store: the marker against the objects
    present."""
    present = object_store.files(url)
    if not present:
        raise CheckpointError(f"checkpoint '{url}' does not exist (no objects under it)")
    if MARKER not in present:
        raise CheckpointError(
            f"checkpoint '{url}' has no {MARKER} marker: the save did not finish; "
            "use another checkpoint or `latest`"
        )
    try:
        listing = json.loads(object_store.read_bytes(url / MARKER))
    except (ValueError, FileNotFoundError):
        raise CheckpointError(f"checkpoint '{url}': {MARKER} marker is corrupt or gone") from None
    return check_listing(url, listing, present)


def verify_checksums(path: Path) -> None:
    """Reads every file of a complete checkpoint and compares it with the sha256 its marker recorded
    at save: catches what keeps the size (a flipped bit on disk or in transfer). A full read, so it
    runs where everything is read or fetched anyway (consolidation, a download), not on resume."""
    listing = verify_complete(path)
    check_digests(
        path,
        listing,
        {name: file_sha256(path / name) for name in sorted(listing.get("sha256") or {})},
    )


def check_digests(path: Path, listing: dict, digests: dict[str, str]) -> None:
    """The files' sha256 `digests` (however they were computed) against the marker `listing`
    recorded."""
    recorded = listing.get("sha256")
    if recorded is None:
        log.warning(
            "checkpoint %s records no checksums (saved by an older trainserve): sizes checked only",
            path,
        )
        return
    for name, digest in sorted(recorded.items()):
        if digests.get(name) != digest:
            raise CheckpointError(
                f"checkpoint '{path}': file '{name}' differs from what was saved (its sha256 "
                "does not match the marker's): corrupted on disk or in transfer; use another "
                "checkpoint, or download it again"
            )


def list_complete(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first. Incomplete ones are skipped with a warning.
    A re-save that died between its two renames (where RENAME_EXCHANGE is missing) left
    `.old-step_N` and no `step_N`: that one is a checkpoint of step N and counts."""
    if is_url(root):
        return _list_complete_on_store(StoreUrl(root))
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in sorted(root.iterdir(), key=lambda c: c.name.removeprefix(OLD)):
        if (
            child.name.startswith(OLD)
            and STEP_DIR.match(child.name[len(OLD) :])
            and not (root / child.name[len(OLD) :]).exists()
        ):
            # the previous save of a step whose re-save did not finish
            pass
        elif not STEP_DIR.match(child.name):
            continue
        try:
            verify_complete(child)
            found.append(child)
        except CheckpointError as exc:
            log.warning("skipping %s", exc)
    return found


def _list_complete_on_store(root: StoreUrl) -> list[StoreUrl]:
    found = []
    # sorted: step numbers are zero-padded
    for name in object_store.children(root):
        if not STEP_DIR.match(name):
            continue
        try:
            verify_complete(root / name)
            found.append(root / name)
        except CheckpointError as exc:
            log.warning("skipping %s", exc)
    return found


def clear_incomplete(root: StoreUrl) -> list[str]:
    """On an object store, the step directories without a matching marker (saves a crash cut short):
    garbage, removed by the run directory's next owner before it saves anything."""
    run_dir.check_still_owned(root.parent)
    complete = {p.name for p in list_complete(root)}
    garbage = [
        name
        for name in object_store.children(root)
        if STEP_DIR.match(name) and name not in complete
    ]
    for name in garbage:
        remove(StoreUrl(root) / name)
    if garbage:
        log.warning(
            "removed incomplete checkpoints %s from %s (saves that did not finish)",
            ", ".join(garbage),
            root,
        )
    return garbage


def remove(path: Path) -> None:
    """A checkpoint directory gone; on an object store its marker first, so a removal cut short is
    garbage."""
    if is_url(path):
        object_store.remove_tree(path, first=MARKER)
    else:
        shutil.rmtree(path, ignore_errors=True)


# a step directory on its way out during a re-save
OLD = ".old-"


def publish(tmp: Path, final: Path) -> None:
    """`tmp` becomes `final` with no moment where neither is a complete checkpoint of that step: a
    first save is one rename; a re-save (after a restart) swaps the two atomically (renameat2
    RENAME_EXCHANGE), or, where the filesystem can't, moves the old one aside first (list_complete
    still finds it if a crash comes in between)."""
    root = final.parent
    if final.exists():
        if not _exchange(tmp, final):
            os.replace(final, root / f"{OLD}{final.name}")
            os.replace(tmp, final)
            tmp = root / f"{OLD}{final.name}"
    else:
        os.replace(tmp, final)
    fsync_dir(root)
    # the replaced checkpoint
    shutil.rmtree(tmp, ignore_errors=True)
    # one a crashed re-save left behind
    shutil.rmtree(root / f"{OLD}{final.name}", ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swaps two paths (Linux renameat2 with RENAME_EXCHANGE); False where
    unsupported."""
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def set_aside_after(root: Path, step: int) -> list[Path]:
    """A resume from step `step` into a directory that holds later steps starts another timeline:
    those later checkpoints move to `<run dir>/checkpoints.abandoned/<time>/`, so that `latest` (a
    torchrun restart, --resume latest) and pruning by step follow the timeline being trained."""
    later = [
        p
        for p in list_complete(root)
        if int(STEP_DIR.match(p.name.removeprefix(OLD)).group(1)) > step
    ]
    if not later:
        return []
    # copied aside (marker last), then removed (marker first)
    if is_url(root):
        aside = StoreUrl(root).parent / "checkpoints.abandoned" / time.strftime("%Y%m%d-%H%M%S")
        for path in later:
            object_store.copy_tree(path, aside / path.name, last=MARKER)
            remove(path)
        log.warning(
            "resumed from step %d: the later checkpoints %s are set aside in %s",
            step,
            ", ".join(p.name for p in later),
            aside,
        )
        return later
    aside = Path(root).parent / "checkpoints.abandoned" / time.strftime("%Y%m%d-%H%M%S")
    aside.mkdir(parents=True, exist_ok=True)
    for path in later:
        os.replace(path, aside / path.name.removeprefix(OLD))
    log.warning(
        "resumed from step %d: the later checkpoints %s are set aside in %s",
        step,
        ", ".join(p.name for p in later),
        aside,
    )
    return later


def latest(root: Path) -> Path | None:
    complete = list_complete(root)
    return complete[-1] if complete else None


def read_meta(path: Path) -> dict:
    verify_complete(path)
    try:
        meta = json.loads(
            object_store.read_bytes(StoreUrl(path) / META)
            if is_url(path)
            else (Path(path) / META).read_text()
        )
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"checkpoint '{path}': {META} can't be read ({type(exc).__name__}: {exc})"
        ) from None
    if not isinstance(meta, dict):
        raise CheckpointError(
            f"checkpoint '{path}': {META} holds a {type(meta).__name__}, not a JSON object"
        )
    return meta


def prune(root: Path, keep_last: int, protect: tuple[int | None, ...]) -> None:
    """Keeps the newest `keep_last` complete checkpoints and those of the steps in `protect` (the
    best one)."""
    kept = {step_dir_name(s) for s in protect if s is not None}
    # by step: the timeline a resume left is set aside
    for old in list_complete(root)[:-keep_last]:
        if old.name.removeprefix(OLD) not in kept:
            remove(old)
