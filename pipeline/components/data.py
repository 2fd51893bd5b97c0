"""Data: the splits a data component returns, checked once, and the loaders every stage reads them
with.

The contract (README, "Train your own model"): `data.component(**data.args)` returns
`{"train": Dataset, "val": Dataset}` of map-style data sets whose items are `(inputs, target)`:
`inputs` a tensor or a dict of named tensors (any dtype), `target` what the task takes (its
`check_target`: an int64 class index for classification, a float tensor for regression, an H x W
mask for segmentation, a tensor or a dict/tuple of tensors for custom). The training set may carry
`classes` (class names) and `model_args` (keyword arguments it suggests for the model: input sizes,
normalization statistics), and images may carry `preprocessing` (how an image file becomes the lone
input: serving/images.py; export records it with the model, so that a server takes image files; its
validation set then gives `source_images()`, (index, file suffix, file bytes) of samples spread over
it, the files their inputs were made from, which an export gate proves the recorded transform on).
Data sets need not fit in memory: every stage reads them through a DataLoader with
`data.num_workers` and the default collate, which stacks the items of a batch: they must have one
shape, or the data set gives a `collate_fn` attribute (a batch of items -> one (inputs, target)
batch, e.g. padding each batch to its longest item), which every loader uses.

A lone tensor input is named `input` wherever a name is needed (the ONNX graph, the server); dict
inputs keep their keys and reach the model as keyword arguments, `model(**inputs)`.
"""

from __future__ import annotations

import difflib
import json
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset
from torch.utils.data._utils.collate import default_collate
from torch.utils.data.distributed import DistributedSampler

from pipeline.components import own_stream
from pipeline.components.random_streams import WorkerSeeded, loader_generator

# raised here, defined with the others
from pipeline.errors import DataError  # noqa: F401
from pipeline.plan import BatchPlan
from pipeline.shards.stream import ShardedStream, ShardRows, StreamLoader, identity_of
from pipeline.tools.logs import first_line
from serving.images import Preprocessing

INPUT_NAME = "input"
EVAL_BATCH = 256


class PreBatched(tuple):
    """What a data set's `__getitems__` returns when it gathered the batch itself (one index
    operation instead of collating single samples): `collate` passes it through."""


def collate(batch):
    return tuple(batch) if isinstance(batch, PreBatched) else default_collate(batch)


def collate_of(dataset: Dataset):
    """The collate a loader of `dataset` uses: its own `collate_fn` (a Subset's, the wrapped set's),
    else ours."""
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    return getattr(dataset, "collate_fn", None) or collate


