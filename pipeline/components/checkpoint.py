"""Sharded, atomic, self-describing checkpoints with torch.distributed.checkpoint (DCP).

Layout under `<run_dir>/checkpoints/`:

    step_00000120/            a complete checkpoint (published by rename)
        .metadata             DCP's index of every stored tensor and its chunks (rank 0)
        __0_0.distcp ...      one shard file per rank
        trainserve.json       step, config, model/data/task components, inputs, the model's state
                              manifest (keys, shapes, dtypes), code, train state (rank 0), and
                              the validation metrics of this step when it was evaluated
    best.json                 the best checkpoint so far (see monitor.py): never pruned
        COMPLETE              the marker: every file's name and size, written last
    .tmp-step_00000140/       a save in progress; never loaded, removed by the next save

Stored keys: `model.<fqn>` (plain module names, no `module.` prefix, whatever the strategy),
`optim.state.<fqn>.<name>`, `optim.param_groups...`, and `rng.rank<r>.*` per rank.
Invariant: a directory named step_* holds a COMPLETE marker whose sizes match the files, or it
is not a checkpoint; a crash at any point of a save leaves the previous checkpoint intact. An
asynchronous save (checkpoint.async_save, AsyncWriter) keeps it the same way: its publish runs, in a
background thread, only once every rank's write has finished.

On an object store (train.output_dir=s3://..., see object_store.py) there is no rename, so a checkpoint
is published by its marker alone: every rank writes its shards straight into `step_N/` (DCP's
FsspecWriter; each object appears whole when its PUT completes), then, after a barrier that every
rank reaches only once its writes are done, rank 0 writes trainserve.json and, last, the COMPLETE
marker listing every object's name, size and sha256. Listing, `latest`, resume and consolidation
take only step directories whose marker matches the objects present, so the invariant above holds
as it is: a step directory without a matching marker is not a checkpoint, it is garbage that the
next save of that step (or pruning) removes, marker first. A re-save of a step whose complete
checkpoint is still there (nothing set it aside) withdraws that checkpoint first; every other
checkpoint stays intact.

Checkpoints are untrusted input (a shared MLflow store lets others write them, and the marker's
checksums are written by whoever wrote the files): nothing in one is unpickled with arbitrary
globals. DCP's `.metadata` goes through an unpickler that admits only DCP's metadata types, and its
non-tensor entries (optimizer hyperparameters) through torch.load(weights_only=True); DCP's own
reader already loads tensors that way.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import os
import pickle
import random
import re
import shutil
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)

from pipeline.components import object_store, run_dir
from pipeline.components.object_store import StoreUrl, is_url
from pipeline.distributed import DistInfo, barrier
from pipeline.tools.faults import inject_fault
from pipeline.components.safetensors_writer import file_sha256
from pipeline.errors import CheckpointError  # noqa: F401 - raised here, defined with the others

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
META = "trainserve.json"
FORMAT = "trainserve-dcp/2"  # /2: components (model/data/task references, state manifest)
STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


@contextlib.contextmanager
def single_process_quiet():
    """DCP warns that one process without a process group is 'assumed' single-process; it is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


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
        raise CheckpointError(f"checkpoint '{path}' has no {MARKER} marker: the save did not finish; "
                              "use another checkpoint or `latest`")
    try:
        listing = json.loads(marker.read_text())
    except json.JSONDecodeError:
        raise CheckpointError(f"checkpoint '{path}': {MARKER} marker is corrupt") from None
    return check_listing(path, listing, {f.name: f.stat().st_size for f in path.iterdir() if f.is_file()})


def check_listing(where, listing, present: dict[str, int]) -> dict:
    """The marker `listing` against the files `present` (name -> size) in the checkpoint `where`, local or on
    an object store: every file it names there at its size, .metadata among them. Returns the listing."""
    for name, size in marker_files(listing, where).items():
        if name not in present:
            raise CheckpointError(f"checkpoint '{where}': file '{name}' is missing")
        if present[name] != size:
            raise CheckpointError(f"checkpoint '{where}': file '{name}' has {present[name]} bytes, "
                                  f"the marker says {size}: truncated or overwritten")
    if ".metadata" not in listing["files"]:
        raise CheckpointError(f"checkpoint '{where}' has no .metadata: not a DCP checkpoint")
    return listing


