"""Bad sharded input, as a user meets it: a missing or truncated shard, a shard changed in place, a
shard of another schema, a manifest that promises more rows than a shard holds, a manifest that is
missing or not one, `pipeline data shard` given what it can't do, and an object store that fails
under a read of a shard, of the manifest or of the split's listing (not the data: told apart from
damage, and nothing says to rewrite the split). Each is a DataError (the CLI: one line on stderr,
exit 2) that names the shard (and the row group) and says what would be right, raised before
training where a listing can tell, else at the step that reads the damage; and a resume that meets
it leaves the checkpoint it resumed from as valid as it was.

The digits of tests/configs/tiny.yaml are written once by the CLI (train: 1438 rows in 5 shards of 6
row groups of 50, the last 238 rows; val: 359 in 2); each test damages its own copy. Most cases go
through the data component and the training loader in-process (a CLI run costs seconds); the resume
runs the CLI.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from conftest import TINY, model_from_checkpoint, run_cli
from object_store import FaultProxy, moto_s3

from pipeline import checkpoint
from pipeline.components.data import make_train_loader
from pipeline.datasets.sharded import sharded
from pipeline.errors import DataError
from pipeline.plan import BatchPlan
from pipeline.shards import format as shard_format
from pipeline.shards.stream import epoch_order

# tiny.yaml's global batch, one process: step k+1 reads epoch positions [32k, 32k+32)
BATCH = 32
SHARD_ARGS = ["--rows-per-shard", "300", "--rows-per-group", "50"]


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("written")
    run_cli(
        ["data", "shard", "--config", str(TINY), "--out", str(work / "shards"), *SHARD_ARGS],
        cwd=work,
    )
    return work / "shards"


@pytest.fixture
def shards(written: Path, tmp_path: Path) -> Path:
    """A copy of the written splits, this test's to damage."""
    shutil.copytree(written, tmp_path / "shards")
    return tmp_path / "shards"


# --- helpers ------------------------------------------------------------------------------------


def manifest_json(split: Path) -> dict:
    return json.loads((split / "manifest.json").read_text())


def edit_manifest(split: Path, edit) -> None:
    body = manifest_json(split)
    edit(body)
    (split / "manifest.json").write_text(json.dumps(body, indent=1))


def shard_entry(body: dict, name: str) -> dict:
    return next(s for s in body["shards"] if s["name"] == name)


