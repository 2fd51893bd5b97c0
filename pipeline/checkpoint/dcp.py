"""The checkpoint format trainserve writes: torch.distributed.checkpoint (DCP), sharded, saved by
every rank at once (synchronously, or in a background thread: checkpoint.async_save, AsyncWriter),
published as layout.py says.

Stored keys: `model.<fqn>` (plain module names, no `module.` prefix, whatever the strategy),
`optim.state.<fqn>.<name>`, `optim.param_groups.<fqn>.<name>` (the optimizer state flattened by
parameter, as torchtitan stores it: each pipeline stage's ranks save only their parameters' groups,
and the nested layout's `optim.param_groups.0.*` of every stage would be one key, DCP keeping one
stage's; checkpoints of the nested layout still load, dcp_read.py tells them apart), and
`rng.rank<r>.*` per rank. An asynchronous save keeps the layout's invariant: its publish runs, in a
background thread, only once every rank's write has finished.

On an object store every rank writes its shards straight into `step_N/` (DCP's FsspecWriter; each
object appears whole when its PUT completes), then, after a barrier that every rank reaches only
once its writes are done, rank 0 writes trainserve.json and, last, the COMPLETE marker listing every
object's name, size and sha256. A re-save of a step whose complete checkpoint is still there
(nothing set it aside) withdraws that checkpoint first.

Reading one (`load`, DCP's metadata unpickled safely) is dcp_read.py.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

import pipeline.checkpoint.object_store as object_store
import pipeline.checkpoint.run_dir as run_dir

# load: the format's reader
from pipeline.checkpoint.dcp_read import load, rng_state, single_process_quiet  # noqa: F401
from pipeline.checkpoint.layout import (
    MARKER,
    META,
    fsync_dir,
    list_complete,
    prune,
    publish,
    remove,
    step_dir_name,
    write_json_durably,
)
from pipeline.checkpoint.object_store import StoreUrl, is_url
from pipeline.distributed import DistInfo, barrier

# raised here, defined with the others
from pipeline.errors import CheckpointError  # noqa: F401
from pipeline.tools.faults import inject_fault
from serving.lineage import file_sha256

log = logging.getLogger(__name__)

# /2: components (model/data/task references, state manifest)
FORMAT = "trainserve-dcp/2"

# --- state ----------------------------------------------------------------------------------


@dataclass
class PendingSave:
    """A save whose shards are being written (`written` not yet done, when asynchronous) into
    `tmp`."""

    step: int
    tmp: Path
    final: Path
    meta: dict
    # asynchronous: done when this rank's shards are on disk and hashed
    written: Future | None = None


def start_save(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    meta: dict,
    info: DistInfo,
    background: "AsyncWriter | None" = None,
) -> PendingSave:
    """Collective. Writes every rank's shards into a temporary directory; with `background`, returns
    once the state is copied (staged) and the write goes on in a thread. `finish_save` publishes it.
    On an object store the shards go straight into the step directory (no rename there: the marker
    publishes it, see above)."""
    if is_url(root):
        root = StoreUrl(root)
        final = tmp = root / step_dir_name(step)
        # what a crashed save left there (garbage), or a complete one being re-saved
        if info.is_main:
            run_dir.check_still_owned(root.parent)
            remove(final)
    else:
        root = Path(root)
        final = root / step_dir_name(step)
        tmp = root / f".tmp-{step_dir_name(step)}"
        if info.is_main:
            root.mkdir(parents=True, exist_ok=True)
            # left by a crash: never part of a checkpoint
            if tmp.exists():
                shutil.rmtree(tmp)
    barrier(info)

    model_sd, optim_sd = get_state_dict(
        model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    state = {"model": model_sd, "optim": optim_sd, "rng": {f"rank{info.rank}": rng_state()}}
    pending = PendingSave(step, tmp, final, dict(meta))
    try:
        with single_process_quiet():
            if background is None:
                dcp.save(state, **dcp_target(tmp), no_dist=not info.distributed)
            else:
                # -> this rank's shard digests
                pending.written = background.write(state, tmp, info)
    except (Exception, CheckpointException) as exc:
        # CheckpointException is a BaseException
        raise _save_failed(exc, root, tmp, step, _tensor_bytes(state), info) from None
    # test hook: a crash while the shards are being written
    inject_fault("save_started", step, info)
    return pending


def finish_save(
    pending: PendingSave,
    info: DistInfo,
    keep_last: int,
    protect: tuple[int | None, ...] = (),
    group=None,
) -> Path:
    """Collective (on `group`, default the training's). Once every rank's shards are written (an
    asynchronous write waited for here, on each rank, before the barrier): hashes, trainserve.json,
    the COMPLETE marker last, the atomic publish, pruning."""
    tmp, final, step, meta = pending.tmp, pending.final, pending.step, pending.meta
    # Each rank hashes the shards it wrote, all at once (an asynchronous write did so in its
    # thread).
    mine = (
        pending.written.result() if pending.written is not None else shard_digests(tmp, info.rank)
    )
    _barrier(info, group)
    # test hook: a crash after the shards, before publishing
    inject_fault("save", step, info)
    digests = _all_gather(mine, info, group)
    if info.is_main and is_url(final):
        # <run>/checkpoints/step_N: the run's lease, still ours
        run_dir.check_still_owned(final.parent.parent)
        _publish_on_store(final, step, meta, info, digests)
        prune(final.parent, keep_last, protect)
        # said by the Saver: at --verbose, when slow, and once in all
        log.debug("checkpoint saved: %s", final)
    elif info.is_main:
        root = final.parent
        try:
            write_json_durably(
                tmp / META, {"format": FORMAT, "step": step, "world_size": info.world_size, **meta}
            )
            files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
            sha256 = {name: digest for per_rank in digests for name, digest in per_rank.items()}
            sha256.update({name: file_sha256(tmp / name) for name in files if name not in sha256})
            write_json_durably(tmp / MARKER, {"step": step, "files": files, "sha256": sha256})
            fsync_dir(tmp)
        except OSError as exc:
            raise _save_failed(exc, root, tmp, step, 0, info) from None
        publish(tmp, final)
        prune(root, keep_last, protect)
        # said by the Saver: at --verbose, when slow, and once in all
        log.debug("checkpoint saved: %s", final)
    _barrier(info, group)
    return final


def _publish_on_store(
    final: StoreUrl, step: int, meta: dict, info: DistInfo, digests: list[dict]
) -> None:
    """Every rank's shards are written (the caller's barrier): trainserve.json, then the marker,
    last, naming every object with its size and sha256. Until the marker's PUT completes this is not
    a checkpoint."""
    object_store.write_json(
        final / META, {"format": FORMAT, "step": step, "world_size": info.world_size, **meta}
    )
    files = object_store.files(final)
    sha256 = {name: digest for per_rank in digests for name, digest in per_rank.items()}
    sha256.update({name: object_store.sha256(final / name) for name in files if name not in sha256})
    missing = sorted(set(sha256) - set(files))
    # a rank's PUT that did not land: never publish a checkpoint without it
    if missing:
        raise CheckpointError(
            f"saving checkpoint step {step} to {final}: {', '.join(missing)} written but not on "
            "the object store; the previous checkpoint is intact"
        )
    object_store.write_json(final / MARKER, {"step": step, "files": files, "sha256": sha256})


def dcp_target(directory: Path) -> dict:
    """Where dcp.save writes: a local directory by its path (DCP picks its FileSystemWriter); on an
    object store DCP's FsspecWriter with our s3fs options and without fsync (meaningless there: a
    PUT is durable once it returns, and DCP would fall back to a machine-wide sync()). No
    checkpoint_id with it: DCP would reset the writer to that path with fsspec's default options."""
    if not is_url(directory):
        return {"checkpoint_id": str(directory)}
    # torch 2.13 keeps DCP's fsspec storage in this module (not re-exported by
    # torch.distributed.checkpoint).
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return {
        "storage_writer": FsspecWriter(
            str(directory), sync_files=False, **object_store.storage_options()
        )
    }


