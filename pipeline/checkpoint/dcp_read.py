"""Reading a DCP checkpoint (dcp.py writes them), safely: checkpoints are untrusted input (a shared
MLflow store lets others write them, and the marker's checksums are written by whoever wrote the
files), so nothing in one is unpickled with arbitrary globals. DCP's `.metadata` goes through an
unpickler that admits only DCP's metadata types, and its non-tensor entries (optimizer
hyperparameters) through torch.load(weights_only=True); DCP's own reader already loads tensors that
way. DCP reshards on load: a checkpoint written by N ranks loads into M ranks, DDP or FSDP.
"""

from __future__ import annotations

import contextlib
import io
import logging
import pickle
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import pipeline.checkpoint.object_store as object_store
from pipeline.checkpoint.layout import META, read_meta
from pipeline.checkpoint.object_store import StoreUrl, is_url
from pipeline.distributed import DistInfo

# raised here, defined with the others
from pipeline.errors import CheckpointError  # noqa: F401

log = logging.getLogger(__name__)


@contextlib.contextmanager
def single_process_quiet():
    """DCP warns that one process without a process group is 'assumed' single-process; it is
    meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


def rng_state() -> dict[str, Any]:
    """This process's generators, each whole: torch's CPU generator and this rank's CUDA device's
    (which also carries DTensor's random ops: torch's tensor-parallel RNG tracker keeps its offsets
    in it, no state of its own), numpy's global MT19937 with its cached Gaussian, Python's `random`
    with its own (`python_gauss`: [1, value] when random.gauss holds the second of a pair, else [0,
    0])."""
    np_state = np.random.get_state()
    python_version, python_keys, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": torch.tensor([np_state[2], np_state[3]], dtype=torch.int64),
        "numpy_gauss": torch.tensor([np_state[4]], dtype=torch.float64),
        "python": torch.tensor(python_keys, dtype=torch.int64),
        "python_gauss": torch.tensor(
            [0.0, 0.0] if gauss_next is None else [1.0, gauss_next], dtype=torch.float64
        ),
        **({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {}),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Sets the generators `state` holds (rng_state's keys; a checkpoint from before `python_gauss`
    leaves Python's cached Gaussian empty)."""
    torch.set_rng_state(state["torch"])
    pos, has_gauss = (int(v) for v in state["numpy_pos"])
    np.random.set_state(
        (
            "MT19937",
            state["numpy_keys"].numpy().astype(np.uint32),
            pos,
            has_gauss,
            float(state["numpy_gauss"][0]),
        )
    )
    held, value = state.get("python_gauss", torch.zeros(2, dtype=torch.float64)).tolist()
    random.setstate((3, tuple(int(v) for v in state["python"]), value if held else None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


_METADATA_TYPES = {
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class UnsafeCheckpoint(pickle.UnpicklingError):
    """A checkpoint file names something a checkpoint never holds; it was refused before running
    it."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_TYPES or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(
            f"it names {module}.{name}, which a DCP checkpoint's metadata never holds"
        )


def read_metadata_safely(path: Path) -> Metadata:
    """DCP's index of a checkpoint, unpickled with only DCP's metadata types admitted."""
    try:
        if is_url(path):
            metadata = _MetadataUnpickler(
                io.BytesIO(object_store.read_bytes(StoreUrl(path) / ".metadata"))
            ).load()
        else:
            with open(Path(path) / ".metadata", "rb") as f:
                metadata = _MetadataUnpickler(f).load()
    except UnsafeCheckpoint as exc:
        raise CheckpointError(
            f"checkpoint '{path}': .metadata refused, nothing in it was run: {exc} (a foreign or "
            "hostile file; use a checkpoint your own training wrote)"
        ) from None
    except Exception as exc:
        # a corrupt or truncated .metadata unpickles with any error
        raise CheckpointError(
            f"checkpoint '{path}': .metadata can't be read ({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"checkpoint '{path}': .metadata holds a {type(metadata).__name__}, not DCP metadata"
        )
    _check_storage_paths(path if is_url(path) else Path(path), metadata)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


def _check_storage_paths(path: Path, metadata: Metadata) -> None:
    """Every tensor's data is read from a file inside the checkpoint. DCP writes its shard files
    there and names them relative to it; the unpickler admits any string, and DCP's reader joins it
    to the directory, so an absolute or `../` relative_path would read another run's (or any) file,
    which the marker's checksums, covering only the checkpoint's own files, never see."""
    # on a store: the names alone are judged
    root = Path("/checkpoint") if is_url(path) else path.resolve()
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        relative = getattr(info, "relative_path", None)
        where = getattr(index, "fqn", index)
        if (
            not isinstance(relative, str)
            or not relative
            or Path(relative).is_absolute()
            or ".." in Path(relative).parts
            or not (root / relative).resolve().is_relative_to(root)
        ):
            raise CheckpointError(
                f"checkpoint '{path}': .metadata reads '{where}' from {relative!r:.200}, outside the "
                "checkpoint directory; DCP stores data in files inside it (e.g. '__0_0.distcp'). "
                "A foreign or hostile file: use a checkpoint your own training wrote"
            )


class CachedMetadataReader(FileSystemReader):
    """A FileSystemReader that reads `.metadata` once, safely (see read_metadata_safely). `dcp.load`
    reads it on every call, and with the optimizer's thousands of entries that is a cost each call
    pays again (docs/benchmarks.md#pipelinecheckpointdcp_readpy)."""

    def __init__(self, path: Path):
        super().__init__(str(path))
        self.metadata: Metadata = read_metadata_safely(Path(path))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata


def metadata_reader(path: Path) -> FileSystemReader:
    """The reader `load` uses: CachedMetadataReader, or on an object store the same over DCP's
    FsspecReader."""
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
    """DCP's load planner, except that a non-tensor entry (an optimizer hyperparameter) must first
    load with torch.load(weights_only=True), which refuses any global a plain state dict never
    holds. DCP's own planner unpickles these with weights_only=False."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UnsafeCheckpoint(
                f"entry {read_item.dest_index.fqn} refused, nothing in it was run: {first}"
            ) from None
        value.seek(0)
        super().load_bytes(read_item, value)


def check_compatible(
    path: Path,
    model_sd: dict[str, Any],
    metadata: Metadata,
    held_elsewhere: frozenset[str] = frozenset(),
) -> None:
    """Refuses a checkpoint whose model keys or shapes differ from the model's: never a partial
    load. A pipeline stage loads its own keys; those of the other stages (`held_elsewhere`) are
    expected in the checkpoint."""
    stored = {
        k[len("model.") :]: tuple(v.size)
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith("model.") and hasattr(v, "size")
    }
    wanted = {k: tuple(v.shape) for k, v in model_sd.items()}
    missing = sorted(set(wanted) - set(stored))
    extra = sorted(set(stored) - set(wanted) - held_elsewhere)
    shapes = sorted(k for k in set(wanted) & set(stored) if wanted[k] != stored[k])
    if missing or extra or shapes:
        lines = [f"checkpoint '{path}' does not match the model being built:"]
        lines += [f"  missing in checkpoint: {k} {list(wanted[k])}" for k in missing[:20]]
        lines += [f"  not in model: {k} {list(stored[k])}" for k in extra[:20]]
        lines += [
            f"  shape differs: {k} checkpoint {list(stored[k])} vs model {list(wanted[k])}"
            for k in shapes[:20]
        ]
        lines.append(
            "  check that model.* and data.* match the config the checkpoint was trained with "
            f"(see {Path(path) / META})"
        )
        raise CheckpointError("\n".join(lines))


def load(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    info: DistInfo,
    held_elsewhere: frozenset[str] = frozenset(),
) -> dict:
    """Collective. Loads model (+ optimizer, + this rank's RNG when present) in place; returns the
    meta.

    DCP reshards on load, so a checkpoint written by N ranks loads into M ranks, DDP or FSDP.
    """
    path = path if is_url(path) else Path(path)
    meta = read_meta(path)
    # .metadata unpickled once, for the check and for the load
    reader = metadata_reader(path)
    metadata = reader.metadata
    options = StateDictOptions(
        strict=True, flatten_optimizer_state_dict=optimizer_flattened(metadata)
    )
    model_sd, optim_sd = (
        get_state_dict(model, optimizer, options=options)
        if optimizer is not None
        else (get_state_dict(model, [], options=options)[0], None)
    )
    check_compatible(path, model_sd, metadata, held_elsewhere)
    state: dict[str, Any] = {"model": model_sd}
    if optim_sd is not None:
        state["optim"] = optim_sd
    rng_key = f"rank{info.rank}"
    # Only the generators the checkpoint holds: DCP refuses to load a key it lacks, and a checkpoint
    # written on CPU has no `cuda` state for a resume on a GPU node (which then keeps its fresh CUDA
    # seed).
    stored = {
        k.removeprefix(f"rng.{rng_key}.")
        for k in metadata.state_dict_metadata
        if k.startswith(f"rng.{rng_key}.")
    }
    has_rng = bool(stored)
    # a rank that did not exist in the saving world keeps its fresh seed
    if has_rng:
        state["rng"] = {rng_key: {name: t for name, t in rng_state().items() if name in stored}}
    try:
        with single_process_quiet():
            dcp.load(
                state,
                storage_reader=reader,
                planner=WeightsOnlyLoadPlanner(),
                no_dist=not info.distributed,
            )
    except (Exception, CheckpointException) as exc:
        # DCP's is a BaseException; name the checkpoint
        raise CheckpointError(
            f"checkpoint '{path}' could not be read: {first_failure(exc)}"
        ) from exc
    set_state_dict(
        model,
        optimizer if optimizer is not None else [],
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
        options=options,
    )
    if has_rng:
        set_rng_state(state["rng"][rng_key])
    return meta


def optimizer_flattened(metadata: Metadata) -> bool:
    """Whether the optimizer state was saved by parameter (`optim.param_groups.<fqn>.lr`, what
    dcp.py writes) or nested (`optim.param_groups.<i>.params`, checkpoints written before pipeline
    parallelism)."""
    return not any(
        k.startswith("optim.param_groups.") and k.endswith(".params")
        for k in metadata.state_dict_metadata
    )


def first_failure(exc: BaseException) -> str:
    """The reader's own error, not DCP's per-rank wrapper around it."""
    if isinstance(exc, CheckpointException) and exc.failures:
        exc = next(iter(exc.failures.values()))
        exc = exc[0] if isinstance(exc, tuple) else exc
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
