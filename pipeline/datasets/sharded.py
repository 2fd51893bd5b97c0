"""Sharded splits, streamed: `data: {name: sharded, args: {root: <dir or s3://bucket/prefix>}}`.

`root` holds `train/` and `val/`, each a split as `pipeline data shard` writes it
(pipeline/shards/format.py); or name each split's directory (or manifest.json) with `train` and
`val`. The training split streams (pipeline/shards/stream.py: shuffled per epoch without a buffer,
an exact position for resume at any world size); the validation split is read map-style, a row group
at a time.
"""

from __future__ import annotations

from pipeline.errors import DataError
from pipeline.shards import format as shard_format
from pipeline.shards.stream import ShardedStream, ShardRows


def sharded(
    root: str | None = None, train: str | None = None, val: str | None = None, check: bool = True
) -> dict:
    """`check`: list the store once and compare every shard's size with the manifest (a missing or
    truncated shard is named before training starts)."""
    if root is None and (train is None or val is None):
        raise DataError(
            "data.args for the sharded data need root: <directory or s3://bucket/prefix holding train/ "
            "and val/>, or both train: and val: (each a split's directory or manifest.json)"
        )
    train = train or shard_format.join(root, "train")
    val = val or shard_format.join(root, "val")
    return {"train": ShardedStream(train, check), "val": ShardRows(val, check)}