def marker_files(listing, where) -> dict[str, int]:
    """The marker's {file name: size}, its shape checked: a marker is untrusted input, and valid JSON of another
    shape ({} or []) must read as a broken checkpoint, not end the caller in a KeyError."""
    files = listing.get("files") if isinstance(listing, dict) else None
    if not isinstance(files, dict) or not all(isinstance(k, str) and type(v) is int for k, v in files.items()):
        raise CheckpointError(f"checkpoint '{where}': {MARKER} marker is not a listing of files and sizes")
    return files


def _verify_complete_on_store(url: StoreUrl) -> dict:
    """verify_complete for a step directory on an object store: the marker against the objects present."""
    present = object_store.files(url)
    if not present:
        raise CheckpointError(f"checkpoint '{url}' does not exist (no objects under it)")
    if MARKER not in present:
        raise CheckpointError(f"checkpoint '{url}' has no {MARKER} marker: the save did not finish; "
                              "use another checkpoint or `latest`")
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
    check_digests(path, listing, {name: file_sha256(path / name) for name in sorted(listing.get("sha256") or {})})


def check_digests(path: Path, listing: dict, digests: dict[str, str]) -> None:
    """The files' sha256 `digests` (however they were computed) against the marker `listing` recorded."""
    recorded = listing.get("sha256")
    if recorded is None:
        log.warning("checkpoint %s records no checksums (saved by an older trainserve): sizes checked only", path)
        return
    for name, digest in sorted(recorded.items()):
        if digests.get(name) != digest:
            raise CheckpointError(f"checkpoint '{path}': file '{name}' differs from what was saved (its sha256 "
                                  "does not match the marker's): corrupted on disk or in transfer; use another "
                                  "checkpoint, or download it again")