def flip_a_byte(path: Path, group: int) -> None:
    """One byte of row group `group`'s `input` values changed in place, the file's size unchanged:
    Parquet still reads it (no compression, no page checksums), only the content digest can tell."""
    meta = pq.ParquetFile(path).metadata.row_group(group).column(1)
    assert meta.path_in_schema == "input"
    # the chunk starts at its dictionary page
    start = meta.dictionary_page_offset or meta.data_page_offset
    data = bytearray(path.read_bytes())
    data[start + meta.total_compressed_size // 2] ^= 0x5A
    path.write_bytes(bytes(data))


def first_step_reading(
    split: Path, shard: int, group: int | None = None, after: int = 0
) -> int | None:
    """The 0-based step (micro-batch k) of epoch 0, seed 0, at or after `after`, whose batch is the
    first from there to read row group `group` of shard `shard` (any of its row groups: None); None
    if none does."""
    order = epoch_order(shard_format.read_manifest(split), 0, 0)
    for k in range(after, int(order.starts[-1]) // BATCH):
        first, stop = k * BATCH, (k + 1) * BATCH
        for i, (s, g) in enumerate(order.blocks):
            if (
                s == shard
                and group in (None, g)
                and order.starts[i] < stop
                and order.starts[i + 1] > first
            ):
                return k
    return None


def train_until_error(root: Path, workers: int = 0, check: bool = True) -> tuple[int, DataError]:
    """The data component built as training builds it, its training loader iterated over epoch 0:
    (the micro-batches it gave before the error, the error)."""
    train = sharded(str(root), check=check)["train"]
    loader = make_train_loader(train, BatchPlan(rows=BATCH), 0, 0, workers, False)
    given = 0
    with pytest.raises(DataError) as caught:
        for _ in loader:
            given += 1
    return given, caught.value


def one_error_line(proc) -> str:
    """The CLI's answer to bad input: exit 2 and one line on stderr, no traceback."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if " error: " in line]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


# --- (1) (2) a shard missing or truncated: named before training ---------------------------------


def test_a_deleted_shard_is_named_before_training_reads_a_row(written: Path, shards: Path):
    (shards / "train/shard-00003.parquet").unlink()
    with pytest.raises(
        DataError,
        match=r"shard \S+/train/shard-00003\.parquet is missing: the manifest "
        r"\S+/train/manifest\.json names 5 shards; restore it, or write the split "
        r"again with `pipeline data shard`",
    ):
        sharded(str(shards))
    # Unchecked (data.args.check=false), the reader names it at the step that opens it.
    given, error = train_until_error(shards, check=False)
    assert given == first_step_reading(shards / "train", 3)
    assert str(error).startswith(
        f"shard {shards}/train/shard-00003.parquet is missing (the manifest"
    )
    # The validation split is listed too.
    shutil.copy(written / "train/shard-00003.parquet", shards / "train")
    (shards / "val/shard-00001.parquet").unlink()
    with pytest.raises(
        DataError,
        match=r"shard \S+/val/shard-00001\.parquet is missing: the manifest \S+/val/"
        r"manifest\.json names 2 shards",
    ):
        sharded(str(shards))


@pytest.mark.parametrize("keep", [0.5, 0.0])
def test_a_truncated_shard_is_named_before_training_with_both_sizes(shards: Path, keep: float):
    path = shards / "train/shard-00001.parquet"
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[: int(size * keep)])
    with pytest.raises(
        DataError,
        match=rf"shard \S+/train/shard-00001\.parquet is {int(size * keep)} bytes, the "
        rf"manifest says {size}: the shard is truncated; restore it, or write the "
        r"split again with `pipeline data shard`",
    ):
        sharded(str(shards))


def test_a_truncated_shard_whose_manifest_was_made_to_agree_is_named_when_opened(shards: Path):
    path = shards / "train/shard-00001.parquet"
    path.write_bytes(path.read_bytes()[:30000])
    edit_manifest(
        shards / "train", lambda b: shard_entry(b, "shard-00001.parquet").update(bytes=30000)
    )
    given, error = train_until_error(shards)
    assert given == first_step_reading(shards / "train", 1)
    assert "shard-00001.parquet can't be read as Parquet" in str(error)
    assert "truncated or not a shard" in str(error) and "write the split again" in str(error)


def test_a_shard_whose_footer_does_not_parse_is_named_as_not_a_shard_though_pyarrow_raises_oserror(
    shards: Path,
):
    """pyarrow's judgement of a footer it can't decode is a plain OSError (its ArrowIOError is
    OSError), the class a store's failure may have too: still the shard's bytes, still named as a
    damaged shard."""
    path = shards / "train/shard-00001.parquet"
    data = path.read_bytes()
    # the footer's length zeroed, the size kept
    path.write_bytes(data[:-8] + (0).to_bytes(4, "little") + b"PAR1")
    given, error = train_until_error(shards)
    assert given == first_step_reading(shards / "train", 1)
    assert str(error).startswith(
        f"shard {shards}/train/shard-00001.parquet can't be read as Parquet (OSError: "
        "Couldn't deserialize thrift"
    ), str(error)
    assert "truncated or not a shard" in str(error) and "the store failed" not in str(error)


# --- (3) a shard changed in place: named with its row group at the step that reads it -----------


def test_bytes_changed_in_place_are_named_with_the_row_group_at_the_step_that_reads_it(
    shards: Path,
):
    split = shards / "train"
    order = epoch_order(shard_format.read_manifest(split), 0, 0)
    # read first by a later step, not the first (that would prove less)
    shard, group = order.blocks[4]
    path = split / f"shard-{shard:05d}.parquet"
    size = path.stat().st_size
    flip_a_byte(path, group)
    # the listing can't tell
    assert path.stat().st_size == size
    step = first_step_reading(split, shard, group)
    assert step >= 3
    given, error = train_until_error(shards)
    assert given == step, f"the damage is read at step {step + 1}, the error came at {given + 1}"
    assert str(error) == (
        f"shard {split}/{path.name} row group {group} does not match the manifest's digest: the "
        "shard changed since the manifest was written; restore it, or write the split again with "
        "`pipeline data shard`"
    )


def test_bytes_changed_in_place_are_named_in_the_first_line_under_loader_workers(shards: Path):
    split = shards / "train"
    shard, group = epoch_order(shard_format.read_manifest(split), 0, 0).blocks[1]
    flip_a_byte(split / f"shard-{shard:05d}.parquet", group)
    given, error = train_until_error(shards, workers=1)
    assert given == first_step_reading(split, shard, group)
    assert (
        str(error)
        .splitlines()[0]
        .startswith(f"shard {split}/shard-{shard:05d}.parquet row group {group} ")
    )


# --- (4) a shard of another schema ----------------------------------------------------------------


def other_split(where: Path, inputs) -> Path:
    """300 samples of other inputs, written as the CLI writes (300 rows a shard, 50 a row group)."""
    samples = ((i, inputs(), torch.tensor(i % 10)) for i in range(300))
    shard_format.write_split(samples, str(where), rows_per_shard=300, rows_per_group=50)
    return where / "shard-00000.parquet"


@pytest.mark.parametrize(
    "inputs, says",
    [
        (
            lambda: {"image": torch.zeros(1, 8, 8)},
            r"has the columns \['id', 'input\.image', 'target'\]; the manifest's schema is \['id', 'input', 'target'\]",
        ),
        # The same column names, images of 16x16: only the columns' types tell.
        (
            lambda: torch.zeros(1, 16, 16),
            r"has column 'input' of type fixed_size_binary\[1024\]; the manifest's is fixed_size_binary\[256\], which "
            r"holds float32 of shape \[1, 8, 8\]",
        ),
    ],
    ids=["other column names", "other input shape"],
)
def test_a_shard_of_another_schema_is_named_schema_changed_between_shards(
    shards: Path, tmp_path: Path, inputs, says
):
    foreign = other_split(tmp_path / "other", inputs)
    split = shards / "train"
    shutil.copy(foreign, split / "shard-00003.parquet")
    # Whoever copied it in made the manifest's size agree: the listing passes, the reader must tell.
    edit_manifest(
        split, lambda b: shard_entry(b, "shard-00003.parquet").update(bytes=foreign.stat().st_size)
    )
    given, error = train_until_error(shards)
    assert given == first_step_reading(split, 3)
    assert str(error).startswith(f"shard {split}/shard-00003.parquet ")
    assert "the schema changed between shards" in str(error) and "write the split again" in str(
        error
    )
    assert re.search(says, str(error)), str(error)


# --- (5) the manifest promises more rows than a shard holds: the stream would end early ---------


def test_a_manifest_with_more_rows_than_the_shard_holds_is_named_before_the_stream_runs_dry(
    shards: Path,
):
    split = shards / "train"

    def more_rows(body):
        entry = shard_entry(body, "shard-00001.parquet")
        entry["rows"] += 20
        entry["row_groups"][-1]["rows"] += 20

    edit_manifest(split, more_rows)
    # the sizes agree: the shard is opened, and its rows counted
    given, error = train_until_error(shards)
    assert given == first_step_reading(split, 1)
    assert str(error) == (
        f"shard {split}/shard-00001.parquet holds 300 rows in 6 row groups; the manifest says "
        "320 in 6: the stream would end early; restore the shard, or write the split again with "
        "`pipeline data shard`"
    )


def test_a_manifest_whose_shard_rows_disagree_with_its_row_groups_is_refused_before_training(
    shards: Path,
):
    edit_manifest(
        shards / "train", lambda b: shard_entry(b, "shard-00002.parquet").update(rows=320)
    )
    with pytest.raises(
        DataError,
        match=r"manifest\.json is a damaged shard manifest \(shard shard-00002\.parquet "
        r"has 320 rows but its row groups 300",
    ):
        sharded(str(shards))


# --- (6) a manifest missing, not JSON, of another format, damaged --------------------------------


def _write(text: str | bytes):
    def damage(split: Path):
        (split / "manifest.json").write_bytes(text if isinstance(text, bytes) else text.encode())

    return damage


def _edit(edit):
    return lambda split: edit_manifest(split, edit)


FORMAT = re.escape(shard_format.FORMAT)
MANIFESTS = {
    "missing": (
        lambda split: (split / "manifest.json").unlink(),
        r"no shard manifest at \S+/train/manifest\.json: write one with `pipeline data shard --config "
        r"<config> --out \S+/shards`",
    ),
    "split directory missing": (
        lambda split: shutil.rmtree(split),
        r"no shard manifest at \S+/train/manifest\.json",
    ),
    "empty": (
        _write(""),
        r"manifest\.json is not a shard manifest: it is not JSON \(.*\); a split's manifest\.json is "
        rf"the JSON `pipeline data shard` writes \({FORMAT}\): write the split again",
    ),
    "cut short": (
        lambda split: _write((split / "manifest.json").read_text()[:500])(split),
        r"is not JSON",
    ),
    "binary": (_write(b"PAR1\x00\xff\xfe"), r"is not JSON"),
    "a directory": (
        lambda split: ((split / "manifest.json").unlink(), (split / "manifest.json").mkdir()),
        r"can't read the shard manifest \S+manifest\.json \(IsADirectoryError",
    ),
    "a JSON list": (
        _write("[1, 2]"),
        rf"its format is 'none \(a JSON list\)', expected '{FORMAT}'; "
        r"write the split again with `pipeline data shard`",
    ),
    "another format": (
        _edit(lambda b: b.update(format="trainserve.shards/0")),
        rf"its format is 'trainserve\.shards/0', expected '{FORMAT}'",
    ),
    "no shards key": (
        _edit(lambda b: b.pop("shards")),
        r"damaged shard manifest \(KeyError: 'shards'\)",
    ),
    "rows not a count": (
        _edit(lambda b: b["shards"][0].update(rows="300")),
        r"damaged shard manifest \(shard shard-00000\.parquet has rows '300', not a count\)",
    ),
    "a shard outside the split": (
        _edit(lambda b: b["shards"][0].update(name="../val/shard-00000.parquet")),
        r"shard 0 is named '\.\./val/shard-00000\.parquet'; a shard is a file of the "
        r"split's own directory",
    ),
    "structure disagrees with the columns": (
        _edit(lambda b: b.update(structure={"inputs": {"dict": ["image"]}, "target": "tensor"})),
        r"its structure .* nests the columns \['input\.image', 'target'\], its "
        r"columns are \['input', 'target'\]",
    ),
    "no rows": (
        _edit(lambda b: b.update(shards=[])),
        r"names no rows; a split needs at least one sample",
    ),
}


@pytest.mark.parametrize("case", list(MANIFESTS))
def test_a_manifest_that_is_missing_or_not_one_is_named_before_training(shards: Path, case: str):
    damage, says = MANIFESTS[case]
    damage(shards / "train")
    with pytest.raises(DataError, match=says):
        sharded(str(shards))


# --- (7) `pipeline data shard` given what it can't do ---------------------------------------------


@pytest.mark.parametrize(
    "args, says",
    [
        (
            ["--rows-per-shard", "-300"],
            "--rows-per-shard and --rows-per-group are counts of samples",
        ),
        (["--rows-per-group", "-1"], "--rows-per-shard and --rows-per-group are counts of samples"),
        (
            ["--out", "{file}/shards"],
            "can't write the split to {file}/shards/train (NotADirectoryError",
        ),
    ],
    ids=["negative rows a shard", "negative rows a group", "out below a file"],
)
def test_pipeline_data_shard_refuses_bad_arguments_with_one_line(
    workdir: Path, args: list[str], says: str
):
    a_file = workdir / "a_file"
    a_file.write_text("not a directory")
    args = [a.replace("{file}", str(a_file)) for a in args]
    if "--out" not in args:
        args += ["--out", str(workdir / "shards")]
    proc = run_cli(["data", "shard", "--config", str(TINY), *args], cwd=workdir, check=False)
    line = one_error_line(proc)
    assert (
        line.startswith("pipeline data shard: error: ")
        and says.replace("{file}", str(a_file)) in line
    ), line
    assert a_file.read_text() == "not a directory"
    assert not (workdir / "shards").exists()


# --- (8) an object store that fails under a read (a shard, the manifest, the listing): the store
# named --


def store_failed(judged: str = "shard") -> str:
    """The end of the store's message: what the store failed to read (the shard, the manifest, the
    shards' listing), and what then: a shard read in training resumes from its checkpoint; the
    manifest and the listing are read before any step, with no checkpoint to resume from."""
    then = (
        "retry the run: `--resume latest` resumes from its last checkpoint"
        if judged == "shard"
        else "run the command again"
    )
    return (
        f"the store failed, not the {judged}, whose bytes were not judged; check the store's endpoint "
        f"(AWS_ENDPOINT_URL), credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) and the network to it, "
        f"then {then}"
    )


@contextlib.contextmanager
def a_store(tmp_path: Path, monkeypatch, written: Path | None = None):
    """A moto_server of this test, its variables set in this process, the written splits under
    s3://<bucket>/data when given. botocore tries a request once (AWS_MAX_ATTEMPTS=1, not 5 with
    backoff: a store that stopped answers in milliseconds, not ~10 s). The server is stopped when
    the block ends."""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with moto_s3(log_dir=tmp_path) as store:
        for name, value in store.env.items():
            monkeypatch.setenv(name, value)
        if written is not None:
            client = store.client()
            for f in sorted(p for p in written.rglob("*") if p.is_file()):
                client.upload_file(str(f), store.bucket, f"data/{f.relative_to(written)}")
        yield store


def first_batch_error(loader) -> str:
    with pytest.raises(DataError) as caught:
        next(iter(loader))
    return str(caught.value)


def test_a_store_that_stopped_answering_is_named_as_the_store_not_as_a_truncated_shard(
    written: Path, tmp_path: Path, monkeypatch
):
    with a_store(tmp_path, monkeypatch, written) as store:
        root = f"{store.url}/data"
        # the manifest read and the shards listed while the store answers
        train = sharded(root)["train"]
        loader = make_train_loader(train, BatchPlan(rows=BATCH), 0, 0, 0, False)
    # moto_server stopped: the first shard the stream opens is on an endpoint that refuses
    # connections.
    message = first_batch_error(loader)
    shard = epoch_order(shard_format.read_manifest(written / "train"), 0, 0).blocks[0][0]
    assert message.startswith(
        f"shard {root}/train/shard-{shard:05d}.parquet could not be read from the object "
        f"store at {store.endpoint} (EndpointConnectionError: Could not connect to the "
        f"endpoint URL: "
    ), message
    assert message.endswith(f"): {store_failed()}"), message
    assert "truncated" not in message and "write the split again" not in message


def test_a_store_that_denies_the_shards_is_named_as_the_store_with_its_answer(
    written: Path, tmp_path: Path, monkeypatch
):
    with (
        a_store(tmp_path, monkeypatch, written) as store,
        FaultProxy(store.endpoint, deny=".parquet") as denying,
    ):
        monkeypatch.setenv("AWS_ENDPOINT_URL", denying.endpoint)
        root = f"{store.url}/data"
        # manifest and listing pass
        loader = make_train_loader(sharded(root)["train"], BatchPlan(rows=BATCH), 0, 0, 0, False)
        message = first_batch_error(loader)
    shard = epoch_order(shard_format.read_manifest(written / "train"), 0, 0).blocks[0][0]
    assert message == (
        f"shard {root}/train/shard-{shard:05d}.parquet could not be read from the object store at "
        f"{denying.endpoint} (PermissionError: Forbidden): {store_failed()}"
    )


def test_a_store_stopped_before_the_manifest_is_read_is_named_by_pipeline_train_as_the_store(
    written: Path, tmp_path: Path, workdir: Path, monkeypatch
):
    with a_store(tmp_path, monkeypatch, written) as store:
        root = f"{store.url}/data"
    # moto_server stopped before the run starts: the first request, the train split's manifest, is
    # refused.
    proc = run_cli(
        [
            "train",
            "--config",
            str(TINY),
            "data.name=sharded",
            f"data.args.root={root}",
            "model.name=mlp",
            "model.args={hidden: [16]}",
            "train.max_steps=1",
        ],
        cwd=workdir,
        check=False,
    )
    line = one_error_line(proc)
    says = (
        f"the shard manifest {root}/train/manifest.json could not be read from the object store at "
        f"{store.endpoint} (EndpointConnectionError: Could not connect to the endpoint URL: "
    )
    assert says in line, line
    assert line.endswith(f"): {store_failed('manifest')}"), line
    assert "must be a readable file" not in proc.stderr and "botocore" not in proc.stderr, (
        proc.stderr[-3000:]
    )


@pytest.mark.parametrize(
    "denied, says",
    [
        (
            "manifest.json",
            "the shard manifest {root}/train/manifest.json could not be read from the object store at "
            "{endpoint} (PermissionError: Forbidden): {end}",
        ),
        # A policy without s3:ListBucket: the manifest reads, the check's listing of the split is
        # refused.
        (
            "/trainserve",
            "the listing of the split {root}/train could not be read from the object store at {endpoint} "
            "(PermissionError: Access Denied): {end}",
        ),
    ],
    ids=["the manifest", "the listing"],
)
def test_a_store_that_denies_the_manifest_or_the_listing_is_named_as_the_store_with_its_answer(
    written: Path, tmp_path: Path, monkeypatch, denied: str, says: str
):
    with (
        a_store(tmp_path, monkeypatch, written) as store,
        FaultProxy(store.endpoint, deny=denied) as denying,
    ):
        monkeypatch.setenv("AWS_ENDPOINT_URL", denying.endpoint)
        root = f"{store.url}/data"
        with pytest.raises(DataError) as caught:
            sharded(root)
    end = store_failed("manifest" if denied == "manifest.json" else "shards")
    assert str(caught.value) == says.format(root=root, endpoint=denying.endpoint, end=end)


def test_a_store_stopped_between_the_manifest_and_the_listing_is_named_with_the_listing(
    written: Path, tmp_path: Path, monkeypatch
):
    """sharded(root) reads a split's manifest and lists the split right after it (the check before
    training): the store stops in between (moto_server stopped as the manifest's read returns)."""
    with contextlib.ExitStack() as running:
        store = running.enter_context(a_store(tmp_path, monkeypatch, written))
        read = shard_format.read_manifest

        def read_then_stop(location):
            manifest = read(location)
            running.close()
            return manifest

        monkeypatch.setattr(shard_format, "read_manifest", read_then_stop)
        root = f"{store.url}/data"
        with pytest.raises(DataError) as caught:
            sharded(root)
    message = str(caught.value)
    assert message.startswith(
        f"the listing of the split {root}/train could not be read from the object store at "
        f"{store.endpoint} (EndpointConnectionError: Could not connect to the endpoint URL: "
    ), message
    assert message.endswith(f"): {store_failed('shards')}"), message


def test_a_store_that_stopped_answering_mid_shard_is_named_with_the_row_group_not_as_damage(
    tmp_path: Path, monkeypatch
):
    """s3fs fetches a shard's bytes as they are read, up to 50 MiB (its block) ahead: a row group
    past that, read after the store went away, fails in the middle of a shard that opened and read
    fine."""
    generator = torch.Generator().manual_seed(0)
    samples = (
        (i, torch.randn(16384, generator=generator), torch.tensor(i % 10)) for i in range(900)
    )
    with a_store(tmp_path, monkeypatch) as store:
        root = f"{store.url}/big"
        # One shard of 15 row groups of 4 MiB (random values: no dictionary encoding shrinks them),
        # the last (of 4 rows, at the end) past row group 0 and the 50 MiB s3fs fetches after it.
        manifest = shard_format.write_split(samples, root, rows_per_shard=900, rows_per_group=64)
        assert manifest.shards[0].bytes > (4 << 20) + (50 << 20) + (1 << 20)
        reader = shard_format.ShardReader(shard_format.read_manifest(root))
        reader.read_group(0, 0)
        # Deleted since it was opened, the store answering: the store says it is gone (a 404), and
        # so do we.
        pristine = (
            store.client()
            .get_object(Bucket=store.bucket, Key="big/shard-00000.parquet")["Body"]
            .read()
        )
        store.client().delete_object(Bucket=store.bucket, Key="big/shard-00000.parquet")
        with pytest.raises(
            DataError, match=rf"^shard {root}/shard-00000\.parquet is missing \(the manifest "
        ):
            reader.read_group(0, 14)
        store.client().put_object(Bucket=store.bucket, Key="big/shard-00000.parquet", Body=pristine)
    try:
        with pytest.raises(DataError) as caught:
            reader.read_group(0, 14)
    finally:
        reader.close()
    message = str(caught.value)
    assert message.startswith(
        f"shard {root}/shard-00000.parquet row group 14 could not be read from the object "
        f"store at {store.endpoint} (EndpointConnectionError: "
    ), message
    assert message.endswith(f"): {store_failed()}"), message
    assert "restore the shard" not in message


# --- a resume that meets bad input: exit 2, the shard named, the checkpoint as valid as it was ----


def test_a_resume_that_meets_a_damaged_shard_stops_naming_it_and_its_checkpoint_stays_valid(
    shards: Path, workdir: Path
):
    common = [
        "--config",
        str(TINY),
        "data.name=sharded",
        f"data.args.root={shards}",
        "model.name=mlp",
        "model.args={hidden: [16]}",
        "train.eval_every=0",
        "checkpoint.every_n_steps=2",
        "train.run_name=damaged",
    ]
    run_cli(["train", *common, "train.max_steps=4"], cwd=workdir)
    ckpts = workdir / "outputs/damaged/checkpoints"
    assert checkpoint.latest(ckpts).name == "step_00000004"
    weights = {
        k: v.clone()
        for k, v in model_from_checkpoint(checkpoint.latest(ckpts)).state_dict().items()
    }
    split = shards / "train"

    # A shard deleted since: named before training, nothing trained or saved.
    kept = split.parent.parent / "shard-00004.parquet"
    shutil.move(split / "shard-00004.parquet", kept)
    proc = run_cli(
        ["train", *common, "train.max_steps=8", "--resume", "latest"], cwd=workdir, check=False
    )
    line = one_error_line(proc)
    assert f"shard {split}/shard-00004.parquet is missing" in line, line
    assert "train: step" not in proc.stderr
    shutil.move(kept, split / "shard-00004.parquet")

    # A row group changed in place that the resumed run first reads at a later step: it trains up to
    # it and stops there, naming shard and row group; what it saved before that step is complete.
    order = epoch_order(shard_format.read_manifest(split), 0, 0)
    first = {}
    for shard, group in order.blocks:
        # the data check reads the first rows in file order before training
        if (shard, group) != (
            0,
            0,
        ):
            first[(shard, group)] = first_step_reading(split, shard, group, after=4)
    (shard, group), k = max(
        ((b, k) for b, k in first.items() if k is not None and k < 8), key=lambda i: i[1]
    )
    # micro-batch k is step k + 1: the resumed run trains steps 5..k (and saves step 6 if k > 5)
    # first
    assert k >= 5
    path = split / f"shard-{shard:05d}.parquet"
    pristine = path.read_bytes()
    flip_a_byte(path, group)
    proc = run_cli(
        ["train", *common, "train.max_steps=8", "--resume", "latest"], cwd=workdir, check=False
    )
    line = one_error_line(proc)
    assert f"shard {path} row group {group} does not match the manifest's digest" in line, line
    assert "resumed from" in proc.stderr and "step_00000004" in proc.stderr
    saved = sorted(p.name for p in ckpts.glob("step_*"))
    # the last save before step k + 1, which read the damage
    newest = f"step_{k // 2 * 2:08d}"
    assert checkpoint.latest(ckpts).name == newest, (saved, k)
    # nothing saved at or after the failing step
    assert all(int(name[5:]) <= k for name in saved), (
        saved,
        k,
    )
    # The checkpoint from before the damage still loads, unchanged, and so does the newest.
    assert checkpoint.read_meta(ckpts / "step_00000004")["train_state"]["step"] == 4
    reloaded = model_from_checkpoint(ckpts / "step_00000004").state_dict()
    assert all(torch.equal(reloaded[name], weights[name]) for name in weights)
    assert checkpoint.read_meta(checkpoint.latest(ckpts))["train_state"]["step"] == int(newest[5:])
    model_from_checkpoint(checkpoint.latest(ckpts))

    # The shard restored, the same command resumes from that checkpoint and finishes.
    path.write_bytes(pristine)
    proc = run_cli(["train", *common, "train.max_steps=8", "--resume", "latest"], cwd=workdir)
    assert re.search(rf"resumed from \S*{newest} at step {int(newest[5:])}", proc.stderr), (
        proc.stderr[-3000:]
    )
    assert checkpoint.latest(ckpts).name == "step_00000008"
