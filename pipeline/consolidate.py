"""`pipeline consolidate`: a sharded DCP checkpoint -> one `model.safetensors` + `model.json`.

One process, no process group, bounded memory, one pass: every shard file is read front to back once
and hashed as it is read (checked against the COMPLETE marker before anything is published), and the
model's chunks, located by DCP's metadata, are written from the read buffer straight to their places
in a safetensors file whose header was written first (components/shard_stream.py). The optimizer's
bytes are hashed, never decoded. Peak memory (beyond the process baseline): about the largest stored
chunk.

Chunks stored other than as dim-0 slices (no layout trainserve writes) take the older path: the
shards hashed first, then the tensors loaded a few per `dcp.load` call (~2x the largest tensor for
DDP).

Outputs in `<out_dir>/`:
    model.safetensors   keys = the plain model's state_dict() keys, buffers included; floating
                        tensors in --dtype, integer ones (num_batches_tracked) as stored
    model.json          format "trainserve-weights/2", config, model {component, args}, data,
                        task, labels, inputs, code, tensors {name: {shape, dtype}}, sha256, dtype,
                        source {checkpoint, step, world_size, strategy, mlflow_run_id}

No user code is imported: the checkpoint records its model's state manifest (every key, shape and
dtype of the plain model's state_dict), and the shards and the output are checked against it. So
consolidation runs on any machine, and a checkpoint from a shared store can name nothing to import;
its `.metadata` is read by checkpoint/dcp_read.py's restricted unpickler.
Invariant: both are published by rename, model.json last; a model.json on disk describes the
model.safetensors beside it (its sha256 says so), and an interrupted run leaves the previous pair
(or nothing) in place, never a half-written file.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import errno
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from pipeline import checkpoint
from pipeline.artifact import weights as weights_bundle
from pipeline.artifact.safetensors_writer import StreamingWriter, TensorSpec, file_order, total_size
from pipeline.checkpoint import dcp_read, shard_stream
from pipeline.checkpoint import run_dir as run_dir_owner
from pipeline.checkpoint.dcp import FORMAT as DCP_FORMAT
from pipeline.checkpoint.dcp_read import CachedMetadataReader
from pipeline.checkpoint.object_store import is_url
from pipeline.checkpoint.run_dir import pid_alive
from pipeline.components.amp import DTYPES
from pipeline.components.monitor import read_best
from pipeline.config import DEFAULT_OUTPUT_DIR
from pipeline.errors import (
    CheckpointError,
    # raised here, defined with the others
    ConsolidateError,  # noqa: F401
)
from pipeline.tools import logs, stopping
from pipeline.tracking import TrackingError, close_if_orphaned, get_run, log_consolidated, use_store
from serving.lineage import file_sha256

log = logging.getLogger(__name__)

# the bundle's format: weights.py
WEIGHTS, DESCRIPTION = (
    weights_bundle.WEIGHTS_FILE,
    weights_bundle.META_FILE,
)
ARTIFACT_PATH = "consolidated"
# NaN/Inf are counted this many elements at a time: torch.isfinite on a whole tensor would
# allocate a bool per element (a quarter of an fp32 tensor) on top of the tensor.
FINITE_BLOCK = 1 << 20
# where --run-id downloads and writes
OUTPUTS = Path(DEFAULT_OUTPUT_DIR)


def main(
    checkpoint_path: str | Path | None = None,
    *,
    latest: bool = False,
    run_id: str | None = None,
    output: str | Path | None = None,
    dtype: str = "fp32",
    tracking_uri: str = "",
    log_to_mlflow: bool = True,
) -> Path:
    """Consolidates one checkpoint; returns the path of model.safetensors.

    `checkpoint_path` is a checkpoint directory (step_*/), or a run directory: its best checkpoint
    (checkpoints/best.json), or with `latest=True` its newest complete one. Without a path, `run_id`
    downloads the run's best checkpoint from MLflow (`latest`: its final one). Outputs go to
    `output`, else `<run_dir>/consolidated`, else (run id) `outputs/<run_id>/consolidated`; they are
    logged to the source's MLflow run unless told not to.
    """
    started = time.perf_counter()
    if dtype not in DTYPES:
        raise ConsolidateError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    if checkpoint_path is None and run_id is None:
        raise ConsolidateError(
            "nothing to consolidate: give a checkpoint directory, a run directory, or --run-id"
        )
    fetched = checkpoint_path is None or is_url(checkpoint_path)
    if checkpoint_path is None:
        use_store(tracking_uri)
        ckpt = _download(run_id, latest)
    elif is_url(checkpoint_path):
        # an object store: fetched (and verified) into outputs/downloaded/, then as local
        from pipeline.checkpoint.store import fetch_checkpoint

        ckpt = fetch_checkpoint(str(checkpoint_path), OUTPUTS / "downloaded", latest)
    else:
        ckpt = resolve_checkpoint(Path(checkpoint_path), latest)
    meta = checkpoint.read_meta(ckpt)
    run_id = run_id or meta.get("mlflow_run_id")
    # fail in seconds on a bad store or run, not after the work
    if log_to_mlflow and run_id:
        use_store(
            tracking_uri
            or ((meta.get("config") or {}).get("tracking") or {}).get("tracking_uri", "")
        )
        get_run(run_id)
        # a training killed outright (plain torchrun) left it RUNNING
        close_if_orphaned(run_id)
    out_dir = Path(output) if output else default_output_dir(ckpt, run_id if fetched else None)
    # a training (or run) still writing there stops us, by name
    run_dir_owner.claim_for_output(out_dir)

    reader = CachedMetadataReader(ckpt)
    specs = plan_tensors(ckpt, reader.metadata, meta, DTYPES[dtype])
    weights = out_dir / WEIGHTS
    tmp = _prepare_output(out_dir, total_size(specs))
    try:
        # The one file every later stage trusts starts from intact shards: each is hashed against
        # its marker (while it is read, in the one pass; a download was also verified as it
        # arrived).
        sha = write_weights(tmp, reader, specs, ckpt)
        verify_file(tmp, specs, manifest_of(ckpt, meta))
        description = weights_bundle.describe(meta, ckpt, specs, sha, dtype)
        _publish(out_dir, tmp, description)
    finally:
        tmp.unlink(missing_ok=True)

    log.info(
        "consolidated %d tensors (%.1f MB, %s) from %s in %.1f s -> %s (sha256 %s)",
        len(specs),
        sum(s.nbytes for s in specs) / 1e6,
        dtype,
        ckpt,
        time.perf_counter() - started,
        weights,
        sha[:12],
    )
    if log_to_mlflow and run_id:
        log_to_run(run_id, out_dir, sha)
    elif log_to_mlflow:
        log.info(
            "the checkpoint names no MLflow run (mlflow_run_id) and no --run-id was given: not logged"
        )
    return weights


# --- input ----------------------------------------------------------------------------------


def resolve_checkpoint(path: Path, latest: bool = False) -> Path:
    """A checkpoint directory as given; of a run directory, its best checkpoint (best.json), or the
    newest complete one with `latest` or when the run recorded no best."""
    if not path.exists():
        raise CheckpointError(f"'{path}' does not exist")
    if (path / checkpoint.MARKER).exists() or (path / ".metadata").exists():
        checkpoint.verify_complete(path)
        return path
    if path.is_dir() and checkpoint.STEP_DIR.match(path.name):
        # names what is missing: no marker, no .metadata
        checkpoint.verify_complete(path)
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = checkpoint.latest(root)
    if found is None:
        raise CheckpointError(
            f"'{path}' holds no complete checkpoint (expected checkpoints/step_*/ "
            f"with a {checkpoint.MARKER} marker): was training interrupted before the first save?"
        )
    best = None if latest else read_best(root)
    if best:
        chosen = root / best["checkpoint"]
        checkpoint.verify_complete(chosen)
        log.info(
            "taking the best checkpoint %s (%s %.6g at step %s); the newest is %s (--latest to take it)",
            chosen.name,
            best["metric"],
            best["value"],
            best["step"],
            found.name,
        )
        return chosen
    log.info(
        "taking the newest checkpoint %s%s",
        found.name,
        "" if latest else " (the run recorded no best)",
    )
    return found


def default_output_dir(ckpt: Path, downloaded_run_id: str | None) -> Path:
    if downloaded_run_id:
        return OUTPUTS / downloaded_run_id / "consolidated"
    ckpt = ckpt.resolve()
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent
    return run_dir / "consolidated"


def _download(run_id: str, latest: bool) -> Path:
    from pipeline.checkpoint.store import download_checkpoint

    return download_checkpoint(run_id, OUTPUTS / "downloaded", latest)


def plan_tensors(
    ckpt: Path, metadata: Metadata, meta: dict, dtype: torch.dtype
) -> list[TensorSpec]:
    """What the file will hold, in file order, after checking the checkpoint against the model's
    state manifest recorded at save: same keys, same shapes, floating where the model is
    floating."""
    expected = manifest_of(ckpt, meta)
    dcp_read.check_compatible(ckpt, {k: _Shape(v["shape"]) for k, v in expected.items()}, metadata)
    specs = []
    for name, want in expected.items():
        md = metadata.state_dict_metadata[f"model.{name}"]
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(
                f"checkpoint '{ckpt}': model.{name} is stored as bytes, not a tensor"
            )
        stored = md.properties.dtype
        if stored.is_floating_point != _DTYPES[want["dtype"]].is_floating_point:
            raise CheckpointError(
                f"checkpoint '{ckpt}': model.{name} is stored as {stored}, the model "
                f"has {want['dtype']}: metadata from another model?"
            )
        specs.append(
            TensorSpec(name, tuple(md.size), dtype if stored.is_floating_point else stored)
        )
    return file_order(specs)


class _Shape:
    """What check_compatible reads of a model tensor: its shape."""

    def __init__(self, shape):
        self.shape = tuple(shape)


def manifest_of(ckpt: Path, meta: dict) -> dict[str, dict]:
    manifest = meta.get("model_state")
    if not isinstance(manifest, dict) or not manifest:
        fmt = meta.get("format", "unknown")
        raise CheckpointError(
            f"checkpoint '{ckpt}': {checkpoint.META} (format {fmt}) records no model_state "
            f"manifest; it was saved by a trainserve before components ({DCP_FORMAT} has "
            "it): retrain, or consolidate it with the trainserve that saved it"
        )
    for name, entry in manifest.items():
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("shape"), list)
            and entry.get("dtype") in _DTYPES
        ):
            raise CheckpointError(
                f"checkpoint '{ckpt}': {checkpoint.META} model_state entry {name!r} is malformed "
                f"(expected {{shape: [...], dtype: one of {sorted(_DTYPES)}}})"
            )
    return manifest


_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


# --- output ---------------------------------------------------------------------------------


def _prepare_output(out_dir: Path, size: int) -> Path:
    """Creates `out_dir`, checks it can take `size` bytes, and returns the temporary file's path."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".probe-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise ConsolidateError(
            f"output directory '{out_dir}' can't be written ({exc.strerror or exc}); "
            "choose another with --output"
        ) from None
    _remove_stale_temporaries(out_dir)
    free = shutil.disk_usage(out_dir).free
    if free < size:
        raise ConsolidateError(
            f"not enough disk space in '{out_dir}': {WEIGHTS} needs {size / 1e6:.1f} MB, "
            f"{free / 1e6:.1f} MB free; free some space or choose another --output"
        )
    return out_dir / f".{WEIGHTS}.tmp-{os.getpid()}"


