"""The classification extension (Triton's): an output asked for with `"classification": K` comes
back as its top K classes, each the BYTES string "value:index:label" ("value:index" where the class
has no name), instead of its tensor.

As Triton computes it: for a batched version, per row, over the row's values flattened (shape [rows,
K']); for one that runs each request alone, over the whole tensor (shape [K']). K' is K clamped to
the values there are. The highest values first (ties in index order), compared in the output's own
type; the value written as that type writes itself (3, 0.25). Labels: the output's label file in its
config.pbtxt, else the class names the version's export recorded when the row has exactly one value
per name (a classifier's logits or probabilities). Outputs of numbers only, and at most MAX_ELEMENTS
values a row. The request's K is checked where it is decoded (codec.classified).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from serving.codec import BadRequest

# values in one row classified (Triton's bound)
MAX_ELEMENTS = 1_000_000


def classify(
    results: dict[str, np.ndarray],
    counts: dict[str, int],
    batched: bool,
    labels_for: Callable[[str, int], tuple[str, ...] | None],
) -> dict[str, np.ndarray]:
    """`results` with each output in `counts` ({output: K}) replaced by its top-K strings;
    `labels_for(output, classes)` gives its class names. BadRequest for an output that holds no
    numbers or too many."""
    if not counts:
        return results
    out = dict(results)
    for name, k in counts.items():
        array = np.asarray(results[name])
        if array.dtype.kind not in "iuf":
            raise BadRequest(
                f"output '{name}': classification needs numbers; it holds {array.dtype} values"
            )
        rows = array.reshape(len(array), -1) if batched and array.ndim else array.reshape(1, -1)
        if rows.shape[1] > MAX_ELEMENTS:
            raise BadRequest(
                f"output '{name}': classification over {rows.shape[1]} values a row; at most "
                f"{MAX_ELEMENTS}"
            )
        names = labels_for(name, rows.shape[1])
        top = np.array([top_k(row, k, names) for row in rows], dtype=object)
        out[name] = top if batched and array.ndim else top.reshape(-1)
    return out


def top_k(row: np.ndarray, k: int, labels: tuple[str, ...] | None) -> list[bytes]:
    """The `k` highest values of `row` as b"value:index[:label]", highest first, ties in index
    order."""
    # A stable sort of the reversed row, reversed again: descending values, equal ones in ascending
    # index.
    order = (len(row) - 1 - np.argsort(row[::-1], kind="stable"))[::-1][:k]
    found = []
    for index in order:
        text = f"{row[index]}:{index}"
        if labels is not None and index < len(labels):
            text += f":{labels[index]}"
        found.append(text.encode("utf-8"))
    return found