def _tensor_bytes(tree) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v) for v in tree)
    return 0


def _save_failed(
    exc: BaseException, root: Path, tmp: Path, step: int, needed: int, info: DistInfo
) -> BaseException:
    """What a failed save raises: on a full disk, one line that says so (DCP reports it as
    torch.save's "unexpected pos 704 vs 598" inside a 65-line CheckpointException, no errno); else
    the error itself. The partial directory goes either way: it was never published, and it holds
    the space a retry needs."""
    try:
        # before the partial files go: what the failed write left
        free = shutil.disk_usage(root).free
    except OSError:
        free = None
    if info.is_main:
        remove(tmp) if is_url(tmp) else shutil.rmtree(tmp, ignore_errors=True)
    if is_url(root):
        return exc
    full = any(
        getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(e)
        for e in _chain(exc)
    ) or (free is not None and free < needed)
    if not full:
        return exc
    last = list_complete(root)
    return CheckpointError(
        f"saving checkpoint step {step} to {root} failed: the disk is full ({(free or 0) / 2**20:.1f} MiB free on "
        f"its filesystem, the checkpoint takes ~{needed / 2**20:.1f} MiB per rank); free space or set "
        "train.output_dir to a larger disk. "
        + (
            f"The last complete checkpoint, {last[-1].name}, is intact"
            if last
            else "No earlier checkpoint exists"
        )
    )


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
            todo += [
                failure[0] if isinstance(failure, tuple) else failure
                for failure in e.failures.values()
            ]


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
        return {
            name: object_store.sha256(StoreUrl(directory) / name)
            for name in sorted(object_store.files(directory))
            if re.fullmatch(rf"__{rank}_\d+\.distcp", name)
        }
    return {p.name: file_sha256(p) for p in sorted(Path(directory).glob(f"__{rank}_*.distcp"))}


