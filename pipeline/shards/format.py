"""The sharded split on disk or on an object store: Parquet shards and the manifest that names them.

One module writes and reads this format. A split is a directory (or an `s3://` prefix) holding

    manifest.json         what the split is: its schema, its shards, their rows and digests
    shard-00000.parquet   rows of samples: `id` (the sample's index in the split it was written
                          from)
    shard-00001.parquet   and one column per tensor of the sample: `input` or `input.<name>`,
                          `target`
    ...                   or `target.<key>` / `target.<i>`, raw little-endian bytes

A tensor column of one shape in every row is `fixed_size_binary` (a row group's values are one
contiguous buffer: a batch decodes with one `frombuffer`); one whose shape varies is `binary` beside
a `<column>.shape` list column. Each shard's row groups are the blocks the stream shuffles and reads
(stream.py): a reader fetches the row groups it needs, never a whole shard, and checks each against
the content digest the manifest holds for it. The split's identity is the manifest's digest: the
sha256 of its schema, of every shard's name, rows, size and file sha256, of every row group's rows
and content digest, and of the class names and model arguments, computed from the manifest alone
(`manifest_digest`), which is what MLflow's dataset inputs, a checkpoint's data position, `trace`
and `verify` carry for it: whatever a reader checks or hands to the model is inside it.

Images written from a data set that says how a file became its input (`preprocessing`,
serving/images.py) keep that transform in the manifest, and the validation split keeps a few of the
files beside its shards (`example-<id>.<suffix>`, each with its sha256): export records the
transform with the model and its gate proves it on those files (`read_examples`), so a model trained
from the shards serves images as training made them. Both are in the identity when present (the
transform is what a server applies to every image; the files are what the gate checks); a manifest
without them has the digest it had before they existed.

Locations: a local path, or `s3://bucket/prefix` through fsspec (s3fs, with the endpoint and
credentials of the standard AWS_* variables, as checkpoints use: checkpoint/object_store.py).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import posixpath
import re
import secrets
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from pipeline.checkpoint.object_store import endpoint_name
from pipeline.errors import DataError

# (not a lineage key: serving/lineage.py owns the dotted trainserve. names)
FORMAT = "trainserve-shards/1"
MANIFEST = "manifest.json"
# a row group: the unit the stream shuffles and reads (~4 MiB of samples)
ROW_GROUP_BYTES = 4 << 20
# Arrow's fixed_size_binary holds at most this many bytes a value: a fixed-shape column's row, at
# most.
MAX_ROW_BYTES = 2**31 - 1
# a shard file: a few hundred MiB, as object stores like them
SHARD_BYTES = 256 << 20
# An image file kept beside an image split's shards (`read_examples`) is named this, then its
# sample's id.
EXAMPLE_PREFIX = "example-"
_SUFFIX = re.compile(r"\.[a-z0-9]{1,5}")


# --- locations ----------------------------------------------------------------------------------


def filesystem(location: str):
    """(fsspec filesystem, path inside it) of a local path or an s3:// URL."""
    if "://" in str(location):
        from pipeline.checkpoint import object_store

        url = object_store.check_url(str(location), "the shard location")
        return object_store.filesystem(), url.key
    from fsspec.implementations.local import LocalFileSystem

    return LocalFileSystem(), str(location)


def join(location: str, name: str) -> str:
    return (
        f"{str(location).rstrip('/')}/{name}"
        if "://" in str(location)
        else posixpath.join(str(location), name)
    )


# --- the sample's tensors as columns -----------------------------------------------------------


@dataclass(frozen=True)
class Column:
    """One tensor of a sample: its column name, dtype and shape (None: it varies, a shape column
    holds it)."""

    name: str
    dtype: str
    shape: tuple[int, ...] | None

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": None if self.shape is None else list(self.shape),
        }

    @classmethod
    def from_json(cls, d: dict) -> "Column":
        return cls(d["name"], d["dtype"], None if d["shape"] is None else tuple(d["shape"]))

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        # Python's integers: a hostile shape such as [2**32, 2**32] must not wrap to 0 as int64
        # would.
        return math.prod(self.shape) * self.itemsize if self.shape is not None else 0


def structure_of(inputs: Any, target: Any) -> dict:
    """How a sample's tensors nest, so the reader rebuilds `(inputs, target)` as the writer was
    given it: inputs a tensor or {name: tensor}; the target a tensor, {key: tensor} or a tuple of
    tensors."""

    def shape_of(value: Any, what: str):
        if torch.is_tensor(value):
            return "tensor"
        if isinstance(value, dict) and value and all(torch.is_tensor(v) for v in value.values()):
            return {"dict": [str(k) for k in value]}
        if (
            what == "target"
            and isinstance(value, (tuple, list))
            and value
            and all(torch.is_tensor(v) for v in value)
        ):
            return {"tuple": len(value)}
        raise DataError(
            f"a sample's {what} is a {type(value).__name__}; the shard format holds a tensor"
            + (
                ", a dict of tensors or a tuple of tensors"
                if what == "target"
                else " or a dict of tensors"
            )
        )

    return {"inputs": shape_of(inputs, "inputs"), "target": shape_of(target, "target")}