@dataclass(frozen=True)
class InputSpec:
    """One named model input as a sample of the validation set has it (shape without the batch
    axis)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "dtype": str(self.dtype).removeprefix("torch."),
            "shape": list(self.shape),
        }


@dataclass
class Splits:
    """The checked splits, and the facts the model and the task take from them."""

    train: Dataset
    val: Dataset
    classes: list[str] | None = None
    # the training set's `model_args`
    model_hints: dict[str, Any] = field(default_factory=dict)
    inputs: list[InputSpec] = field(default_factory=list)
    # a lone tensor (named `input`), not a dict
    single_input: bool = True
    # How an image file became the lone input (serving/images.py), when the data says: export
    # records it with the model, and a server then takes image files for it.
    preprocessing: Preprocessing | None = None

    @property
    def input_names(self) -> list[str]:
        return [s.name for s in self.inputs]


# --- the contract ------------------------------------------------------------------------------


def check_splits(returned: Any, reference: str, task) -> Splits:
    """What the data component returned, checked against the contract and the task (its class:
    `check_data` on the classes, `check_target` on samples); DataError names the fault."""
    where = f"data.component '{reference}'"
    if not isinstance(returned, dict):
        raise DataError(
            f"{where} returned a {type(returned).__name__}; it must return a dict "
            '{"train": Dataset, "val": Dataset}'
        )
    keys = set(returned)
    if keys != {"train", "val"}:
        wrong = sorted(keys - {"train", "val"}, key=str)
        hints = [
            f"'{k}' (did you mean '{difflib.get_close_matches(str(k), ['train', 'val'], n=1)[0]}'?)"
            if difflib.get_close_matches(str(k), ["train", "val"], n=1)
            else repr(k)
            for k in wrong
        ]
        raise DataError(
            f"{where} returned the keys {sorted(map(str, keys))}; it must return exactly 'train' and 'val'"
            + (f"; unexpected: {', '.join(hints)}" if hints else "")
        )
    for split, ds in returned.items():
        _check_dataset(ds, f"{where} split '{split}'", split)
    train, val = returned["train"], returned["val"]
    classes = getattr(train, "classes", None)
    task.check_data(classes, where)
    if classes is not None:
        if not isinstance(classes, (list, tuple)) or not classes:
            raise DataError(
                f"{where}: the training set's `classes` must be a non-empty list of class names, "
                f"got {type(classes).__name__}"
            )
        classes = [str(c) for c in classes]
    hints = getattr(train, "model_args", {}) or {}
    if not isinstance(hints, dict):
        raise DataError(
            f"{where}: the training set's `model_args` must be a dict of keyword arguments for the "
            f"model, got {type(hints).__name__}"
        )

    preprocessing = getattr(train, "preprocessing", None)
    if preprocessing is not None and not isinstance(preprocessing, Preprocessing):
        raise DataError(
            f"{where}: the training set's `preprocessing` must be a serving.images.Preprocessing, got "
            f"{type(preprocessing).__name__}"
        )

    first_inputs = None
    for split, ds in (("train", train), ("val", val)):
        items = {}
        # A stream is checked on its first items as it yields them; a map-style split on items
        # spread over it.
        read = dict(enumerate(_first_items(ds, where))) if isinstance(ds, IterableDataset) else None
        for index in read if read is not None else _spread(len(ds)):
            inputs, target = items[index] = _check_item(
                read if read is not None else ds, index, f"{where} split '{split}' item {index}"
            )
            task.check_target(target, classes, f"{where} split '{split}' item {index}")
            if first_inputs is None:
                first_inputs = inputs
            else:
                _check_same_inputs(first_inputs, inputs, f"{where} split '{split}' item {index}")
        _check_stacks(ds, items, f"{where} split '{split}'")
    val_inputs = _check_item(val, 0, f"{where} split 'val' item 0")[0]
    single = torch.is_tensor(val_inputs)
    named = {INPUT_NAME: val_inputs} if single else val_inputs
    specs = [InputSpec(name, t.dtype, tuple(t.shape)) for name, t in named.items()]
    if preprocessing is not None:
        _check_preprocessing(preprocessing, val_inputs, where)
    return Splits(train, val, classes, dict(hints), specs, single, preprocessing)


def _check_preprocessing(found: Preprocessing, val_inputs, where: str) -> None:
    """The training set's `preprocessing` (how an image file becomes its lone input) makes the
    inputs it describes."""
    if not (
        torch.is_tensor(val_inputs)
        and val_inputs.dtype == torch.float32
        and tuple(val_inputs.shape) == found.shape
    ):
        got = (
            f"{str(val_inputs.dtype).removeprefix('torch.')} {list(val_inputs.shape)}"
            if torch.is_tensor(val_inputs)
            else f"inputs {sorted(val_inputs)}"
        )
        raise DataError(
            f"{where}: the training set's `preprocessing` makes float32 {list(found.shape)} from an image, but "
            f"a sample's input is {got}; it describes a lone float32 input, made by it"
        )


def _spread(n: int, count: int = 8) -> list[int]:
    """Up to `count` indices spread over 0..n-1, first and last included: the items the check
    reads."""
    return sorted({round(i * (n - 1) / (count - 1)) for i in range(count)})


def _first_items(ds: IterableDataset, where: str, count: int = 8) -> list:
    try:
        items = own_stream.first_items(ds, count)
    except DataError:
        raise
    except Exception as exc:
        raise DataError(
            f"{where}: iterating the training stream raised {type(exc).__name__}: {first_line(exc)}"
        ) from exc
    if not items:
        raise DataError(f"{where}: the training stream yields no samples")
    return items


def _check_stacks(ds: Dataset, items: dict[int, tuple], where: str) -> None:
    """The items read make one batch, as the loaders will batch them (the data set's `__getitems__`
    and `collate_fn` if it has them): items that do not stack would fail inside every rank's first
    step."""
    collate_fn = collate_of(ds)
    indices = list(items)
    try:
        getitems = None if isinstance(ds, IterableDataset) else getattr(ds, "__getitems__", None)
        collate_fn(getitems(indices) if getitems else list(items.values()))
    except Exception as exc:
        if collate_fn is not collate:
            raise DataError(
                f"{where}: its collate_fn raised {type(exc).__name__} on items {indices}: "
                f"{first_line(exc)}"
            ) from exc
        difference = _shape_difference(items)
        raise DataError(
            f"{where}: items {difference or f'{indices} ({type(exc).__name__}: {first_line(exc)})'}, so "
            "they do not stack into one batch (the default collate stacks each tensor of a batch); pad "
            "them to one length (with a mask of the real positions), or give the data set a `collate_fn` "
            "attribute that pads each batch"
        ) from exc


def _shape_difference(items: dict[int, tuple]) -> str:
    """'0 and 57 differ: input 'tokens' has shape [5] in item 0, [8] in item 57'; empty if every
    part has one shape."""
    parts = {
        index: {**_parts(inputs, "the input"), **_parts(target, "the target")}
        for index, (inputs, target) in items.items()
    }
    (first, seen), *rest = parts.items()
    for index, mine in rest:
        for name, value in mine.items():
            if name in seen and _shape(value) != _shape(seen[name]):
                return (
                    f"{first} and {index} differ: {name} has shape {_shape(seen[name])} in item {first}, "
                    f"{_shape(value)} in item {index}"
                )
    return ""


def _parts(value: Any, name: str) -> dict[str, Any]:
    """Each tensor, array or number of an item's inputs or target, by a name a user reads."""
    if isinstance(value, dict):
        return {
            k: v
            for key, part in value.items()
            for k, v in _parts(
                part, f"input '{key}'" if name == "the input" else f"{name}[{key!r}]"
            ).items()
        }
    if isinstance(value, (tuple, list)):
        return {
            k: v for i, part in enumerate(value) for k, v in _parts(part, f"{name}[{i}]").items()
        }
    return {name: value}


