"""Checkpoints: written by every rank at once, published atomically, described by themselves, read
back safely.

    layout.py        the storage layout, on local disk and on an object store alike: step
                     directories, the COMPLETE marker, publish, list, prune, set aside
    formats.py       the CheckpointFormat protocol and the registry of formats (save writes the
                     newest, load reads the one a checkpoint names)
    dcp.py           the format: torch.distributed.checkpoint, sharded, saved in the foreground or
                     the background
    dcp_read.py      reading it safely (a restricted unpickler for DCP's metadata, weights-only
                     loads)
    saver.py         when the training loop saves, and what it says
    uploads.py       checkpoints uploaded to MLflow in the background
    store.py         checkpoints to and from the tracking server or an object store; --resume
                     resolved
    object_store.py  a run directory on an object store (train.output_dir=s3://...)
    run_dir.py       one owner per run directory
    shard_stream.py  DCP shards read a tensor at a time (consolidation's bounded memory)

What the stages use is named here: the layout's functions, the format-independent save and load, and
the process's random generators as a checkpoint holds them (rng_state, set_rng_state).
"""

from pipeline.checkpoint.dcp_read import rng_state, set_rng_state  # noqa: F401
from pipeline.checkpoint.formats import load, save  # noqa: F401
from pipeline.checkpoint.layout import (  # noqa: F401
    MARKER,
    META,
    STEP_DIR,
    check_digests,
    clear_incomplete,
    fsync_dir,
    latest,
    list_complete,
    read_meta,
    set_aside_after,
    step_dir_name,
    verify_checksums,
    verify_complete,
    write_json_durably,
)
from pipeline.errors import CheckpointError  # noqa: F401

__all__ = [
    "CheckpointError",
    "MARKER",
    "META",
    "STEP_DIR",
    "check_digests",
    "clear_incomplete",
    "fsync_dir",
    "latest",
    "list_complete",
    "load",
    "read_meta",
    "rng_state",
    "save",
    "set_rng_state",
    "set_aside_after",
    "step_dir_name",
    "verify_checksums",
    "verify_complete",
    "write_json_durably",
]
