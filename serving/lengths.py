"""The longest input a model was exported for, per input and axis, as export records it in the ONNX
metadata (lineage.MAX_LENGTHS, JSON `{"tokens": {"1": 128}}`), and the server's check of a request
against it.

Past that length a token model fails inside onnxruntime ("invalid expand shape" from a position
table), which tells a client nothing; the server answers a 400 naming the limit instead, and shows
the limits in the model's metadata.
"""

from __future__ import annotations

import json
from typing import Mapping

import numpy as np

from serving.codec import BadRequest
from serving.lineage import MAX_LENGTHS

METADATA_KEY = MAX_LENGTHS


def read(metadata: Mapping[str, str]) -> dict[str, dict[int, int]]:
    """{input: {axis: longest length}} from ONNX metadata; {} when absent or unreadable (a hand-made
    model)."""
    try:
        raw = json.loads(metadata.get(METADATA_KEY) or "{}")
        return {
            str(name): {int(axis): int(n) for axis, n in axes.items()} for name, axes in raw.items()
        }
    except (ValueError, TypeError, AttributeError):
        return {}


def dumps(limits: Mapping[str, Mapping[int, int]]) -> str:
    return json.dumps(
        {name: {str(axis): int(n) for axis, n in axes.items()} for name, axes in limits.items()},
        sort_keys=True,
    )


def check(
    limits: Mapping[str, Mapping[int, int]], feeds: Mapping[str, np.ndarray], model: str
) -> None:
    """BadRequest (400) for the first input longer than the model was exported for."""
    for name, axes in limits.items():
        array = feeds.get(name)
        if array is None:
            continue
        for axis, longest in axes.items():
            if axis < array.ndim and array.shape[axis] > longest:
                raise BadRequest(
                    f"input '{name}' has length {array.shape[axis]} on axis {axis}; model '{model}' was "
                    f"exported for at most {longest} (parameters.max_lengths in its metadata): send "
                    f"at most {longest}, e.g. split or truncate the sequence"
                )