def _shape(value: Any) -> list[int]:
    return list(getattr(value, "shape", ()))


def _check_dataset(ds: Any, where: str, split: str) -> None:
    if isinstance(ds, IterableDataset):
        if split != "train":
            raise DataError(
                f"{where} is an IterableDataset; the validation split must be map-style (indexable, with "
                "len()): every evaluation reads all of it, each rank its own share (the sharded data's "
                "val split is: pipeline.datasets:sharded)"
            )
        if not isinstance(ds, ShardedStream) and not own_stream.is_stateful(ds):
            raise DataError(
                f"{where} is an IterableDataset without state_dict()/load_state_dict(): a resume could only "
                "read its batches again and skip them. Implement them (torchdata's Stateful protocol: the "
                "stream's position, per rank and loader worker), write it as shards with `pipeline data "
                "shard` (data.name=sharded: exact resume at any world size), or make it map-style"
            )
        if own_stream.has_length(ds) and len(ds) == 0:
            raise DataError(f"{where} is empty")
        return
    if not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
        raise DataError(
            f"{where} is a {type(ds).__name__}, not a map-style torch.utils.data.Dataset "
            "(it needs __getitem__ and __len__)"
        )
    try:
        n = len(ds)
    except Exception as exc:
        raise DataError(f"{where}: len() raised {type(exc).__name__}: {exc}") from exc
    if n == 0:
        raise DataError(f"{where} is empty")
    collate_fn = getattr(ds, "collate_fn", None)
    if collate_fn is not None and not callable(collate_fn):
        raise DataError(
            f"{where}: its `collate_fn` is a {type(collate_fn).__name__}, not callable; give a function "
            "(a list of items -> one (inputs, target) batch), or drop the attribute to stack the items"
        )