def list_complete(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first. Incomplete ones are skipped with a warning. A
    re-save that died between its two renames (where RENAME_EXCHANGE is missing) left `.old-step_N` and
    no `step_N`: that one is a checkpoint of step N and counts."""
    if is_url(root):
        return _list_complete_on_store(StoreUrl(root))
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in sorted(root.iterdir(), key=lambda c: c.name.removeprefix(OLD)):
        if child.name.startswith(OLD) and STEP_DIR.match(child.name[len(OLD):]) \
                and not (root / child.name[len(OLD):]).exists():
            pass  # the previous save of a step whose re-save did not finish
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
    for name in object_store.children(root):  # sorted: step numbers are zero-padded
        if not STEP_DIR.match(name):
            continue
        try:
            verify_complete(root / name)
            found.append(root / name)
        except CheckpointError as exc:
            log.warning("skipping %s", exc)
    return found


def clear_incomplete(root: StoreUrl) -> list[str]:
    """On an object store, the step directories without a matching marker (saves a crash cut short): garbage,
    removed by the run directory's next owner before it saves anything."""
    run_dir.check_still_owned(root.parent)
    complete = {p.name for p in list_complete(root)}
    garbage = [name for name in object_store.children(root) if STEP_DIR.match(name) and name not in complete]
    for name in garbage:
        remove(StoreUrl(root) / name)
    if garbage:
        log.warning("removed incomplete checkpoints %s from %s (saves that did not finish)", ", ".join(garbage), root)
    return garbage


def remove(path: Path) -> None:
    """A checkpoint directory gone; on an object store its marker first, so a removal cut short is garbage."""
    if is_url(path):
        object_store.remove_tree(path, first=MARKER)
    else:
        shutil.rmtree(path, ignore_errors=True)


OLD = ".old-"  # a step directory on its way out during a re-save


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
    shutil.rmtree(tmp, ignore_errors=True)  # the replaced checkpoint
    shutil.rmtree(root / f"{OLD}{final.name}", ignore_errors=True)  # one a crashed re-save left behind


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swaps two paths (Linux renameat2 with RENAME_EXCHANGE); False where unsupported."""
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
    later = [p for p in list_complete(root) if int(STEP_DIR.match(p.name.removeprefix(OLD)).group(1)) > step]
    if not later:
        return []
    if is_url(root):  # copied aside (marker last), then removed (marker first)
        aside = StoreUrl(root).parent / "checkpoints.abandoned" / time.strftime("%Y%m%d-%H%M%S")
        for path in later:
            object_store.copy_tree(path, aside / path.name, last=MARKER)
            remove(path)
        log.warning("resumed from step %d: the later checkpoints %s are set aside in %s",
                    step, ", ".join(p.name for p in later), aside)
        return later
    aside = Path(root).parent / "checkpoints.abandoned" / time.strftime("%Y%m%d-%H%M%S")
    aside.mkdir(parents=True, exist_ok=True)
    for path in later:
        os.replace(path, aside / path.name.removeprefix(OLD))
    log.warning("resumed from step %d: the later checkpoints %s are set aside in %s",
                step, ", ".join(p.name for p in later), aside)
    return later


def latest(root: Path) -> Path | None:
    complete = list_complete(root)
    return complete[-1] if complete else None


def read_meta(path: Path) -> dict:
    verify_complete(path)
    try:
        meta = json.loads(object_store.read_bytes(StoreUrl(path) / META) if is_url(path) else (Path(path) / META).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint '{path}': {META} can't be read ({type(exc).__name__}: {exc})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint '{path}': {META} holds a {type(meta).__name__}, not a JSON object")
    return meta


# --- state ----------------------------------------------------------------------------------


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": torch.tensor([np_state[2], np_state[3]], dtype=torch.int64),
        "numpy_gauss": torch.tensor([np_state[4]], dtype=torch.float64),
        "python": torch.tensor(random.getstate()[1], dtype=torch.int64),
        **({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {}),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    pos, has_gauss = (int(v) for v in state["numpy_pos"])
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss,
                         float(state["numpy_gauss"][0])))
    random.setstate((3, tuple(int(v) for v in state["python"]), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(root: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         meta: dict, info: DistInfo, keep_last: int, protect: tuple[int | None, ...] = ()) -> Path:
    """Collective: every rank calls it. Returns the published directory. Keeps the newest `keep_last`
    checkpoints and those of the steps in `protect` (the best one)."""
    return finish_save(start_save(root, step, model, optimizer, meta, info), info, keep_last, protect)


@dataclass
class PendingSave:
    """A save whose shards are being written (`written` not yet done, when asynchronous) into `tmp`."""
    step: int
    tmp: Path
    final: Path
    meta: dict
    written: Future | None = None  # asynchronous: done when this rank's shards are on disk and hashed


def start_save(root: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: dict,
               info: DistInfo, background: "AsyncWriter | None" = None) -> PendingSave:
    """Collective. Writes every rank's shards into a temporary directory; with `background`, returns once the
    state is copied (staged) and the write goes on in a thread. `finish_save` publishes it. On an object store
    the shards go straight into the step directory (no rename there: the marker publishes it, see above)."""
    if is_url(root):
        root = StoreUrl(root)
        final = tmp = root / step_dir_name(step)
        if info.is_main:  # what a crashed save left there (garbage), or a complete one being re-saved
            run_dir.check_still_owned(root.parent)
            remove(final)
    else:
        root = Path(root)
        final = root / step_dir_name(step)
        tmp = root / f".tmp-{step_dir_name(step)}"
        if info.is_main:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():  # left by a crash: never part of a checkpoint
                shutil.rmtree(tmp)
    barrier(info)

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "rng": {f"rank{info.rank}": _rng_state()}}
    pending = PendingSave(step, tmp, final, dict(meta))
    try:
        with single_process_quiet():
            if background is None:
                dcp.save(state, **dcp_target(tmp), no_dist=not info.distributed)
            else:
                pending.written = background.write(state, tmp, info)  # -> this rank's shard digests
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise _save_failed(exc, root, tmp, step, _tensor_bytes(state), info) from None
    inject_fault("save_started", step, info)  # test hook: a crash while the shards are being written
    return pending


def finish_save(pending: PendingSave, info: DistInfo, keep_last: int, protect: tuple[int | None, ...] = (),
                group=None) -> Path:
    """Collective (on `group`, default the training's). Once every rank's shards are written (an asynchronous
    write waited for here, on each rank, before the barrier): hashes, trainserve.json, the COMPLETE marker last,
    the atomic publish, pruning."""
    tmp, final, step, meta = pending.tmp, pending.final, pending.step, pending.meta
    # Each rank hashes the shards it wrote, all at once (an asynchronous write did so in its thread).
    mine = pending.written.result() if pending.written is not None else shard_digests(tmp, info.rank)
    _barrier(info, group)
    inject_fault("save", step, info)  # test hook: a crash after the shards, before publishing
    digests = _all_gather(mine, info, group)
    if info.is_main and is_url(final):
        run_dir.check_still_owned(final.parent.parent)  # <run>/checkpoints/step_N: the run's lease, still ours
        _publish_on_store(final, step, meta, info, digests)
        _prune(final.parent, keep_last, protect)
        log.debug("checkpoint saved: %s", final)  # said by the Saver: at --verbose, when slow, and once in all
    elif info.is_main:
        root = final.parent
        try:
            write_json_durably(tmp / META, {"format": FORMAT, "step": step, "world_size": info.world_size, **meta})
            files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
            sha256 = {name: digest for per_rank in digests for name, digest in per_rank.items()}
            sha256.update({name: file_sha256(tmp / name) for name in files if name not in sha256})
            write_json_durably(tmp / MARKER, {"step": step, "files": files, "sha256": sha256})
            fsync_dir(tmp)
        except OSError as exc:
            raise _save_failed(exc, root, tmp, step, 0, info) from None
        publish(tmp, final)
        _prune(root, keep_last, protect)
        log.debug("checkpoint saved: %s", final)  # said by the Saver: at --verbose, when slow, and once in all
    _barrier(info, group)
    return final


def _prune(root: Path, keep_last: int, protect: tuple[int | None, ...]) -> None:
    kept = {step_dir_name(s) for s in protect if s is not None}
    for old in list_complete(root)[:-keep_last]:  # by step: the timeline a resume left is set aside
        if old.name.removeprefix(OLD) not in kept:
            remove(old)


def _publish_on_store(final: StoreUrl, step: int, meta: dict, info: DistInfo, digests: list[dict]) -> None:
    """Every rank's shards are written (the caller's barrier): trainserve.json, then the marker, last, naming
    every object with its size and sha256. Until the marker's PUT completes this is not a checkpoint."""
    object_store.write_json(final / META, {"format": FORMAT, "step": step, "world_size": info.world_size, **meta})
    files = object_store.files(final)
    sha256 = {name: digest for per_rank in digests for name, digest in per_rank.items()}
    sha256.update({name: object_store.sha256(final / name) for name in files if name not in sha256})
    missing = sorted(set(sha256) - set(files))
    if missing:  # a rank's PUT that did not land: never publish a checkpoint without it
        raise CheckpointError(f"saving checkpoint step {step} to {final}: {', '.join(missing)} written but not on "
                              "the object store; the previous checkpoint is intact")
    object_store.write_json(final / MARKER, {"step": step, "files": files, "sha256": sha256})


def dcp_target(directory: Path) -> dict:
    """Where dcp.save writes: a local directory by its path (DCP picks its FileSystemWriter); on an object store
    DCP's FsspecWriter with our s3fs options and without fsync (meaningless there: a PUT is durable once it
    returns, and DCP would fall back to a machine-wide sync()). No checkpoint_id with it: DCP would reset the
    writer to that path with fsspec's default options."""
    if not is_url(directory):
        return {"checkpoint_id": str(directory)}
    # torch 2.13 keeps DCP's fsspec storage in this module (not re-exported by torch.distributed.checkpoint).
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return {"storage_writer": FsspecWriter(str(directory), sync_files=False, **object_store.storage_options())}


def _tensor_bytes(tree) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v) for v in tree)
    return 0


