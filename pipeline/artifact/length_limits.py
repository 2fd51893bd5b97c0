"""Sequence lengths at export: the longest token input the ONNX model is good for, recorded in its
metadata for the server (serving/lengths.py), and a warning when a token input's length varies in
the data but the model is exported at one fixed length.

The limit is the model's position limit when it has one (a position embedding table, or a
`max_len`-like attribute, as Hugging Face's `config.max_position_embeddings`), else the longest
length the parity gate proved. Only integer and boolean inputs (tokens, masks) are limited: an image
model's dynamic height and width are not a sequence with a position table.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from serving.lengths import METADATA_KEY, dumps

log = logging.getLogger("pipeline.export")

POSITION_ATTRIBUTES = (
    "max_position_embeddings",
    "n_positions",
    "max_positions",
    "max_seq_len",
    "max_len",
    "max_length",
    "block_size",
)


def position_limit(model: torch.nn.Module) -> int | None:
    """The longest sequence `model` can position, if it says: an attribute (on it or its `config`),
    else the size of a position embedding table (an nn.Embedding whose name says position)."""
    for holder in (model, getattr(model, "config", None)):
        for name in POSITION_ATTRIBUTES:
            value = getattr(holder, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    tables = [
        m.num_embeddings
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Embedding) and "pos" in name.rsplit(".", 1)[-1].lower()
    ]
    return min(tables) if tables else None


def limits(
    model: torch.nn.Module,
    batches: dict[str, dict[str, np.ndarray]],
    dynamic_axes: dict[str, list[int]],
) -> dict[str, dict[int, int]]:
    """{input: {axis: longest}} for the integer and boolean inputs' dynamic axes past the batch
    axis."""
    by_position = position_limit(model)
    found: dict[str, dict[int, int]] = {}
    for name, axes in dynamic_axes.items():
        arrays = [feeds[name] for feeds in batches.values() if name in feeds]
        if not arrays or not (
            np.issubdtype(arrays[0].dtype, np.integer) or arrays[0].dtype == np.bool_
        ):
            continue
        for axis in (a for a in axes if a != 0):
            proved = max(a.shape[axis] for a in arrays)
            found.setdefault(name, {})[axis] = max(by_position, proved) if by_position else proved
    return found


def record(
    onnx_model,
    model: torch.nn.Module,
    batches: dict[str, dict[str, np.ndarray]],
    dynamic_axes: dict[str, list[int]],
) -> bool:
    """Writes the limits into `onnx_model`'s metadata; True when there were any (the file must be
    saved again)."""
    found = limits(model, batches, dynamic_axes)
    if not found:
        return False
    props = {p.key: p for p in onnx_model.metadata_props}
    entry = props.get(METADATA_KEY) or onnx_model.metadata_props.add()
    entry.key, entry.value = METADATA_KEY, dumps(found)
    log.info(
        "longest inputs the model takes: %s (longer requests get a 400 from the server)",
        ", ".join(f"{n} axis {a}: {m}" for n, axes in found.items() for a, m in axes.items()),
    )
    return True


def warn_fixed_lengths(dataset, dynamic_axes: dict[str, list[int]], samples: int = 64) -> list[str]:
    """A warning for each integer (token) input with no dynamic axis whose length varies across the
    first `samples` samples, as tensors of different lengths or as padding of different lengths:
    exported at one length, the model refuses every other. Returns the inputs warned about."""
    from pipeline.components.data import named

    lengths: dict[str, set[int]] = {}
    for i in range(min(samples, len(dataset))):
        for name, tensor in named(dataset[i][0]).items():
            if (
                isinstance(tensor, torch.Tensor)
                and tensor.dim() == 1
                and not tensor.dtype.is_floating_point
            ):
                lengths.setdefault(name, set()).add(_unpadded_length(tensor))
    warned = [
        name for name, seen in lengths.items() if len(seen) > 1 and not dynamic_axes.get(name)
    ]
    if warned:
        ranges = ", ".join(f"'{n}' {min(lengths[n])} to {max(lengths[n])}" for n in warned)
        log.warning(
            "integer inputs vary in length in the data (%s) but have no dynamic axis: the model is exported "
            "at one fixed length and refuses every other; to serve any length set "
            "'export.dynamic_axes={%s}'",
            ranges,
            ", ".join(f"{n}: [1]" for n in warned),
        )
    return warned


def _unpadded_length(row: torch.Tensor) -> int:
    """The length of a 1-D integer row without its trailing padding (a run of its last value, 2 or
    longer)."""
    values = row.tolist()
    end = len(values)
    while end > 1 and values[end - 2] == values[-1]:
        end -= 1
    # a constant row is all content
    return len(values) if end in (1, len(values)) else end - 1