class AsyncWriter:
    """The asynchronous save (checkpoint.async_save): the state is staged (copied) to CPU memory by
    DCP's stager, pinned on CUDA, before `write` returns, so training may change it at once; one
    background thread then writes the shard files (dcp.save), hashes them and, once every rank's are
    written, publishes the checkpoint (`publish`), saves in order.

    That thread runs at the lowest CPU priority (nice 19; Linux): on a machine whose cores the ranks
    keep busy, a save's CPU time (serializing, writing, hashing) is taken from training whatever
    runs it, and at low priority it is taken mostly where a rank waits (its all-reduce), spread over
    more steps instead of slowing a few. DCP's own async_save runs the write in a thread it creates,
    which can't be given a priority; its process-based saver (AsyncCheckpointerType.PROCESS) spawns
    a torch-importing process per rank at the first save and stages through shared memory (64 MB in
    a default Docker container). Of the three, a step while writing slows least with this thread
    (benchmarks/checkpoint_async.py; the figures: docs/benchmarks.md#pipelinecheckpointdcppy). A
    thread keeps the GIL for the pickling parts of a write, so the training thread still waits on it
    now and then.

    The thread's collectives (DCP's planning and metadata exchange, the publish's barrier and
    digests) run on a process group of their own: collectives from two threads on the training's
    group could interleave with DDP's all-reduces and pair the wrong calls across ranks. Created
    collectively (every rank), closed at the end of training. A crash before the publish leaves the
    previous checkpoint, as a synchronous save does."""

    NICE = 19

    def __init__(self, info: DistInfo):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.group = torch.distributed.new_group(backend="gloo") if info.distributed else None
        cuda = info.device.type == "cuda"
        # Pinned buffers, kept across saves, make the copy from the GPU fast; on a CPU the copy is a
        # memcpy.
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=False,
            )
        )
        # One thread, so a save's publish runs after its write, and saves publish in order.
        self.worker = ThreadPoolExecutor(
            1, thread_name_prefix="checkpoint-writer", initializer=_lowest_priority
        )

    def write(self, state: dict, directory: Path, info: DistInfo) -> Future:
        """Stages `state` and starts writing it; the future gives this rank's shard digests once
        written."""
        staged = self.stager.stage(state)
        # async staging is off: this is for another stager
        if isinstance(staged, Future):
            staged = staged.result()
        return self.worker.submit(self._write_and_hash, staged, directory, info)

    def _write_and_hash(self, staged: dict, directory: Path, info: DistInfo) -> dict[str, str]:
        # One process: DCP's warning that it assumes one process is meant (a catch_warnings here,
        # off the training thread, is safe only then: with no DDP, nothing else changes the filters
        # meanwhile).
        with single_process_quiet() if not info.distributed else contextlib.nullcontext():
            dcp.save(
                staged,
                **dcp_target(directory),
                process_group=self.group,
                no_dist=not info.distributed,
            )
        return shard_digests(directory, info.rank)

    def publish(
        self, pending: PendingSave, info: DistInfo, keep_last: int, protect: tuple
    ) -> Future:
        """The publish of `pending` (finish_save on this writer's group), in the background: a
        future of its path."""
        return self.worker.submit(finish_save, pending, info, keep_last, protect, self.group)

    def close(self) -> None:
        self.worker.shutdown()
        self.stager.close()


def _lowest_priority() -> None:
    """This thread at nice AsyncWriter.NICE (Linux: a thread's own priority); elsewhere it stays as
    it is."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), AsyncWriter.NICE)
    except (
        AttributeError,
        OSError,
    ):
        # no setpriority (Windows), or not allowed: same priority as training
        pass


# What a DCP `.metadata` pickle names (torch 2.13: its index dataclasses, torch.Size, dtypes, the
# layout helper, the checkpoint's path), and nothing else: any other global is a foreign or hostile
# file.
