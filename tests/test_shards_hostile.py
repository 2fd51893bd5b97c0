"""A split in a shared store that someone else can write, read the way training reads it: its
identity covers everything a reader checks or hands to the model (row-group digests, class names,
model arguments); a shard whose row groups would decode to more than the manifest declares, or a
manifest whose counts or shapes do not fit, is a DataError before the cost is paid (never an
IndexError, OverflowError or a gigabyte); and `pipeline data shard` never writes through a link
planted in its output.

Splits are written in-process (256 samples of 1x8x8, row groups of 32: a fraction of a second); the
one CLI run is `pipeline data shard` on tests/configs/tiny.yaml."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import TINY, run_cli

from pipeline.errors import DataError
from pipeline.shards import format as shard_format
from pipeline.shards.stream import Deal, ShardedStream, ShardRows, row_order

ROWS, GROUP = 256, 32


def write(location: Path, seed: int = 0) -> shard_format.Manifest:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(ROWS, 1, 8, 8, generator=g)
    return shard_format.write_split(
        ((i, x[i], torch.tensor(i % 10)) for i in range(ROWS)),
        str(location),
        rows_per_group=GROUP,
        classes=[str(c) for c in range(10)],
        model_args={"in_channels": 1},
    )


def edit(location: Path, change) -> None:
    path = location / "manifest.json"
    body = json.loads(path.read_text())
    change(body)
    path.write_text(json.dumps(body))


def read_an_epoch(location: Path) -> int:
    """What a rank's loader does (no workers): the manifest, the store check, the micro-batches of
    epoch 0."""
    stream = ShardedStream(str(location)).dealt(
        Deal(batch=8, rank=0, world=1, seed=0, where=torch.zeros(2, dtype=torch.int64))
    )
    return sum(1 for _ in stream)


# --- F5: the identity ---------------------------------------------------------------------------


def test_a_splits_identity_covers_its_row_group_digests_class_names_and_model_args(tmp_path):
    """The review's shards_identity.py: samples changed in place and their row group's digest
    rewritten in the manifest kept the identity (what a resume, MLflow's dataset and `pipeline
    verify` compare) while training read them; so did reversed class names and other model
    arguments. Each now changes it; the profile and the source, which only describe the split, do
    not."""
    split = tmp_path / "train"
    before = write(split).digest
    shard = split / "shard-00000.parquet"
    columns = shard_format.read_manifest(str(split)).columns
    # samples 40..47 (row group 1) with a trigger written over their bytes, the file's size
    # unchanged
    data = bytearray(shard.read_bytes())
    group = shard_format.decode(pq.ParquetFile(shard).read_row_group(1), columns)
    for row in group["input"][8:16]:
        at = data.find(row.tobytes())
        data[at : at + 64] = np.ones(16, np.float32).tobytes()
    shard.write_bytes(bytes(data))
    changed = shard_format.content_digest(pq.ParquetFile(shard).read_row_group(1), columns)
    edit(split, lambda b: b["shards"][0]["row_groups"][1].update(sha256=changed))
    # the changed samples read without a word: their digest agrees
    assert read_an_epoch(split) == ROWS // 8
    samples = shard_format.read_manifest(str(split)).digest
    assert samples != before

    edit(split, lambda b: b.update(classes=list(reversed(b["classes"]))))
    classes = shard_format.read_manifest(str(split)).digest
    edit(split, lambda b: b.update(model_args={"mean": [0.9], "std": [0.01]}))
    model_args = shard_format.read_manifest(str(split)).digest
    assert len({before, samples, classes, model_args}) == 4

    edit(split, lambda b: b.update(targets={"made": "up"}, source={"component": "elsewhere"}))
    assert shard_format.read_manifest(str(split)).digest == model_args


# --- F7: memory bounded by the declared size before anything is decoded or permuted --------------


def test_a_compressed_row_group_is_refused_before_it_is_decoded(tmp_path):
    """The review's bomb: a tiny shard whose one row group zstd-decodes to millions of rows, the
    manifest made to agree on rows and bytes, cost gigabytes before its digest check
    (docs/benchmarks.md#teststest_shards_hostilepy). The writer
    writes no compression: a compressed chunk is refused from the footer, before a byte is decoded
    (here 400,000 rows, 100 MiB decoded)."""
    split = tmp_path / "train"
    write(split)
    rows = 400_000
    table = pa.table(
        {
            "id": pa.array(np.zeros(rows, np.int64)),
            "input": pa.FixedSizeBinaryArray.from_buffers(
                pa.binary(256), rows, [None, pa.py_buffer(bytes(256 * rows))]
            ),
            "target": pa.FixedSizeBinaryArray.from_buffers(
                pa.binary(8), rows, [None, pa.py_buffer(bytes(8 * rows))]
            ),
        }
    )
    shard = split / "shard-00000.parquet"
    pq.write_table(table, shard, row_group_size=rows, compression="zstd", write_statistics=False)
    size = shard.stat().st_size
    assert size < 100_000
    edit(
        split,
        lambda b: (
            b["shards"][0].update(
                rows=rows, bytes=size, row_groups=[{"rows": rows, "sha256": "0" * 64}]
            ),
            b.update(rows=rows),
        ),
    )
    with pytest.raises(DataError) as caught:
        ShardRows(str(split))[0]
    assert str(caught.value) == (
        f"shard {split}/shard-00000.parquet row group 0: column 'id' is ZSTD-compressed; a split's "
        "shards are written uncompressed (`pipeline data shard`), so its decoded size can't be "
        "known before it is decoded: restore the shard, or write the split again with "
        "`pipeline data shard`"
    )


def test_declared_row_counts_are_checked_against_the_footer_before_any_permutation(tmp_path):
    """Every row group declared at 20,000,000 rows (the file holds 32 each): the epoch's order
    permuted the declared rows before the shard was opened (what that cost the review:
    docs/benchmarks.md#teststest_shards_hostilepy). Now the shard is opened and its footer counted
    first: a DataError, and no permutation made."""
    split = tmp_path / "train"
    write(split)
    n = 20_000_000
    edit(
        split,
        lambda b: (
            [g.update(rows=n) for g in b["shards"][0]["row_groups"]],
            b["shards"][0].update(rows=8 * n),
            b.update(rows=8 * n),
        ),
    )
    row_order.cache_clear()
    with pytest.raises(
        DataError, match=r"holds 256 rows in 8 row groups; the manifest says 160000000"
    ):
        read_an_epoch(split)
    assert row_order.cache_info().currsize == 0


# --- F8: counts and shapes are data errors ------------------------------------------------------


def test_row_groups_of_other_sizes_than_the_manifests_are_a_data_error_naming_them(tmp_path):
    """48 and 16 rows declared for row groups of 32 and 32 (same total, real digests): an IndexError
    mid-epoch. Now the shard's opening names the group and both counts."""
    split = tmp_path / "train"
    write(split)
    edit(
        split,
        lambda b: (
            b["shards"][0]["row_groups"][0].update(rows=48),
            b["shards"][0]["row_groups"][1].update(rows=16),
        ),
    )
    with pytest.raises(DataError) as caught:
        read_an_epoch(split)
    assert str(caught.value) == (
        f"shard {split}/shard-00000.parquet row group 0 holds 32 rows, the manifest says 48 (row "
        "groups of [32, 32, 32, 32, 32, 32, 32, 32] rows, not [48, 16, 32, 32, 32, 32, 32, 32]): "
        "its rows would be read from the wrong places; restore the shard, or write the split "
        "again with `pipeline data shard`"
    )


@pytest.mark.parametrize(
    "shape, says",
    [
        ([1 << 40], "4398046511104 bytes a sample"),
        ([1 << 32, 1 << 32], "73786976294838206464 bytes a sample"),
    ],
    ids=["2^40 (OverflowError)", "2^32 x 2^32 (wrapped to 0 as int64)"],
)
def test_a_column_shape_past_what_a_shard_holds_is_a_damaged_manifest(tmp_path, shape, says):
    split = tmp_path / "train"
    write(split)
    edit(split, lambda b: b["columns"][0].update(shape=shape))
    with pytest.raises(DataError) as caught:
        read_an_epoch(split)
    assert "is a damaged shard manifest (column 'input' has the shape" in str(caught.value)
    assert f"{says}, past the 2147483647 a shard's fixed-size column holds" in str(caught.value)


# --- F8: `pipeline data shard` and links planted in a shared --out ---------------------------


def test_pipeline_data_shard_never_writes_through_a_link_planted_in_its_output(tmp_path):
    """A shard's name planted as a link to another file: the review's victim.txt became the Parquet
    shard. Now the shard is written to a new file and renamed over the link (the victim untouched);
    a split's directory planted as a link to elsewhere is refused with one line, exit 2, nothing
    written there."""
    victim, elsewhere = tmp_path / "victim.txt", tmp_path / "elsewhere"
    victim.write_text("a file of someone else's\n")
    elsewhere.mkdir()
    out = tmp_path / "shared-out"
    (out / "train").mkdir(parents=True)
    (out / "train" / "shard-00000.parquet").symlink_to(victim)
    (out / "val").symlink_to(elsewhere)
    proc = run_cli(
        ["data", "shard", "--config", str(TINY), "--out", str(out)], cwd=tmp_path, check=False
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"pipeline data shard: error: can't write the split to {out}/val: {out}/val is a symbolic "
        f"link (to {elsewhere}); the output's directories must be its own: remove the link, or "
        "give another --out"
    )
    assert victim.read_text() == "a file of someone else's\n" and list(elsewhere.iterdir()) == []
    shard = out / "train" / "shard-00000.parquet"
    assert not shard.is_symlink() and pq.ParquetFile(shard).metadata.num_rows > 0
    assert shard_format.read_manifest(str(out / "train")).rows == 1438
    assert sorted(p.name for p in (out / "train").iterdir() if p.name.startswith(".")) == []