def _remove_stale_temporaries(out_dir: Path) -> None:
    """Temporaries left by a consolidation that was killed (SIGKILL skips every `finally`)."""
    for stale in out_dir.glob(f".{WEIGHTS}.tmp-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not pid_alive(int(pid)):
            stale.unlink(missing_ok=True)


def _batches(specs: list[TensorSpec]) -> list[list[TensorSpec]]:
    """Groups of tensors loaded by one `dcp.load` call. Each call plans and opens files anew, so
    small tensors share one, up to half the largest tensor in total; a tensor above that gets a
    call of its own. No call then holds more than the largest tensor's load (itself plus the
    chunk DCP's reader materializes before copying it)."""
    budget = max(max((s.nbytes for s in specs), default=0) // 2, 1 << 20)
    batches: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if batches[-1] and size + s.nbytes > budget:
            batches.append([])
            size = 0
        batches[-1].append(s)
        size += s.nbytes
    return [b for b in batches if b]


def write_weights(
    tmp: Path, reader: CachedMetadataReader, specs: list[TensorSpec], ckpt: Path
) -> str:
    """The model's tensors into `tmp`, every shard file verified against its marker's sha256;
    returns the output's sha256. One pass over the shards (shard_stream) where the layout allows,
    else the dcp.load path."""
    layout = shard_stream.plan(reader.metadata, specs, {"format": "pt"})
    if layout is None:
        log.info(
            "chunks not stored as dim-0 slices: reading through dcp.load after verifying the shards"
        )
        checkpoint.verify_checksums(ckpt)
        return write_weights_via_dcp(tmp, reader, specs, ckpt)
    return write_weights_one_pass(tmp, layout, specs, ckpt)


def write_weights_one_pass(tmp: Path, layout, specs: list[TensorSpec], ckpt: Path) -> str:
    """Each shard file read and hashed once, the model's chunks written to their places in `tmp` on
    the way; then the shards' digests checked against the marker (before anything is published) and
    the output hashed."""
    header, pieces = layout
    listing = checkpoint.verify_complete(ckpt)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as exc:
        raise _write_error(exc, tmp) from None
    try:
        os.ftruncate(fd, len(header) + sum(s.nbytes for s in specs))
        digests = shard_stream.copy_hashed(
            ckpt,
            header,
            pieces,
            fd,
            _nonfinite,
            lambda name, nan, inf, dtype: _refuse_nonfinite(name, nan, inf, dtype, ckpt),
            _return_freed_memory,
        )
        os.fsync(fd)
    except OSError as exc:
        raise _write_error(exc, tmp) from None
    finally:
        os.close(fd)
    checkpoint.check_digests(ckpt, listing, digests)
    return file_sha256(tmp)


def write_weights_via_dcp(
    tmp: Path, reader: CachedMetadataReader, specs: list[TensorSpec], ckpt: Path
) -> str:
    """Streams the model's tensors into `tmp`, a few per `dcp.load` call; returns the file's
    sha256."""
    stored = reader.metadata.state_dict_metadata
    try:
        writer = StreamingWriter(tmp, specs, {"format": "pt"})
    except OSError as exc:
        raise _write_error(exc, tmp) from None
    try:
        for batch in _batches(specs):
            # Empty tensors built from the metadata: DCP loads into them in place, and it reads only
            # the chunks they need, from whichever shard files hold them (any world size, DDP or
            # FSDP).
            state = {
                f"model.{s.name}": torch.empty(
                    stored[f"model.{s.name}"].size, dtype=stored[f"model.{s.name}"].properties.dtype
                )
                for s in batch
            }
            _load(state, reader, ckpt)
            for s in batch:
                tensor = state.pop(f"model.{s.name}").to(s.dtype)
                # after the cast: fp16 overflows to Inf past 65504
                _check_finite(s.name, tensor, ckpt)
                writer.write(s.name, tensor)
                # before the next one: one big tensor at a time
                del tensor
            _return_freed_memory()
        sha = writer.close()
    except OSError as exc:
        writer.abort()
        raise _write_error(exc, tmp) from None
    except BaseException:
        writer.abort()
        raise
    # what was streamed is what is on disk
    if file_sha256(tmp) != sha:
        raise ConsolidateError(
            f"'{tmp}' changed on disk while it was written (sha256 differs); try again"
        )
    return sha


def _return_freed_memory() -> None:
    """glibc keeps freed blocks under its adaptive mmap threshold (up to 32 MB) in the heap, where
    they stay resident: a batch of small tensors would add its size to the next big tensor's
    peak."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def _find_malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        # not glibc (macOS, musl): nothing to trim
        return None


_malloc_trim = _find_malloc_trim()


def _load(state: dict[str, torch.Tensor], reader: CachedMetadataReader, ckpt: Path) -> None:
    try:
        with dcp_read.single_process_quiet():
            dcp.load(
                state,
                storage_reader=reader,
                planner=dcp_read.WeightsOnlyLoadPlanner(),
                no_dist=True,
            )
    except (Exception, CheckpointException) as exc:
        # CheckpointException is a BaseException
        files = sorted(
            {
                info.relative_path
                for index, info in reader.metadata.storage_data.items()
                if index.fqn in state
            }
        )
        raise CheckpointError(
            f"checkpoint '{ckpt}': reading {', '.join(list(state)[:3])}"
            f"{' ...' if len(state) > 3 else ''} from {', '.join(files)} failed: shard "
            f"file corrupt or truncated? ({dcp_read.first_failure(exc)})"
        ) from exc


def _check_finite(name: str, tensor: torch.Tensor, ckpt: Path) -> None:
    nan, inf = _nonfinite(tensor)
    if nan or inf:
        _refuse_nonfinite(name, nan, inf, tensor.dtype, ckpt)


def _nonfinite(tensor: torch.Tensor) -> tuple[int, int]:
    """(NaN count, Inf count) of a tensor (0, 0 for integers), FINITE_BLOCK elements at a time."""
    if not tensor.is_floating_point():
        return 0, 0
    flat = tensor.reshape(-1)
    if all(bool(torch.isfinite(block).all()) for block in flat.split(FINITE_BLOCK)):
        return 0, 0
    nan = inf = 0
    # one pass: each block read once, for both counts
    for block in flat.split(FINITE_BLOCK):
        nan += int(torch.isnan(block).sum())
        inf += int(torch.isinf(block).sum())
    return nan, inf


def _refuse_nonfinite(name: str, nan: int, inf: int, dtype: torch.dtype, ckpt: Path) -> None:
    hint = (
        "values outside fp16's range (±65504) became Inf: use --dtype bf16 or fp32"
        if dtype == torch.float16
        else "training diverged before this checkpoint, consolidate an earlier one"
    )
    raise ConsolidateError(
        f"checkpoint '{ckpt}': tensor '{name}' holds {nan} NaN and {inf} Inf values "
        f"as {str(dtype).removeprefix('torch.')}; {hint}"
    )


def _write_error(exc: OSError, path: Path) -> ConsolidateError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return ConsolidateError(
            f"disk full while writing '{path.parent / WEIGHTS}' ({exc.strerror}); "
            "nothing was published; free some space or choose another --output"
        )
    return ConsolidateError(
        f"can't write '{path}' ({exc.strerror or exc}); choose another --output"
    )


def verify_file(path: Path, specs: list[TensorSpec], manifest: dict[str, dict]) -> None:
    """Re-reads the written file's header: one safetensors accepts, and exactly the manifest's keys
    and shapes (so the model loads it with strict=True; the tests load it). Its sha256 was taken
    from the disk already."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        written = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
    if set(written) != {s.name for s in specs}:
        raise ConsolidateError(f"'{path}': written keys differ from the planned ones")
    wrong = [n for n, shape in written.items() if manifest[n]["shape"] != shape]
    if set(written) != set(manifest) or wrong:
        raise ConsolidateError(
            f"'{path}' does not match the model's state manifest: keys "
            f"{sorted(set(written) ^ set(manifest))[:5]}, shapes {wrong[:5]}"
        )


def _publish(out_dir: Path, tmp_weights: Path, description: dict) -> None:
    """Renames the weights into place, then writes model.json: an old model.json is removed first
    so that it never sits beside weights it does not describe."""
    weights, desc = out_dir / WEIGHTS, out_dir / DESCRIPTION
    tmp_desc = out_dir / f".{DESCRIPTION}.tmp-{os.getpid()}"
    try:
        checkpoint.write_json_durably(tmp_desc, description)
        desc.unlink(missing_ok=True)
        os.replace(tmp_weights, weights)
        os.replace(tmp_desc, desc)
        checkpoint.fsync_dir(out_dir)
    except OSError as exc:
        raise _write_error(exc, tmp_desc) from None
    finally:
        tmp_desc.unlink(missing_ok=True)


# --- MLflow ---------------------------------------------------------------------------------


def log_to_run(run_id: str, out_dir: Path, sha: str) -> None:
    """Both files under `consolidated/` of the source run; the stage done, the weights' sha256 in
    its lineage."""
    log_consolidated(run_id, out_dir, (WEIGHTS, DESCRIPTION), ARTIFACT_PATH, {"sha256": sha})
    log.info("logged %s and %s to run %s under %s/", WEIGHTS, DESCRIPTION, run_id, ARTIFACT_PATH)


# --- CLI ------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        nargs="?",
        metavar="CHECKPOINT_DIR | RUN_DIR",
        help="a checkpoint directory (step_*/), or a run directory (its best checkpoint); local, or on an object store (s3://...)",
    )
    parser.add_argument(
        "--latest",
        action="store_true",
        help="take the run's newest complete checkpoint instead of its best",
    )
    parser.add_argument(
        "--run-id",
        help="MLflow run: without a path, download its best checkpoint; "
        "with one, the run to log to (default: the checkpoint's own run)",
    )
    parser.add_argument(
        "--output",
        help="output directory (default: <run_dir>/consolidated, "
        "or outputs/<run_id>/consolidated with --run-id)",
    )
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="fp32",
        help="dtype of the floating tensors in the file (integer buffers stay as they are)",
    )
    parser.add_argument(
        "--tracking-uri",
        default="",
        help="MLflow tracking URI (default: the checkpoint's "
        "config, else $MLFLOW_TRACKING_URI, else ./mlflow.db)",
    )
    parser.add_argument("--no-log", action="store_true", help="don't log the result to MLflow")


def cli(args: argparse.Namespace) -> int:
    logs.configure()
    # a stop runs the `finally`s that remove temporaries
    stopping.exit_on_sigterm()
    try:
        path = main(
            args.source,
            latest=args.latest,
            run_id=args.run_id,
            output=args.output,
            dtype=args.dtype,
            tracking_uri=args.tracking_uri,
            log_to_mlflow=not args.no_log,
        )
    except (CheckpointError, TrackingError, ConsolidateError, run_dir_owner.RunDirBusy) as exc:
        print(f"pipeline consolidate: error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0