def _check_item(ds: Dataset, index: int, where: str) -> tuple[Any, Any]:
    try:
        item = ds[index]
    except Exception as exc:
        raise DataError(f"{where}: reading it raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        got = f"a {type(item).__name__}" + (
            f" of {len(item)}" if isinstance(item, (tuple, list)) else ""
        )
        raise DataError(f"{where} is {got}; items must be (inputs, target) pairs")
    inputs, target = item
    if torch.is_tensor(inputs):
        _check_dtype(INPUT_NAME, inputs, where)
        return inputs, target
    if isinstance(inputs, dict) and inputs:
        for name, value in inputs.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise DataError(
                    f"{where}: input name {name!r} must be a Python identifier: dict inputs reach the "
                    "model as keyword arguments, model(**inputs), and name the ONNX inputs"
                )
            if not torch.is_tensor(value):
                raise DataError(
                    f"{where}: input '{name}' is a {type(value).__name__}, not a tensor; convert it "
                    "with torch.as_tensor(...)"
                )
            _check_dtype(name, value, where)
        return inputs, target
    raise DataError(
        f"{where}: inputs are a {type(inputs).__name__}; they must be a tensor or a non-empty dict of "
        "named tensors"
    )


# Input dtypes that numpy, the ONNX graph and the server's protocols all carry.
INPUT_DTYPES = (
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
)


def _check_dtype(name: str, value: torch.Tensor, where: str) -> None:
    if value.dtype not in INPUT_DTYPES:
        raise DataError(
            f"{where}: input '{name}' is {str(value.dtype).removeprefix('torch.')}, which a served model "
            f"can't take (numpy has no such dtype); give {', '.join(str(d).removeprefix('torch.') for d in INPUT_DTYPES)}"
            " (train.precision=bf16 computes in bfloat16 from float32 inputs)"
        )


def _check_same_inputs(a: Any, b: Any, where: str) -> None:
    """Every item has the same input names and dtypes (shapes may differ along dynamic axes)."""
    sig_a, sig_b = _signature(a), _signature(b)
    if sig_a != sig_b:
        raise DataError(
            f"{where} has inputs {sig_b}, the first item has {sig_a}: every item needs the same "
            "input names and dtypes"
        )


def _signature(inputs: Any) -> dict[str, str]:
    named = {INPUT_NAME: inputs} if torch.is_tensor(inputs) else inputs
    return {k: f"{str(v.dtype).removeprefix('torch.')} ({v.dim()}-d)" for k, v in named.items()}


# --- batches and the model ---------------------------------------------------------------------


def to_device(inputs, device: torch.device, channels_last: bool = False):
    """A batch's inputs (or targets: a tensor, or a dict/tuple of them) on `device`; 4-d float
    inputs go NHWC when the model is channels_last, or every conv would convert them."""

    def move(t):
        if isinstance(t, dict):
            return {k: move(v) for k, v in t.items()}
        if isinstance(t, (tuple, list)):
            return type(t)(move(v) for v in t)
        if not torch.is_tensor(t):
            return t
        fmt = (
            torch.channels_last
            if channels_last and t.dim() == 4 and t.is_floating_point()
            else torch.preserve_format
        )
        return t.to(device, memory_format=fmt, non_blocking=True)

    return move(inputs)


def forward(model: torch.nn.Module, inputs):
    """The model on a batch: a tensor positionally, a dict as keyword arguments."""
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def batch_rows(inputs) -> int:
    return len(next(iter(inputs.values())) if isinstance(inputs, dict) else inputs)


def take_rows(inputs, index):
    """Rows `index` (a slice or index tensor) of every input."""
    return {k: v[index] for k, v in inputs.items()} if isinstance(inputs, dict) else inputs[index]


def named(inputs) -> dict[str, torch.Tensor]:
    """Inputs by the names the exported graph gives them."""
    return dict(inputs) if isinstance(inputs, dict) else {INPUT_NAME: inputs}


# --- loaders -----------------------------------------------------------------------------------