def _save_failed(exc: BaseException, root: Path, tmp: Path, step: int, needed: int, info: DistInfo) -> BaseException:
    """What a failed save raises: on a full disk, one line that says so (DCP reports it as torch.save's
    "unexpected pos 704 vs 598" inside a 65-line CheckpointException, no errno); else the error itself. The
    partial directory goes either way: it was never published, and it holds the space a retry needs."""
    try:
        free = shutil.disk_usage(root).free  # before the partial files go: what the failed write left
    except OSError:
        free = None
    if info.is_main:
        remove(tmp) if is_url(tmp) else shutil.rmtree(tmp, ignore_errors=True)
    if is_url(root):
        return exc
    full = any(getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(e)
               for e in _chain(exc)) or (free is not None and free < needed)
    if not full:
        return exc
    last = list_complete(root)
    return CheckpointError(
        f"saving checkpoint step {step} to {root} failed: the disk is full ({(free or 0) / 2**20:.1f} MiB free on "
        f"its filesystem, the checkpoint takes ~{needed / 2**20:.1f} MiB per rank); free space or set "
        "train.output_dir to a larger disk. "
        + (f"The last complete checkpoint, {last[-1].name}, is intact" if last else "No earlier checkpoint exists"))


def _chain(exc: BaseException):
    """`exc`, its causes and contexts, and the per-rank failures a CheckpointException carries."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [getattr(e, "__cause__", None), getattr(e, "__context__", None)]
        if isinstance(e, CheckpointException):
            todo += [failure[0] if isinstance(failure, tuple) else failure for failure in e.failures.values()]


def _barrier(info: DistInfo, group) -> None:
    if info.distributed:
        torch.distributed.barrier(group=group)


def _all_gather(obj, info: DistInfo, group) -> list:
    if not info.distributed:
        return [obj]
    box = [None] * info.world_size
    torch.distributed.all_gather_object(box, obj, group=group)
    return box


def shard_digests(directory: Path, rank: int) -> dict[str, str]:
    """sha256 of the shard files `rank` wrote (DCP names them __<rank>_<n>.distcp)."""
    if is_url(directory):
        return {name: object_store.sha256(StoreUrl(directory) / name) for name in sorted(object_store.files(directory))
                if re.fullmatch(rf"__{rank}_\d+\.distcp", name)}
    return {p.name: file_sha256(p) for p in sorted(Path(directory).glob(f"__{rank}_*.distcp"))}


class AsyncWriter:
    """The asynchronous save (checkpoint.async_save): the state is staged (copied) to CPU memory by DCP's stager,
    pinned on CUDA, before `write` returns, so training may change it at once; one background thread then
    writes the shard files (dcp.save), hashes them and, once every rank's are written, publishes the checkpoint
    (`publish`), saves in order.

    That thread runs at the lowest CPU priority (nice 19; Linux): on a machine whose cores the ranks keep busy,
    a save's CPU time (serializing, writing, hashing) is taken from training whatever runs it, and at low
    priority it is taken mostly where a rank waits (its all-reduce), spread over more steps instead of
    slowing a few. DCP's own async_save runs the write in a thread it creates, which can't be given a priority;
    its process-based saver (AsyncCheckpointerType.PROCESS) spawns a torch-importing process per rank at the
    first save and stages through shared memory (64 MB in a default Docker container). Measured in separate
    runs of benchmarks/checkpoint_async.py on the shared 2 cores (load 10-13, so indicative only): a step while
    writing 2.20x a plain one with DCP's thread, 2.20x with its process, 1.49x with this thread. A thread keeps
    the GIL for the pickling parts of a write, so the training thread still waits on it now and then.

    The thread's collectives (DCP's planning and metadata exchange, the publish's barrier and digests) run on
    a process group of their own: collectives from two threads on the training's group could interleave with
    DDP's all-reduces and pair the wrong calls across ranks. Created collectively (every rank), closed at the
    end of training. A crash before the publish leaves the previous checkpoint, as a synchronous save does."""

    NICE = 19

    def __init__(self, info: DistInfo):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.group = torch.distributed.new_group(backend="gloo") if info.distributed else None
        cuda = info.device.type == "cuda"
        # Pinned buffers, kept across saves, make the copy from the GPU fast; on a CPU the copy is a memcpy.
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                   use_async_staging=False, use_non_blocking_copy=False))
        # One thread, so a save's publish runs after its write, and saves publish in order.
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer", initializer=_lowest_priority)

    def write(self, state: dict, directory: Path, info: DistInfo) -> Future:
        """Stages `state` and starts writing it; the future gives this rank's shard digests once written."""
        staged = self.stager.stage(state)
        if isinstance(staged, Future):  # async staging is off: this is for another stager
            staged = staged.result()
        return self.worker.submit(self._write_and_hash, staged, directory, info)

    def _write_and_hash(self, staged: dict, directory: Path, info: DistInfo) -> dict[str, str]:
        # One process: DCP's warning that it assumes one process is meant (a catch_warnings here, off the
        # training thread, is safe only then: with no DDP, nothing else changes the filters meanwhile).
        with single_process_quiet() if not info.distributed else contextlib.nullcontext():
            dcp.save(staged, **dcp_target(directory), process_group=self.group, no_dist=not info.distributed)
        return shard_digests(directory, info.rank)

    def publish(self, pending: PendingSave, info: DistInfo, keep_last: int, protect: tuple) -> Future:
        """The publish of `pending` (finish_save on this writer's group), in the background: a future of its path."""
        return self.worker.submit(finish_save, pending, info, keep_last, protect, self.group)

    def close(self) -> None:
        self.worker.shutdown()
        self.stager.close()