def leaves_of(inputs: Any, target: Any) -> dict[str, torch.Tensor]:
    """A sample's tensors by column name."""
    out: dict[str, torch.Tensor] = {}
    for prefix, value in (("input", inputs), ("target", target)):
        if torch.is_tensor(value):
            out[prefix] = value
        elif isinstance(value, dict):
            out.update({f"{prefix}.{k}": v for k, v in value.items()})
        else:
            out.update({f"{prefix}.{i}": v for i, v in enumerate(value)})
    return out


def rebuild(structure: dict, columns: dict[str, torch.Tensor]) -> tuple[Any, Any]:
    """(inputs, target) of decoded columns, nested as `structure` says."""

    def part(prefix: str, kind: Any):
        if kind == "tensor":
            return columns[prefix]
        if "dict" in kind:
            return {k: columns[f"{prefix}.{k}"] for k in kind["dict"]}
        return tuple(columns[f"{prefix}.{i}"] for i in range(kind["tuple"]))

    return part("input", structure["inputs"]), part("target", structure["target"])


def _dtype_name(t: torch.Tensor, column: str) -> str:
    try:
        return str(t.numpy().dtype) if t.dtype != torch.bool else "bool"
    except TypeError:
        raise DataError(
            f"column '{column}' is {str(t.dtype).removeprefix('torch.')}, which numpy (and so the "
            "shard format) can't hold; convert it to float32"
        ) from None


# --- the manifest -------------------------------------------------------------------------------


@dataclass
class Shard:
    name: str
    rows: int
    bytes: int
    # of the file
    sha256: str
    # [{"rows": n, "sha256": content digest}]
    row_groups: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "rows": self.rows,
            "bytes": self.bytes,
            "sha256": self.sha256,
            "row_groups": self.row_groups,
        }


@dataclass
class Manifest:
    # the directory or prefix the shards are in
    location: str
    columns: list[Column]
    structure: dict
    shards: list[Shard]
    classes: list[str] | None = None
    model_args: dict = field(default_factory=dict)
    # the targets' profile (data.target_profile), for MLflow's dataset
    targets: dict = field(default_factory=dict)
    # what the shards were written from (component, args, split)
    source: dict = field(default_factory=dict)
    # {"transform": serving/images.py Preprocessing, "examples": [{"id", "file", "sha256"}]}, or {}:
    # images only
    preprocessing: dict = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @cached_property
    def row_groups(self) -> list[tuple[int, int, int]]:
        """(shard index, row group index, rows) of every row group, in file order (read per sample:
        kept)."""
        return [
            (s, g, group["rows"])
            for s, shard in enumerate(self.shards)
            for g, group in enumerate(shard.row_groups)
        ]

    @property
    def digest(self) -> str:
        return manifest_digest(self.body())

    def body(self) -> dict:
        return {
            "format": FORMAT,
            "columns": [c.to_json() for c in self.columns],
            "structure": self.structure,
            "shards": [s.to_json() for s in self.shards],
            "rows": self.rows,
            "classes": self.classes,
            "model_args": self.model_args,
            "targets": self.targets,
            "source": self.source,
        } | ({"preprocessing": self.preprocessing} if self.preprocessing else {})