def make_train_loader(
    dataset: Dataset,
    batch: BatchPlan,
    dp_rank: int,
    seed: int,
    num_workers: int,
    pin_memory: bool,
    info=None,
):
    """A stateful loader over this rank's shard of the training set: `batch.rows` samples a read,
    the set dealt over `batch.data_parallel` ranks, of which this is `dp_rank`.

    DistributedSampler gives rank r the indices perm[r::world] of one seeded permutation per epoch,
    so the union of all ranks' k-th batches is perm[k*B:(k+1)*B] whatever the world size: the same
    global batches for 1, 2 or 8 processes, which is what makes a resume at another world size
    exact. `drop_last` on both, so every step sees a full global batch. torchdata's
    StatefulDataLoader keeps the position inside the epoch for checkpoints, and the workers' base
    seed with it (rank 0's state stands for every rank's: the loader's own generator,
    random_streams.py, is seeded alike on all). Its workers seed their generators before each batch
    from the batch (WorkerSeeded), so the ranks draw apart on their own batches, and the ranks of a
    tensor-parallel group or a pipeline, which read one batch, draw alike; unless the data set keeps
    a state of its own (state_dict), which torchdata then saves per worker as it is.
    """
    from torchdata.stateful_dataloader import StatefulDataLoader

    # The component's own stream
    if isinstance(dataset, IterableDataset) and not isinstance(dataset, ShardedStream):
        from pipeline.distributed import DistInfo

        return own_stream.OwnStreamLoader(
            dataset,
            batch.rows,
            num_workers,
            pin_memory,
            collate_of(dataset),
            info or DistInfo.cpu_alone(),
            seed,
        )
    if isinstance(dataset, IterableDataset):
        if len(dataset) < batch.global_batch_size:
            raise DataError(
                f"the training stream has {len(dataset)} samples, fewer than one global batch "
                f"({batch.global_batch_size}); lower train.global_batch_size"
            )
        return StreamLoader(
            dataset, batch.rows, dp_rank, batch.data_parallel, seed, num_workers, pin_memory
        )
    sampler = DistributedSampler(
        dataset,
        num_replicas=batch.data_parallel,
        rank=dp_rank,
        shuffle=True,
        seed=seed,
        drop_last=True,
    )
    # Not one optimizer step an epoch
    if len(sampler) < batch.rows_per_step:
        raise DataError(
            f"the training set has {len(dataset)} samples, fewer than one global batch "
            f"({batch.global_batch_size}); lower train.global_batch_size"
        )
    # torchdata 0.11 calls a deprecated torch API; harmless
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        # persistent_workers: the loop iterates the loader once per epoch, and without it every
        # epoch would fork (and warm up) the workers anew.
        return StatefulDataLoader(
            WorkerSeeded(dataset)
            if num_workers > 0 and not own_stream.is_stateful(dataset)
            else dataset,
            batch_size=batch.rows,
            sampler=sampler,
            drop_last=True,
            num_workers=num_workers,
            pin_memory=pin_memory,
            collate_fn=collate_of(dataset),
            persistent_workers=num_workers > 0,
            generator=loader_generator(seed),
        )


def eval_shard(dataset: Dataset, rank: int, world_size: int) -> Subset:
    """Rank r evaluates samples r, r+W, ...: disjoint and complete, unlike DistributedSampler, which
    pads with repeats; the all-reduced sums are then exact."""
    return Subset(dataset, range(rank, len(dataset), world_size))