def _lowest_priority() -> None:
    """This thread at nice AsyncWriter.NICE (Linux: a thread's own priority); elsewhere it stays as it is."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), AsyncWriter.NICE)
    except (AttributeError, OSError):  # no setpriority (Windows), or not allowed: same priority as training
        pass


# What a DCP `.metadata` pickle names (torch 2.13: its index dataclasses, torch.Size, dtypes, the layout
# helper, the checkpoint's path), and nothing else: any other global is a foreign or hostile file.
_METADATA_TYPES = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class UnsafeCheckpoint(pickle.UnpicklingError):
    """A checkpoint file names something a checkpoint never holds; it was refused before running it."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_TYPES or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                  torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"it names {module}.{name}, which a DCP checkpoint's metadata never holds")


def read_metadata_safely(path: Path) -> Metadata:
    """DCP's index of a checkpoint, unpickled with only DCP's metadata types admitted."""
    try:
        if is_url(path):
            metadata = _MetadataUnpickler(io.BytesIO(object_store.read_bytes(StoreUrl(path) / ".metadata"))).load()
        else:
            with open(Path(path) / ".metadata", "rb") as f:
                metadata = _MetadataUnpickler(f).load()
    except UnsafeCheckpoint as exc:
        raise CheckpointError(f"checkpoint '{path}': .metadata refused, nothing in it was run: {exc} (a foreign or "
                              "hostile file; use a checkpoint your own training wrote)") from None
    except Exception as exc:  # a corrupt or truncated .metadata unpickles with any error
        raise CheckpointError(f"checkpoint '{path}': .metadata can't be read ({type(exc).__name__}: {exc})") from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint '{path}': .metadata holds a {type(metadata).__name__}, not DCP metadata")
    _check_storage_paths(path if is_url(path) else Path(path), metadata)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