def manifest_digest(body: dict) -> str:
    """The split's identity: the schema, every shard's name, rows, size and file sha256, every row
    group's rows and content digest (what a reader checks the bytes it reads against), the class
    names and the model arguments the split suggests (both reach the model), and an image split's
    preprocessing (its transform reaches every served image, its example files' digests are what the
    export gate checks). Not the targets' profile or the source, which describe it: two manifests of
    the same bytes have one digest wherever they are."""
    identity = {
        "format": body["format"],
        "columns": body["columns"],
        "structure": body["structure"],
        "shards": [
            {k: s[k] for k in ("name", "rows", "bytes", "sha256", "row_groups")}
            for s in body["shards"]
        ],
        "classes": body.get("classes"),
        "model_args": body.get("model_args") or {},
    }
    if body.get("preprocessing"):
        identity["preprocessing"] = body["preprocessing"]
    return hashlib.sha256(
        json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()


def manifest_location(location: str) -> tuple[str, str]:
    """(the split's directory, its manifest) of a directory, or of a path to its manifest.json."""
    location = str(location).rstrip("/")
    if location.endswith(".json"):
        return location.rsplit("/", 1)[0] if "/" in location else ".", location
    return location, join(location, MANIFEST)


def read_manifest(location: str) -> Manifest:
    """The manifest of the split at `location` (its directory or its manifest.json); DataError when
    it is missing or not one."""
    directory, path = manifest_location(location)
    again = "write the split again with `pipeline data shard`"
    fs, key = filesystem(path)
    # the read, then the parse: a store that failed is told from a file that is not a manifest
    try:
        with fs.open(key, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise DataError(
            f"no shard manifest at {path}: write one with `pipeline data shard --config <config> "
            f"--out {directory.rsplit('/', 1)[0] if '/' in directory else directory}`"
        ) from None
    except Exception as exc:
        # a directory of that name, no permission
        if "://" not in path and isinstance(exc, OSError):
            raise DataError(
                f"can't read the shard manifest {path} ({type(exc).__name__}: {exc}); it must be a "
                f"readable file, the manifest.json `pipeline data shard` writes"
            ) from None
        # The store answered no (no connection, denied, timed out): botocore's own exceptions are
        # not OSError.
        raise DataError(
            _store_failed(f"the shard manifest {path}", path, exc, "manifest", BEFORE_TRAINING)
        ) from None
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise DataError(
            f"{path} is not a shard manifest: it is not JSON ({exc}); a split's manifest.json is the "
            f"JSON `pipeline data shard` writes ({FORMAT}): {again}"
        ) from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        found = (
            body.get("format") if isinstance(body, dict) else f"none (a JSON {type(body).__name__})"
        )
        raise DataError(
            f"{path} is not a shard manifest of this version: its format is {found!r}, expected "
            f"{FORMAT!r}; {again}"
        )
    try:
        manifest = Manifest(
            directory,
            [Column.from_json(c) for c in body["columns"]],
            body["structure"],
            [Shard(**s) for s in body["shards"]],
            body.get("classes"),
            body.get("model_args") or {},
            body.get("targets") or {},
            body.get("source") or {},
            body.get("preprocessing") or {},
        )
        problem = _manifest_problem(manifest)
    except (KeyError, TypeError, AttributeError) as exc:
        problem = f"{type(exc).__name__}: {exc}"
    if problem:
        raise DataError(f"{path} is a damaged shard manifest ({problem}); {again}")
    if not manifest.shards or manifest.rows == 0:
        raise DataError(
            f"{path} names no rows; a split needs at least one sample: {again} from data that has some"
        )
    return manifest


def _manifest_problem(manifest: Manifest) -> str | None:
    """What is wrong with a parsed manifest's own shape (None: nothing): shards must be files of the
    split's directory whose rows are their row groups' rows, the columns of numpy dtypes."""
    for col in manifest.columns:
        try:
            np.dtype(col.dtype)
        except TypeError:
            return f"column '{col.name}' has the dtype {col.dtype!r}, which is not a numpy dtype"
        if col.shape is not None and not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in col.shape
        ):
            return f"column '{col.name}' has the shape {list(col.shape)!r}, not a list of sizes"
        if col.nbytes > MAX_ROW_BYTES:
            return (
                f"column '{col.name}' has the shape {list(col.shape)}: {col.nbytes} bytes a "
                f"sample, past the {MAX_ROW_BYTES} a shard's fixed-size column holds"
            )
    if manifest.preprocessing and (problem := _preprocessing_problem(manifest)):
        return problem
    nested = _structure_columns(manifest.structure)
    if nested is None or sorted(nested) != sorted(c.name for c in manifest.columns):
        return (
            f"its structure {manifest.structure} nests the columns {nested}, its columns are "
            f"{[c.name for c in manifest.columns]}"
        )
    for i, shard in enumerate(manifest.shards):
        if (
            not isinstance(shard.name, str)
            or not shard.name
            or shard.name != posixpath.basename(shard.name)
            or shard.name in (".", "..", MANIFEST)
            or "\\" in shard.name
        ):
            return (
                f"shard {i} is named {shard.name!r}; a shard is a file of the split's own directory"
            )
        for what in ("rows", "bytes"):
            value = getattr(shard, what)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                return f"shard {shard.name} has {what} {value!r}, not a count"
        if not isinstance(shard.row_groups, list) or not all(
            isinstance(g, dict)
            and isinstance(g.get("rows"), int)
            and not isinstance(g.get("rows"), bool)
            and g["rows"] >= 0
            and isinstance(g.get("sha256"), str)
            for g in shard.row_groups
        ):
            return f"shard {shard.name}'s row_groups are not a list of {{rows, sha256}}"
        grouped = sum(g["rows"] for g in shard.row_groups)
        if grouped != shard.rows:
            return (
                f"shard {shard.name} has {shard.rows} rows but its row groups {grouped}: the stream would "
                "miscount it"
            )
    return None


def _preprocessing_problem(manifest: Manifest) -> str | None:
    """What is wrong with a manifest's preprocessing entry (None: nothing): a transform
    serving/images.py reads, which makes the input column's shape; examples that are files of the
    split's own directory."""
    from serving.images import Preprocessing

    entry = manifest.preprocessing
    try:
        transform = Preprocessing.from_json(entry.get("transform"))
    except (ValueError, TypeError) as exc:
        return f"its preprocessing: {exc}"
    column = next((c for c in manifest.columns if c.name == "input"), None)
    if column is None or column.dtype != "float32" or column.shape != transform.shape:
        shown = "no input column" if column is None else f"{column.dtype} {column.shape}"
        return (
            f"its preprocessing makes float32 {list(transform.shape)}, its input column is {shown}"
        )
    examples = entry.get("examples", [])
    for example in examples if isinstance(examples, list) else [None]:
        if not (
            isinstance(example, dict)
            and isinstance(example.get("id"), int)
            and isinstance(example.get("file"), str)
            and example["file"].startswith(EXAMPLE_PREFIX)
            and example["file"] == posixpath.basename(example["file"])
            and "\\" not in example["file"]
            and isinstance(example.get("sha256"), str)
        ):
            return (
                f"its preprocessing's examples must be a list of {{id, file: {EXAMPLE_PREFIX}..., sha256}}, "
                f"got {example!r:.80}"
            )
    return None


def read_examples(manifest: Manifest) -> list[tuple[int, str, bytes]]:
    """(id, file suffix, file bytes) of the image files an image split keeps beside its shards, each
    checked against its sha256; DataError naming a file that is missing or changed."""
    found = []
    for example in manifest.preprocessing.get("examples", []):
        path = join(manifest.location, example["file"])
        fs, key = filesystem(path)
        try:
            with fs.open(key, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise DataError(
                f"{path} is missing: the manifest names it among the image files its preprocessing is proven on; "
                "restore it, or write the split again with `pipeline data shard`"
            ) from None
        if hashlib.sha256(data).hexdigest() != example["sha256"]:
            raise DataError(
                f"{path} is not the file the manifest names (its sha256 differs); restore it, or write the "
                "split again with `pipeline data shard`"
            )
        found.append((example["id"], posixpath.splitext(example["file"])[1], data))
    return found


def _structure_columns(structure: Any) -> list[str] | None:
    """The column names a manifest's structure nests (None: it is not a structure `structure_of`
    writes)."""
    if not isinstance(structure, dict):
        return None
    names: list[str] = []
    for prefix, key in (("input", "inputs"), ("target", "target")):
        kind = structure.get(key)
        if kind == "tensor":
            names.append(prefix)
        elif isinstance(kind, dict) and isinstance(kind.get("dict"), list):
            names.extend(f"{prefix}.{k}" for k in kind["dict"])
        elif key == "target" and isinstance(kind, dict) and isinstance(kind.get("tuple"), int):
            names.extend(f"{prefix}.{i}" for i in range(kind["tuple"]))
        else:
            return None
    return names


def check_against_store(manifest: Manifest) -> None:
    """Every shard the manifest names is in the store, at the size it names: one listing, before
    training reads a row (a missing or truncated shard would otherwise surface mid-epoch)."""
    fs, key = filesystem(manifest.location)
    try:
        listing = {
            posixpath.basename(str(e["name"]).rstrip("/")): int(e.get("size") or 0)
            for e in fs.ls(key, detail=True)
        }
    except FileNotFoundError:
        raise DataError(
            f"the shard directory {manifest.location} does not exist: it must hold the shards its "
            f"manifest names ({', '.join(s.name for s in manifest.shards[:3])}"
            f"{', ...' if len(manifest.shards) > 3 else ''})"
        ) from None
    except Exception as exc:
        # the store answered no (no connection, denied ListBucket, timed out)
        raise DataError(
            _store_failed(
                f"the listing of the split {manifest.location}",
                manifest.location,
                exc,
                "shards",
                BEFORE_TRAINING,
            )
        ) from None
    for shard in manifest.shards:
        where = f"shard {join(manifest.location, shard.name)}"
        if shard.name not in listing:
            raise DataError(
                f"{where} is missing: the manifest {join(manifest.location, MANIFEST)} names "
                f"{len(manifest.shards)} shards; restore it, or write the split again with "
                "`pipeline data shard`"
            )
        if listing[shard.name] != shard.bytes:
            raise DataError(
                f"{where} is {listing[shard.name]} bytes, the manifest says {shard.bytes}: the shard is "
                f"{'truncated' if listing[shard.name] < shard.bytes else 'not the one the manifest names'}; "
                "restore it, or write the split again with `pipeline data shard`"
            )


# --- writing ------------------------------------------------------------------------------------


def write_split(
    samples: Iterable[tuple[int, Any, Any]],
    location: str,
    *,
    rows_per_shard: int = 0,
    rows_per_group: int = 0,
    classes: list[str] | None = None,
    model_args: dict | None = None,
    targets: dict | None = None,
    source: dict | None = None,
    preprocessing: dict | None = None,
    examples: list[tuple[int, str, bytes]] = (),
) -> Manifest:
    """Writes `(id, inputs, target)` samples as shards and a manifest under `location` (written
    last: a split without its manifest is not a split). Shard and row-group sizes default to
    ~256 MiB and ~4 MiB of samples. `preprocessing`: an image split's transform (serving/images.py
    Preprocessing.to_json), and `examples` (id, file suffix, file bytes) the image files of samples
    it keeps beside its shards."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs, root = filesystem(location)
    try:
        fs.makedirs(root, exist_ok=True)
    except OSError as exc:
        raise _unwritable(location, exc) from None
    samples = iter(samples)
    first = next(samples, None)
    if first is None:
        raise DataError("the split to write has no samples")
    structure = structure_of(first[1], first[2])
    first_leaves = {k: v.contiguous() for k, v in leaves_of(first[1], first[2]).items()}
    buffered = [first]
    columns = [
        Column(name, _dtype_name(t, name), tuple(t.shape)) for name, t in first_leaves.items()
    ]
    sample_bytes = max(1, sum(t.numel() * t.element_size() for t in first_leaves.values()))
    rows_per_group = rows_per_group or max(1, ROW_GROUP_BYTES // sample_bytes)
    rows_per_shard = rows_per_shard or max(
        rows_per_group, SHARD_BYTES // sample_bytes // rows_per_group * rows_per_group
    )

    # Shapes vary? Look through the first shard's worth before fixing the schema (a later shape
    # change is caught per sample below and named).
    for item in samples:
        buffered.append(item)
        if len(buffered) >= rows_per_shard:
            break
    for i, col in enumerate(columns):
        if any(tuple(leaves_of(s[1], s[2])[col.name].shape) != col.shape for s in buffered):
            columns[i] = Column(col.name, col.dtype, None)

    def all_samples():
        yield from buffered
        yield from samples

    shards: list[Shard] = []
    batch: list[tuple[int, Any, Any]] = []
    for item in all_samples():
        batch.append(item)
        if len(batch) == rows_per_shard:
            shards.append(
                _write_shard(
                    fs, root, len(shards), batch, columns, structure, rows_per_group, pa, pq
                )
            )
            batch = []
    if batch:
        shards.append(
            _write_shard(fs, root, len(shards), batch, columns, structure, rows_per_group, pa, pq)
        )
    kept = []
    for sample_id, suffix, data in examples:
        name = f"{EXAMPLE_PREFIX}{int(sample_id):08d}{suffix if _SUFFIX.fullmatch(suffix) else ''}"
        _write_file(fs, root, name, data, location)
        kept.append(
            {"id": int(sample_id), "file": name, "sha256": hashlib.sha256(data).hexdigest()}
        )
    manifest = Manifest(
        str(location).rstrip("/"),
        columns,
        structure,
        shards,
        classes,
        model_args or {},
        targets or {},
        source or {},
        {"transform": preprocessing, "examples": kept} if preprocessing else {},
    )
    if manifest.preprocessing and (problem := _preprocessing_problem(manifest)):
        raise DataError(f"can't write the split to {location}: {problem}")
    body = manifest.body() | {"digest": manifest.digest}
    _write_file(fs, root, MANIFEST, json.dumps(body, indent=1).encode(), location)
    return manifest


def _write_file(fs, root: str, name: str, data: bytes, location: str) -> None:
    """`data` as the file `name` of the split's directory `root`. On a local filesystem, never
    through a link someone planted in a shared output: the directory is opened without following a
    link, the bytes go to a new file of a random name opened O_EXCL|O_NOFOLLOW in it, then renamed
    over `name` (a link there is replaced, its target untouched). An object store has no links: one
    PUT."""
    from fsspec.implementations.local import LocalFileSystem

    if not isinstance(fs, LocalFileSystem):
        try:
            with fs.open(join(root, name), "wb") as f:
                f.write(data)
        except OSError as exc:
            raise _unwritable(location, exc) from None
        return
    try:
        directory = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        if os.path.islink(root):
            raise DataError(
                f"can't write the split to {location}: {root} is a symbolic link (to "
                f"{os.readlink(root)}); the output's directories must be its own: remove the "
                "link, or give another --out"
            ) from None
        raise _unwritable(location, exc) from None
    temporary = f".{name}.{secrets.token_hex(8)}.tmp"
    try:
        fd = os.open(
            temporary,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o644,
            dir_fd=directory,
        )
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(temporary, name, src_dir_fd=directory, dst_dir_fd=directory)
        except BaseException:
            os.unlink(temporary, dir_fd=directory)
            raise
    except OSError as exc:
        raise _unwritable(location, exc) from None
    finally:
        os.close(directory)


def _unwritable(location: str, exc: OSError) -> DataError:
    return DataError(
        f"can't write the split to {location} ({type(exc).__name__}: {exc}); the output must be a "
        "directory (or s3://bucket/prefix) that can be written, with room for the shards"
    )


def _write_shard(
    fs,
    root: str,
    index: int,
    rows: list,
    columns: list[Column],
    structure: dict,
    rows_per_group: int,
    pa,
    pq,
) -> Shard:
    name = f"shard-{index:05d}.parquet"
    arrays = {"id": pa.array([int(r[0]) for r in rows], type=pa.int64())}
    for col in columns:
        values = []
        shapes = []
        for sample_id, inputs, target in rows:
            if structure_of(inputs, target) != structure:
                raise DataError(
                    f"sample {sample_id} nests its tensors as {structure_of(inputs, target)}, the first "
                    f"sample as {structure}: every sample of a split needs the same inputs and target"
                )
            t = leaves_of(inputs, target)[col.name].contiguous()
            if _dtype_name(t, col.name) != col.dtype:
                raise DataError(
                    f"sample {sample_id}: column '{col.name}' is {_dtype_name(t, col.name)}, the first "
                    f"sample's is {col.dtype}: every sample needs one dtype per tensor"
                )
            if col.shape is not None and tuple(t.shape) != col.shape:
                raise DataError(
                    f"sample {sample_id}: column '{col.name}' has shape {list(t.shape)}, the first "
                    f"shard's samples {list(col.shape)}"
                )
            values.append(t.numpy().tobytes())
            shapes.append(list(t.shape))
        if col.shape is not None:
            arrays[col.name] = pa.array(
                values, type=pa.binary(col.nbytes) if col.nbytes else pa.binary()
            )
        else:
            arrays[col.name] = pa.array(values, type=pa.binary())
            arrays[f"{col.name}.shape"] = pa.array(shapes, type=pa.list_(pa.int64()))
    table = pa.table(arrays)
    buffer = io.BytesIO()
    pq.write_table(
        table, buffer, row_group_size=rows_per_group, compression="none", write_statistics=False
    )
    data = buffer.getvalue()
    groups = [
        {
            "rows": len(rows[i : i + rows_per_group]),
            "sha256": content_digest(table.slice(i, rows_per_group), columns),
        }
        for i in range(0, len(rows), rows_per_group)
    ]
    _write_file(fs, root, name, data, root)
    return Shard(name, len(rows), len(data), hashlib.sha256(data).hexdigest(), groups)


def content_digest(table, columns: list[Column]) -> str:
    """The sha256 of a row group's values (ids, then each column's bytes and shapes), as decoded:
    what a reader checks the row group it read against, whatever Parquet's encoding of it."""
    digest = hashlib.sha256()
    digest.update(np.ascontiguousarray(table.column("id").to_numpy()).tobytes())
    for col in columns:
        array = table.column(col.name).combine_chunks()
        if col.shape is not None and col.nbytes:
            digest.update(_fixed_values(array, col.nbytes))
        else:
            for value in array.to_pylist():
                digest.update(len(value).to_bytes(8, "little"))
                digest.update(value)
            digest.update(json.dumps(table.column(f"{col.name}.shape").to_pylist()).encode())
    return digest.hexdigest()


def _fixed_values(array, width: int) -> memoryview:
    """The contiguous bytes of a fixed_size_binary array's rows (its offset into the buffer
    honoured)."""
    data = array.buffers()[1]
    return memoryview(data)[array.offset * width : (array.offset + len(array)) * width]


# --- reading ------------------------------------------------------------------------------------


class ShardReader:
    """Reads the row groups of one split's shards, each checked against the manifest: the shard's
    schema and row counts when it is opened, a row group's content digest when it is read. Open
    shards are kept (a worker reads a shard's row groups one after another); at most `keep` at
    once."""

    def __init__(self, manifest: Manifest, keep: int = 2):
        self.manifest = manifest
        self.keep = keep
        self._open: dict[int, Any] = {}
        self._fs = None

    def _file(self, index: int):
        import pyarrow.parquet as pq

        if index in self._open:
            return self._open[index]
        if self._fs is None:
            self._fs, _ = filesystem(self.manifest.location)
        shard = self.manifest.shards[index]
        path = join(self.manifest.location, shard.name)
        _, key = filesystem(path)
        try:
            handle = _StoreFile(self._fs.open(key, "rb"))
        except FileNotFoundError:
            raise DataError(self._missing(path)) from None
        except IsADirectoryError as exc:
            # a directory of that name: not a shard
            raise DataError(_unreadable(path, shard, exc)) from None
        except Exception as exc:
            # the store answered no (an S3 HEAD: no connection, denied, timed out)
            raise DataError(_store_failed(f"shard {path}", path, exc)) from None
        try:
            pf = pq.ParquetFile(handle)
        except Exception as exc:
            handle.close()
            # The store's own exception (a read that failed) or pyarrow's judgement of the bytes it
            # was given (ArrowInvalid: no footer, not Parquet; OSError: a footer that does not
            # parse). deleted since it was opened
            if isinstance(handle.failure, FileNotFoundError):
                raise DataError(self._missing(path)) from None
            raise DataError(
                _store_failed(f"shard {path}", path, handle.failure)
                if handle.failure is not None
                else _unreadable(path, shard, exc)
            ) from None
        problem = _schema_difference(pf.schema_arrow, self.manifest.columns)
        if problem is None and (
            pf.metadata.num_rows != shard.rows or pf.num_row_groups != len(shard.row_groups)
        ):
            problem = (
                f"shard {path} holds {pf.metadata.num_rows} rows in {pf.num_row_groups} row groups; the "
                f"manifest says {shard.rows} in {len(shard.row_groups)}: the stream would "
                f"{'end early' if pf.metadata.num_rows < shard.rows else 'differ'}; restore the shard, or "
                "write the split again with `pipeline data shard`"
            )
        elif problem is None:
            problem = _groups_difference(pf.metadata, shard, path)
        else:
            problem = (
                f"shard {path} {problem}: the schema changed between shards; every shard of a split holds "
                "the manifest's columns: restore the shard, or write the split again with `pipeline data "
                "shard`"
            )
        if problem is not None:
            handle.close()
            raise DataError(problem)
        if len(self._open) >= self.keep:
            oldest = next(iter(self._open))
            self._open.pop(oldest).close()
        self._open[index] = _Open(pf, handle)
        return self._open[index]

    def _missing(self, path: str) -> str:
        return (
            f"shard {path} is missing (the manifest {join(self.manifest.location, MANIFEST)} names it); restore "
            "it, or write the split again with `pipeline data shard`"
        )

    def read_group(self, shard_index: int, group: int) -> dict[str, Any]:
        """{"id": int64 array, column name: decoded tensor (fixed shape: one (rows, *shape) tensor;
        else a list)}."""
        opened = self._file(shard_index)
        shard = self.manifest.shards[shard_index]
        path = join(self.manifest.location, shard.name)
        # What decoding will cost, judged from the footer before a byte is decoded: at most the
        # manifest's rows of this group times its row bytes (the digest is only checked after).
        if (problem := _group_cost_problem(opened.pf.metadata, group, shard, path)) is not None:
            raise DataError(problem)
        opened.handle.failure = None
        try:
            table = opened.pf.read_row_group(group)
        except Exception as exc:
            where = f"shard {path} row group {group}"
            # deleted since it was opened
            if isinstance(opened.handle.failure, FileNotFoundError):
                raise DataError(self._missing(path)) from None
            # the store failed mid-shard (s3fs fetches ranges as read)
            if opened.handle.failure is not None:
                raise DataError(
                    _store_failed(where, self.manifest.location, opened.handle.failure)
                ) from None
            raise DataError(
                f"{where} can't be read ({type(exc).__name__}: {str(exc)[:200]}); restore the shard"
            ) from None
        if content_digest(table, self.manifest.columns) != shard.row_groups[group]["sha256"]:
            raise DataError(
                f"shard {path} row group {group} does not match the "
                "manifest's digest: the shard changed since the manifest was written; restore it, or "
                "write the split again with `pipeline data shard`"
            )
        return decode(table, self.manifest.columns)

    def close(self) -> None:
        for opened in self._open.values():
            opened.close()
        self._open.clear()


class _StoreFile:
    """A shard's file as pyarrow reads it, keeping the exception the store raised (`failure`).
    pyarrow re-raises a Python file's own exception object, and its own judgement of bytes that are
    not Parquet is ArrowInvalid or, for a footer that does not parse, a plain OSError (ArrowIOError
    is OSError), as s3fs's errors may be: what tells a store that failed from a shard that is
    damaged is whether the file raised, not the exception's class. Only what pyarrow's PythonFile
    calls (no `__fspath__`, no `read_buffer`: it probes for both)."""

    def __init__(self, handle):
        self.handle = handle
        self.failure: BaseException | None = None

    def _call(self, method, *args):
        try:
            return method(*args)
        except Exception as exc:
            self.failure = exc
            raise

    def read(self, size: int = -1):
        return self._call(self.handle.read, size)

    def seek(self, offset: int, whence: int = 0):
        return self._call(self.handle.seek, offset, whence)

    def tell(self) -> int:
        return self._call(self.handle.tell)

    @property
    def closed(self) -> bool:
        return self.handle.closed

    def close(self) -> None:
        self.handle.close()


AGAIN = "restore the shard, or write the split again with `pipeline data shard`"


def _groups_difference(metadata, shard: Shard, path: str) -> str | None:
    """How the rows of a shard's row groups, as its Parquet footer counts them, differ from the
    manifest's (None: they don't). Checked when the shard is opened: a reader addresses rows by the
    manifest's counts."""
    held = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
    declared = [group["rows"] for group in shard.row_groups]
    if held == declared:
        return None
    g = next(i for i, (a, b) in enumerate(zip(held, declared)) if a != b)
    return (
        f"shard {path} row group {g} holds {held[g]} rows, the manifest says {declared[g]} (row "
        f"groups of {_counts(held)} rows, not {_counts(declared)}): its rows would be read from the "
        f"wrong places; {AGAIN}"
    )


def _counts(rows: list[int]) -> str:
    shown = ", ".join(str(n) for n in rows[:8])
    return f"[{shown}{', ...' if len(rows) > 8 else ''}]"


def _group_cost_problem(metadata, group: int, shard: Shard, path: str) -> str | None:
    """Why row group `group` must not be decoded (None: it may), from the footer alone. The writer
    writes no compression: a compressed chunk (which could inflate to any size before its digest is
    checked) is refused, and the chunks' stated sizes must fit in the file the manifest names. Its
    rows equal the manifest's (`_groups_difference`, at open), so a fixed-shape column decodes to
    exactly the declared rows x its row bytes."""
    meta = metadata.row_group(group)
    where = f"shard {path} row group {group}"
    stored = 0
    for i in range(meta.num_columns):
        chunk = meta.column(i)
        if chunk.compression != "UNCOMPRESSED":
            return (
                f"{where}: column '{chunk.path_in_schema}' is {chunk.compression}-compressed; a "
                "split's shards are written uncompressed (`pipeline data shard`), so its decoded "
                f"size can't be known before it is decoded: {AGAIN}"
            )
        stored += max(chunk.total_uncompressed_size, chunk.total_compressed_size)
    if stored > shard.bytes:
        return (
            f"{where}: its footer says its columns hold {stored} bytes, more than the whole file "
            f"the manifest names ({shard.bytes} bytes): the footer is damaged; {AGAIN}"
        )
    return None


def _unreadable(path: str, shard: Shard, exc: BaseException) -> str:
    return (
        f"shard {path} can't be read as Parquet ({type(exc).__name__}: {str(exc)[:200]}): it is truncated or "
        f"not a shard (the manifest says {shard.bytes} bytes of Parquet); restore it, or write the split again "
        "with `pipeline data shard`"
    )


# what a store's failure under a read before any step asks of the user
BEFORE_TRAINING = "run the command again"


def _store_failed(
    what: str,
    location: str,
    exc: BaseException,
    judged: str = "shard",
    then: str = "retry the run: `--resume latest` resumes from its last checkpoint",
) -> str:
    """`what` (a shard at `location`, one of its row groups, the split's manifest or its listing)
    unread because the store failed under the read (connection refused, timed out, access denied, an
    I/O error): the bytes of `judged` (the shard, the manifest, the shards) were never judged, so
    nothing here says to rewrite them. `then`: what to do once the store answers (a read before
    training has no checkpoint to resume from)."""
    error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    if "://" in str(location):
        return (
            f"{what} could not be read from the object store at {endpoint_name()} ({error}): the store failed, not "
            f"the {judged}, whose bytes were not judged; check the store's endpoint (AWS_ENDPOINT_URL), "
            f"credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) and the network to it, then {then}"
        )
    return (
        f"{what} could not be read from its filesystem ({error}): the filesystem failed, not the {judged}, "
        f"whose bytes were not judged; check the file's permissions and the disk or network mount it is on, then "
        f"{then}"
    )


def _schema_difference(schema, columns: list[Column]) -> str | None:
    """How a shard's Arrow schema differs from the manifest's columns (None: it doesn't), in
    words."""
    import pyarrow as pa

    wanted: dict[str, Any] = {"id": pa.int64()}
    for col in columns:
        if col.shape is not None:
            wanted[col.name] = pa.binary(col.nbytes) if col.nbytes else pa.binary()
        else:
            wanted[col.name], wanted[f"{col.name}.shape"] = pa.binary(), pa.list_(pa.int64())
    names = list(schema.names)
    if names != list(wanted):
        return (
            f"has the columns {names}; the manifest's schema is {list(wanted)} (the columns "
            f"{[c.name for c in columns]} of the first shard)"
        )

    # a list's item field may be named otherwise after a Parquet round trip
    def same(actual, expected) -> bool:
        if pa.types.is_list(actual) and pa.types.is_list(expected):
            return actual.value_type == expected.value_type
        return actual == expected

    for name, expected in wanted.items():
        actual = schema.field(name).type
        if not same(actual, expected):
            col = next((c for c in columns if name in (c.name, f"{c.name}.shape")), None)
            held = (
                ""
                if col is None or col.shape is None
                else f", which holds {col.dtype} of shape {list(col.shape)} ({col.nbytes} bytes a row)"
            )
            return f"has column '{name}' of type {actual}; the manifest's is {expected}{held}"
    return None


@dataclass
class _Open:
    pf: Any
    handle: Any

    def close(self) -> None:
        try:
            self.handle.close()
        except Exception:
            pass


def decode(table, columns: list[Column]) -> dict[str, Any]:
    """A row group's columns as numpy views of Arrow's buffers (no copy yet: `take` copies the rows
    it takes)."""
    out: dict[str, Any] = {"id": table.column("id").to_numpy()}
    for col in columns:
        array = table.column(col.name).combine_chunks()
        if col.shape is not None:
            raw = (
                np.frombuffer(_fixed_values(array, col.nbytes), dtype=col.dtype)
                if col.nbytes
                else np.zeros(0, dtype=col.dtype)
            )
            out[col.name] = raw.reshape(len(array), *col.shape)
        else:
            shapes = table.column(f"{col.name}.shape").to_pylist()
            out[col.name] = [
                np.frombuffer(v, dtype=col.dtype).reshape(s)
                for v, s in zip(array.to_pylist(), shapes)
            ]
    return out


def take(group: dict[str, Any], rows: np.ndarray) -> dict[str, Any]:
    """Rows `rows` of a decoded row group, as tensors of their own (a fixed-shape column: one (rows,
    *shape) tensor, gathered by numpy in one copy; a varying one: a list)."""
    out: dict[str, Any] = {"id": group["id"][rows]}
    for name, value in group.items():
        if name == "id":
            continue
        out[name] = (
            torch.from_numpy(value[rows])
            if isinstance(value, np.ndarray)
            else [torch.from_numpy(value[i].copy()) for i in rows]
        )
    return out


def samples_of(taken: dict[str, Any], structure: dict) -> Iterator[tuple[int, tuple[Any, Any]]]:
    """(id, (inputs, target)) of each row `take` gave."""
    names = [n for n in taken if n != "id"]
    for i, sample_id in enumerate(taken["id"]):
        yield int(sample_id), rebuild(structure, {n: taken[n][i] for n in names})


def batch_of(parts: list[dict[str, Any]], structure: dict):
    """One collated (inputs, target) batch of consecutive `take`s, as the default collate would
    stack their samples, or None when a column varies in shape or the target is a tuple (then the
    samples are collated one by one)."""
    if structure["target"] != "tensor" and "dict" not in structure["target"]:
        return None
    names = [n for n in parts[0] if n != "id"]
    if not all(torch.is_tensor(parts[0][n]) for n in names):
        return None
    return rebuild(
        structure,
        {n: parts[0][n] if len(parts) == 1 else torch.cat([p[n] for p in parts]) for n in names},
    )