def eval_loader(
    dataset: Dataset, batch_size: int = EVAL_BATCH, num_workers: int = 0, pin_memory: bool = False
) -> DataLoader:
    """In order, every sample once, the last batch partial; its own generator (loader_generator),
    the same for every evaluation."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        num_workers=num_workers,
        collate_fn=collate_of(dataset),
        pin_memory=pin_memory,
        generator=loader_generator(0),
    )


def first_batch(dataset: Dataset, rows: int):
    """The first `rows` samples (cycling through a smaller set) as one collated (inputs, targets)
    batch."""
    indices = [i % len(dataset) for i in range(rows)]
    loader = DataLoader(
        Subset(dataset, indices),
        batch_size=rows,
        collate_fn=collate_of(dataset),
        generator=loader_generator(0),
    )
    return next(iter(loader))


def split_digest(
    dataset: Dataset, num_workers: int = 0, info=None, source: dict | None = None
) -> dict[str, Any]:
    """{"sha256", "samples", "targets"}: a digest of every sample's inputs and targets (names,
    dtypes, shapes, bytes), and what the targets hold (target_profile: class counts, or a number's
    statistics) for the MLflow dataset's profile. Each rank hashes its own samples (r, r+W, ..., as
    `eval_shard` deals them), one digest per sample; the split's is the sha256 of them all in the
    split's order: the same data gives the same digest on any machine and any number of ranks, and
    no rank reads the whole split alone (`info`: the process group)."""
    import hashlib

    from pipeline.distributed import DistInfo, all_gather_object

    # its manifest's digest, no sample read
    if isinstance(dataset, (ShardedStream, ShardRows)):
        return identity_of(dataset.manifest)
    # a stream of the component's own: not read through to hash it
    if isinstance(dataset, IterableDataset):
        described = json.dumps(
            {
                "stream": f"{type(dataset).__module__}.{type(dataset).__qualname__}",
                **(source or {}),
            },
            sort_keys=True,
            default=str,
        )
        return {
            "sha256": hashlib.sha256(described.encode()).hexdigest(),
            "samples": None,
            "targets": {},
            "note": "not a content digest: a stream of the data component's own is not read through to hash it; "
            "this is the sha256 of its class, component and args",
        }
    info = info or DistInfo.cpu_alone()
    mine: list[bytes] = []
    # of the targets seen so far (each batch's first target)
    profile: dict[str, Any] = {}
    # A data set's own collate may pad each batch to its longest item: one item a batch, or the
    # padding, and with it the digest, would depend on which items share a batch, and so on the
    # number of ranks.
    batch = EVAL_BATCH if collate_of(dataset) is collate else 1
    for inputs, target in eval_loader(
        eval_shard(dataset, info.rank, info.world_size), batch, num_workers
    ):
        tensors = [
            *sorted(named(inputs).items()),
            *((f"target.{i}", t) for i, t in enumerate(leaves(target))),
        ]
        profile = merged_profile([profile, target_profile(leaves(target)[:1])], totals=True)
        for row in range(batch_rows(inputs)):
            sample = hashlib.sha256()
            for name, tensor in tensors:
                value = tensor[row].contiguous()
                sample.update(
                    f"{name}:{str(value.dtype).removeprefix('torch.')}:{list(value.shape)};".encode()
                )
                sample.update(value.numpy().tobytes())
            mine.append(sample.digest())
    gathered = all_gather_object((mine, profile), info)
    shards, profiles = [m for m, _ in gathered], [p for _, p in gathered]
    digest = hashlib.sha256()
    for index in range(len(dataset)):
        digest.update(shards[index % len(shards)][index // len(shards)])
    return {
        "sha256": digest.hexdigest(),
        "samples": len(dataset),
        "targets": merged_profile(profiles),
    }


def target_profile(targets: list[torch.Tensor]) -> dict[str, Any]:
    """What a split's (first) target holds: {"classes": {class: count}} for integer targets
    (negative values, an ignore index, left out), else {"count", "sum", "sum_sq", "min", "max"} of
    its values."""
    if not targets:
        return {}
    values = torch.cat([t.reshape(-1) for t in targets])
    if not values.is_floating_point() and values.dtype != torch.bool:
        kept = values[values >= 0].long()
        counts = torch.bincount(kept) if len(kept) else torch.zeros(0, dtype=torch.long)
        return {"classes": {str(c): int(n) for c, n in enumerate(counts.tolist()) if n}}
    values = values.double()
    return {
        "count": len(values),
        "sum": float(values.sum()),
        "sum_sq": float((values**2).sum()),
        "min": float(values.min()),
        "max": float(values.max()),
    }


def merged_profile(profiles: list[dict[str, Any]], totals: bool = False) -> dict[str, Any]:
    """target_profiles (of batches, of ranks) as one: class counts, or the values' count, mean, std,
    min and max (`totals`: the sums still, to merge again)."""
    profiles = [p for p in profiles if p]
    if not profiles:
        return {}
    if "classes" in profiles[0]:
        total: dict[str, int] = {}
        for p in profiles:
            for c, n in p["classes"].items():
                total[c] = total.get(c, 0) + n
        return {"classes": dict(sorted(total.items(), key=lambda kv: int(kv[0])))}
    n = sum(p["count"] for p in profiles)
    if totals:
        return {
            "count": n,
            "sum": sum(p["sum"] for p in profiles),
            "sum_sq": sum(p["sum_sq"] for p in profiles),
            "min": min(p["min"] for p in profiles),
            "max": max(p["max"] for p in profiles),
        }
    mean = sum(p["sum"] for p in profiles) / max(n, 1)
    var = max(sum(p["sum_sq"] for p in profiles) / max(n, 1) - mean**2, 0.0)
    return {
        "count": n,
        "mean": mean,
        "std": var**0.5,
        "min": min(p["min"] for p in profiles),
        "max": max(p["max"] for p in profiles),
    }


def leaves(value: Any) -> list[torch.Tensor]:
    """The tensors of a tensor, or of a (nested) dict/tuple/list of them (a target as the data
    returns it), in order."""
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in leaves(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in leaves(v)]
    return []


def set_epoch(loader, epoch: int) -> None:
    """The loader's shuffle for `epoch` (a stream's loader keeps the position a resume restored in
    it), and the epoch its workers seed each batch with (WorkerSeeded)."""
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
        return
    loader.sampler.set_epoch(epoch)
    if isinstance(loader.dataset, WorkerSeeded):
        loader.dataset.set_epoch(epoch)


def restore_loader(loader, state: dict, epoch: int, saved_world: int, world: int) -> None:
    """The loader at the position a checkpoint saved (`saved_world` ranks saved it, `world`
    resume)."""
    # the position is within this epoch's shuffle
    set_epoch(loader, epoch)
    # a stream: its loader knows its own state's world sizes
    if hasattr(loader, "set_epoch"):
        loader.load_state_dict(state)
    elif state.get("kind"):
        raise DataError(
            f"the checkpoint's data position is a {state['kind']}'s; this run's training split is map-style: "
            "resume with the data it was trained on"
        )
    else:
        loader.load_state_dict(rescale_loader_state(state, saved_world, world))


def spread_sample(dataset: Dataset, count: int) -> tuple[Dataset, str]:
    """About `count` samples spread evenly over a split (it may be ordered by class: its first
    samples would show one class), as a map-style data set, and how they were taken, in words; a
    sharded stream's come from a bounded number of its row groups, a stream of the component's own
    gives its first ones."""
    if isinstance(dataset, ShardedStream):
        sample = _Listed(dataset.sample(count), collate_of(dataset))
        return (
            sample,
            f"{len(sample)} of {len(dataset)} samples, from row groups spread over its shards",
        )
    if isinstance(dataset, IterableDataset):
        sample = _Listed(own_stream.first_items(dataset, count), collate_of(dataset))
        return sample, f"the first {len(sample)} samples of the data component's own stream"
    indices = sorted(
        set(np.linspace(0, len(dataset) - 1, min(count, len(dataset))).astype(int).tolist())
    )
    return Subset(dataset, indices), f"{len(indices)} of {len(dataset)} samples spread over it"


class _Listed(Dataset):
    def __init__(self, items: list, collate_fn):
        self.items, self.collate_fn = items, collate_fn

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def rescale_loader_state(state: dict, saved_world: int, world: int) -> dict:
    """The loader position saved by `saved_world` ranks, for `world` ranks.

    torchdata counts the samples each rank consumed; the global position is that count times the
    world size. With the world-size-invariant global batches above, `n * saved_world / world`
    samples per rank is exactly the same global position. With worker processes the count sits in
    the main process's snapshot (`_snapshot._main_snapshot`), not at the top.
    """
    if saved_world == world:
        return state
    # a copy
    state = json.loads(json.dumps(state))
    main = (state.get("_snapshot") or {}).get("_main_snapshot") or state
    inner = main.get("_sampler_iter_state") or {}
    if "samples_yielded" not in inner:
        raise DataError(
            "cannot move this data loader position to another world size: the saved loader "
            "state has no samples_yielded (torchdata changed its format); resume with "
            f"{saved_world} processes"
        )
    inner["samples_yielded"] = inner["samples_yielded"] * saved_world // world
    return state
