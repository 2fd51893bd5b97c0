"""A request far outside the range its model was trained on (pixel values 0-255 sent to a model
trained on values in [0, 1]) is answered, with a warning: a `Warning` header (gRPC: `warning`
initial metadata) and a log line, at most one every LOG_EVERY_S seconds per model version (saying
how many more there were).

The range is what export already records of the training data: the drift reference
(serving/drift.py, written beside the model) holds for each float input the deciles of each sample's
features (a channel's mean: drift.features); its first and last edges span the training samples'
10th to 90th percentile. A sample is far outside when a feature lies further from that span than FAR
times the span's scale (the largest of its width and its ends' magnitudes): an order of magnitude,
as 0-255 against [0, 1] is, and a normalized sample, an all-white or an all-black image are not. At
most ROWS rows of a request are looked at, a channel's mean taken over at most VALUES of its values
evenly strided (the cost stays a few microseconds for any image size): the mistake this catches is a
client's, made on every value it sends.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass

import numpy as np

from serving import drift

log = logging.getLogger("serving.input_range")

FAR = 10.0
ROWS = 2
VALUES = 4096
LOG_EVERY_S = 60.0


@dataclass(frozen=True)
class Span:
    """The training samples' 10th to 90th percentile of each feature of one input, and how far off
    is far."""

    low: np.ndarray
    high: np.ndarray
    margin: np.ndarray


class InputRanges:
    """One loaded version's float inputs, each with the span its training data's features lie in."""

    def __init__(self, spans: dict[str, Span], where: str):
        self.spans = spans
        # the version, as the log names it
        self.where = where
        self._lock = threading.Lock()
        self._said_at = -LOG_EVERY_S
        self._unsaid = 0

    def outside(self, feeds: dict[str, np.ndarray]) -> str | None:
        """What is far outside in `feeds` (the first such feature), or None."""
        for name, span in self.spans.items():
            array = feeds.get(name)
            if array is None or array.dtype.kind != "f" or array.ndim < 1 or not array.size:
                continue
            features = sampled_features(array[:ROWS])
            n = min(len(span.low), features.shape[1])
            low, high, margin = span.low[:n], span.high[:n], span.margin[:n]
            far = (features[:, :n] < low - margin) | (features[:, :n] > high + margin)
            if not far.any():
                continue
            row, j = (int(i) for i in np.argwhere(far)[0])
            return (
                f"input '{name}' is far outside the range the model was trained on: feature {j} "
                f"(the mean of channel {j}) is {features[row, j]:.4g} in row {row}, where the "
                f"training samples' lie between {low[j]:.4g} and {high[j]:.4g} (10th to 90th "
                "percentile); send values scaled as training scaled them"
            )
        return None

    def warning(self, feeds: dict[str, np.ndarray]) -> str | None:
        """The Warning header's value for a request whose feeds are far outside (None: they are
        not); said in the log too, at most once every LOG_EVERY_S seconds."""
        found = self.outside(feeds)
        if found is None:
            return None
        now = time.monotonic()
        with self._lock:
            say, unsaid = now - self._said_at >= LOG_EVERY_S, self._unsaid
            if say:
                self._said_at, self._unsaid = now, 0
            else:
                self._unsaid += 1
        if say:
            more = (
                f" ({unsaid} more such requests in the last {LOG_EVERY_S:.0f} s)" if unsaid else ""
            )
            log.warning("%s: %s%s", self.where, found, more)
        # a header value: printable ASCII, no double quote inside the quoted warn-text
        text = re.sub(r"[^\x20-\x7e]|\"", "'", found)
        return f'299 - "{text}"'


def sampled_features(rows: np.ndarray) -> np.ndarray:
    """drift.features of a few rows (a channel's mean), the mean over at most VALUES of each
    channel's values."""
    if rows.ndim <= 2:
        return drift.features(rows)
    flat = rows.reshape(len(rows), rows.shape[1], -1)[:, : drift.MAX_FEATURES]
    step = max(1, flat.shape[2] // VALUES)
    return flat[:, :, ::step].mean(axis=2, dtype=np.float64)


def input_ranges(reference: dict | None, inputs, where: str) -> InputRanges | None:
    """The spans of a version's float inputs from its drift reference; None when it has none (or no
    float input the reference describes)."""
    if not reference:
        return None
    spans = {}
    for spec in inputs:
        described = (reference.get("inputs") or {}).get(spec.name)
        if spec.dtype.kind != "f" or not described or described.get("kind") != "numeric":
            continue
        edges = described.get("edges") or []
        if not edges or not all(edges):
            continue
        low = np.array([e[0] for e in edges], np.float64)
        high = np.array([e[-1] for e in edges], np.float64)
        scale = np.maximum.reduce([high - low, np.abs(low), np.abs(high), np.full_like(low, 1e-6)])
        spans[spec.name] = Span(low, high, FAR * scale)
    return InputRanges(spans, where) if spans else None


def warning(model, feeds: dict[str, np.ndarray]) -> str | None:
    """The Warning header of a request of the loaded version `model` (None: nothing to warn of)."""
    return None if model.ranges is None else model.ranges.warning(feeds)