def _check_storage_paths(path: Path, metadata: Metadata) -> None:
    """Every tensor's data is read from a file inside the checkpoint. DCP writes its shard files there and
    names them relative to it; the unpickler admits any string, and DCP's reader joins it to the directory, so
    an absolute or `../` relative_path would read another run's (or any) file, which the marker's checksums,
    covering only the checkpoint's own files, never see."""
    root = Path("/checkpoint") if is_url(path) else path.resolve()  # on a store: the names alone are judged
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        relative = getattr(info, "relative_path", None)
        where = getattr(index, "fqn", index)
        if not isinstance(relative, str) or not relative or Path(relative).is_absolute() or \
                ".." in Path(relative).parts or not (root / relative).resolve().is_relative_to(root):
            raise CheckpointError(f"checkpoint '{path}': .metadata reads '{where}' from {relative!r:.200}, outside the "
                                  "checkpoint directory; DCP stores data in files inside it (e.g. '__0_0.distcp'). "
                                  "A foreign or hostile file: use a checkpoint your own training wrote")


class CachedMetadataReader(FileSystemReader):
    """A FileSystemReader that reads `.metadata` once, safely (see read_metadata_safely). `dcp.load`
    reads it on every call, and with the optimizer's thousands of entries that costs 0.1-0.4 s per call."""

    def __init__(self, path: Path):
        super().__init__(str(path))
        self.metadata: Metadata = read_metadata_safely(Path(path))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata


def metadata_reader(path: Path) -> FileSystemReader:
    """The reader `load` uses: CachedMetadataReader, or on an object store the same over DCP's FsspecReader."""
    if not is_url(path):
        return CachedMetadataReader(path)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    class StoreMetadataReader(FsspecReader):
        def __init__(self, url: str):
            super().__init__(url, **object_store.storage_options())
            self.metadata: Metadata = read_metadata_safely(url)

        read_metadata = CachedMetadataReader.read_metadata

    return StoreMetadataReader(str(path))


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, except that a non-tensor entry (an optimizer hyperparameter) must first load
    with torch.load(weights_only=True), which refuses any global a plain state dict never holds. DCP's
    own planner unpickles these with weights_only=False."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UnsafeCheckpoint(f"entry {read_item.dest_index.fqn} refused, nothing in it was run: {first}") from None
        value.seek(0)
        super().load_bytes(read_item, value)


def check_compatible(path: Path, model_sd: dict[str, Any], metadata: Metadata) -> None:
    """Refuses a checkpoint whose model keys or shapes differ from the model's: never a partial load."""
    stored = {k[len("model."):]: tuple(v.size) for k, v in metadata.state_dict_metadata.items()
              if k.startswith("model.") and hasattr(v, "size")}
    wanted = {k: tuple(v.shape) for k, v in model_sd.items()}
    missing = sorted(set(wanted) - set(stored))
    extra = sorted(set(stored) - set(wanted))
    shapes = sorted(k for k in set(wanted) & set(stored) if wanted[k] != stored[k])
    if missing or extra or shapes:
        lines = [f"checkpoint '{path}' does not match the model being built:"]
        lines += [f"  missing in checkpoint: {k} {list(wanted[k])}" for k in missing[:20]]
        lines += [f"  not in model: {k} {list(stored[k])}" for k in extra[:20]]
        lines += [f"  shape differs: {k} checkpoint {list(stored[k])} vs model {list(wanted[k])}" for k in shapes[:20]]
        lines.append("  check that model.* and data.* match the config the checkpoint was trained with "
                     f"(see {Path(path) / META})")
        raise CheckpointError("\n".join(lines))


def load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, info: DistInfo) -> dict:
    """Collective. Loads model (+ optimizer, + this rank's RNG when present) in place; returns the meta.

    DCP reshards on load, so a checkpoint written by N ranks loads into M ranks, DDP or FSDP.
    """
    path = path if is_url(path) else Path(path)
    meta = read_meta(path)
    model_sd, optim_sd = get_state_dict(model, optimizer) if optimizer is not None else (
        get_state_dict(model, [])[0], None)
    reader = metadata_reader(path)  # .metadata unpickled once, for the check and for the load
    metadata = reader.metadata
    check_compatible(path, model_sd, metadata)
    state: dict[str, Any] = {"model": model_sd}
    if optim_sd is not None:
        state["optim"] = optim_sd
    rng_key = f"rank{info.rank}"
    # Only the generators the checkpoint holds: DCP refuses to load a key it lacks, and a checkpoint
    # written on CPU has no `cuda` state for a resume on a GPU node (which then keeps its fresh CUDA seed).
    stored = {k.removeprefix(f"rng.{rng_key}.") for k in metadata.state_dict_metadata if k.startswith(f"rng.{rng_key}.")}
    has_rng = bool(stored)
    if has_rng:  # a rank that did not exist in the saving world keeps its fresh seed
        state["rng"] = {rng_key: {name: t for name, t in _rng_state().items() if name in stored}}
    try:
        with single_process_quiet():
            dcp.load(state, storage_reader=reader, planner=WeightsOnlyLoadPlanner(), no_dist=not info.distributed)
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException; name the checkpoint
        raise CheckpointError(f"checkpoint '{path}' could not be read: {first_failure(exc)}") from exc
    set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=state["model"],
                   optim_state_dict=state.get("optim", {}),
                   options=StateDictOptions(strict=True))
    if has_rng:
        _set_rng_state(state["rng"][rng_key])
    return meta


def first_failure(exc: BaseException) -> str:
    """The reader's own error, not DCP's per-rank wrapper around it."""
    if isinstance(exc, CheckpointException) and exc.failures:
        exc = next(iter(exc.failures.values()))
        exc = exc[0] if isinstance(exc, tuple) else exc
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
