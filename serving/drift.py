"""Drift: how far the traffic a model version serves has moved from the data it was trained on.

The reference (`drift_reference.json`, written at export beside model.onnx inside the registered
model, its sha256 a version tag that `pipeline verify` checks) holds, for every input and every
output, the distribution of a few features of each sample on the training split:

    float tensors       one feature per channel (axis 1; the mean over any further axes: an image's
                        per-channel intensity, a sequence's mean value), at most MAX_FEATURES of
                        them, each cut into BINS bins at the training split's quantiles
    integer / bool      the frequency of each value (tokens, categories), the MAX_CATEGORIES most
                        frequent kept and the rest pooled as "other"; every position of the sample counts

The server keeps the bin of each of the last `window` samples per feature (`DriftWindow`) and
reports the population stability index of each input and output, the largest over its features:

    PSI = sum over bins of (p_live - p_ref) * ln(p_live / p_ref)      (both floored at EPSILON)

< 0.1: no shift worth a look; 0.1-0.2: a moderate one; > 0.2: a shift. With BINS = 10 and a window
of 500 samples, data drawn like the training split stays near 0.02 (the statistic's own noise is
about (BINS - 1) / window), and a feature moved by half its standard deviation reaches about 0.25.

This module is the one that writes and reads the format; it needs numpy only (the server has no
torch).
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections import deque
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from serving.lineage import UINT8_INPUTS

log = logging.getLogger("serving.drift")
FORMAT = "trainserve-drift/1"
# A graph's inputs taken as UINT8 pixel values and scaled by 1/255 inside it (the uint8 variant's
# ONNX metadata, written by pipeline/artifact/uint8_inputs.py): compared with the training data's
# [0, 1] values once scaled.
PIXEL_INPUTS_KEY = UINT8_INPUTS
FILE = "drift_reference.json"
BINS = 10
MAX_FEATURES = 64
MAX_CATEGORIES = 50
EPSILON = 1e-4
DEFAULT_WINDOW = 500
DEFAULT_THRESHOLD = 0.2
# Batches between two looks at a version's scores (a log line when one crosses the threshold).
CHECK_EVERY = 50


def features(array: np.ndarray) -> np.ndarray:
    """(samples, features) float64 of one float tensor batch: channel means (axis 1, the rest
    averaged)."""
    a = np.asarray(array, dtype=np.float64)
    if a.ndim == 1:
        return a[:, None]
    if a.ndim > 2:
        a = a.reshape(a.shape[0], a.shape[1], -1).mean(axis=2)
    return a[:, :MAX_FEATURES]


def is_categorical(dtype: np.dtype) -> bool:
    return np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.bool_)


class ReferenceBuilder:
    """Collects a sample of the training split, batch by batch, and makes the reference of each
    tensor."""

    def __init__(self) -> None:
        self._parts: dict[tuple[str, str], list[np.ndarray]] = {}

    def add(self, kind: str, arrays: dict[str, np.ndarray]) -> None:
        """`kind`: "inputs" or "outputs"; `arrays`: one batch by tensor name."""
        for name, array in arrays.items():
            self._parts.setdefault((kind, name), []).append(np.asarray(array))

    def build(self, samples_note: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": FORMAT,
            "bins": BINS,
            "inputs": {},
            "outputs": {},
            "samples": 0,
            "source": samples_note,
        }
        for (kind, name), parts in self._parts.items():
            array = np.concatenate(parts)
            out["samples"] = max(out["samples"], len(array))
            out[kind][name] = (
                _categorical_reference(array)
                if is_categorical(array.dtype)
                else _numeric_reference(array)
            )
        return out


def _numeric_reference(array: np.ndarray) -> dict[str, Any]:
    feats = features(array)
    qs = np.linspace(0, 1, BINS + 1)[1:-1]
    edges, proportions = [], []
    for column in feats.T:
        # ties (a constant feature) give fewer bins
        cut = np.unique(np.quantile(column, qs))
        edges.append(cut.tolist())
        counts = np.bincount(np.searchsorted(cut, column, side="right"), minlength=len(cut) + 1)
        proportions.append((counts / counts.sum()).tolist())
    return {"kind": "numeric", "edges": edges, "proportions": proportions}


def _categorical_reference(array: np.ndarray) -> dict[str, Any]:
    values, counts = np.unique(np.asarray(array).astype(np.int64).reshape(-1), return_counts=True)
    order = np.argsort(-counts)[:MAX_CATEGORIES]
    kept = values[order]
    share = counts[order] / counts.sum()
    # the last: every other value
    return {
        "kind": "categorical",
        "values": kept.tolist(),
        "proportions": [*share.tolist(), float(max(0.0, 1.0 - share.sum()))],
    }


def write(reference: dict[str, Any], path: Path) -> Path:
    path.write_text(json.dumps(reference, separators=(",", ":")))
    return path


def read(path: Path) -> dict[str, Any] | None:
    """The reference beside a model file, or None when the model has none (exported without it)."""
    if not path.is_file():
        return None
    reference = json.loads(path.read_text())
    if not isinstance(reference, dict) or reference.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} drift reference")
    return reference


def psi(live: np.ndarray, reference: np.ndarray) -> float:
    p = np.maximum(np.asarray(live, dtype=np.float64), EPSILON)
    q = np.maximum(np.asarray(reference, dtype=np.float64), EPSILON)
    return float(np.sum((p - q) * np.log(p / q)))


class _Tensor:
    """One input's or output's features: each sample's bin per feature in a ring of the last
    `window`."""

    def __init__(self, spec: dict[str, Any], window: int):
        self.kind = spec["kind"]
        if self.kind == "numeric":
            self.edges = [np.asarray(e) for e in spec["edges"]]
            self.reference = [np.asarray(p) for p in spec["proportions"]]
            # rows of bin indices, one per sample
            self.recent: deque = deque(maxlen=window)
        else:
            self.values = np.asarray(spec["values"], dtype=np.int64)
            # for the sorted lookup of each position's category
            self._order = np.argsort(self.values)
            self._ranked = self.values[self._order]
            self.reference = [np.asarray(spec["proportions"])]
            # per sample: counts per category (+ other)
            self.recent = deque(maxlen=window)

    def observe(self, array: np.ndarray) -> None:
        if self.kind == "numeric":
            feats = features(array)
            # a dynamic axis 1 may be shorter than the reference's
            n = min(len(self.edges), feats.shape[1])
            if n < len(self.edges):
                # a sample with fewer channels than the reference's: not comparable, not counted
                return
            bins = np.stack(
                [np.searchsorted(self.edges[j], feats[:, j], side="right") for j in range(n)], 1
            )
            self.recent.extend(bins)
        else:
            flat = np.asarray(array).astype(np.int64).reshape(len(array), -1)
            # Each position's category by a sorted lookup (no sample x position x category array):
            # the index of its value among the kept ones, or the last bin, "other".
            at = np.clip(np.searchsorted(self._ranked, flat), 0, len(self._ranked) - 1)
            found = self._ranked[at] == flat
            category = np.where(found, self._order[at], len(self.values))
            rows = np.arange(len(flat))[:, None].repeat(flat.shape[1], 1)
            counts = np.zeros((len(flat), len(self.values) + 1))
            np.add.at(counts, (rows, category), 1)
            self.recent.extend(counts)

    def psi(self) -> float | None:
        if not self.recent:
            return None
        if self.kind == "numeric":
            rows = np.stack(self.recent)
            worst = 0.0
            for j, ref in enumerate(self.reference):
                live = np.bincount(rows[:, j], minlength=len(ref))[: len(ref)] / len(rows)
                worst = max(worst, psi(live, ref))
            return worst
        counts = np.sum(np.stack(self.recent), axis=0)
        return psi(counts / counts.sum(), self.reference[0])

    def __len__(self) -> int:
        return len(self.recent)


def pixel_inputs(metadata: dict[str, str]) -> list[str]:
    """The inputs a graph takes as UINT8 pixel values (PIXEL_INPUTS_KEY of its metadata)."""
    return [n for n in (metadata.get(PIXEL_INPUTS_KEY) or "").split(",") if n]


class DriftWindow:
    """The last `window` samples of one model version against its reference; thread-safe (the engine
    thread observes, the metrics scrape reads)."""

    def __init__(
        self,
        reference: dict[str, Any],
        window: int = DEFAULT_WINDOW,
        metadata: dict[str, str] | None = None,
    ):
        self.window = window
        # UINT8 inputs: observed as value / 255
        self._pixels = set(pixel_inputs(metadata or {}))
        self._lock = threading.Lock()
        self._tensors = {
            (kind, name): _Tensor(spec, window)
            for kind in ("inputs", "outputs")
            for name, spec in reference.get(kind, {}).items()
        }

    def observe(self, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> None:
        with self._lock:
            for kind, arrays in (("inputs", inputs), ("outputs", outputs)):
                for name, array in arrays.items():
                    tensor = self._tensors.get((kind, name))
                    if tensor is not None:
                        if kind == "inputs" and name in self._pixels:
                            array = np.asarray(array, np.float32) / 255.0
                        tensor.observe(array)

    def scores(self) -> dict[tuple[str, str], tuple[float, int]]:
        """{(kind, name): (PSI, samples in the window)} for every tensor that has seen a sample."""
        with self._lock:
            out = {}
            for key, tensor in self._tensors.items():
                value = tensor.psi()
                if value is not None and math.isfinite(value):
                    out[key] = (value, len(tensor))
            return out


def names(reference: dict[str, Any]) -> Iterable[tuple[str, str]]:
    return [(kind, name) for kind in ("inputs", "outputs") for name in reference.get(kind, {})]


class Watch:
    """The drift window of every loaded version that has a reference, fed a batch at a time on the
    engine thread (the batcher's `observe` hook, never the event loop), read by /metrics. A tensor
    whose PSI crosses the threshold is said in one log line, and once more when it is back under. A
    failing statistic is logged, never an answer's failure.
    """

    def __init__(self, window: int, threshold: float):
        self.window = window
        self.threshold = threshold
        self.windows: dict[tuple[str, str], DriftWindow] = {}
        # (model, version, kind, tensor) above the threshold, as last said
        self._high: set[tuple[str, str, str, str]] = set()

    def observer(self, name: str, version: str, reference: dict | None, metadata: dict[str, str]):
        """What a version's batcher calls with each batch's feeds and outputs; None when it is not
        watched (no reference, or --drift-window 0)."""
        if reference is None or not self.window:
            return None
        key = (name, version)
        self.windows[key] = window = DriftWindow(reference, self.window, metadata)
        batches = 0

        def observe(feeds: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> None:
            nonlocal batches
            try:
                window.observe(feeds, outputs)
                batches += 1
                if batches % CHECK_EVERY == 0:
                    self._say(key, window)
            except Exception:  # noqa: BLE001
                # a statistic must never fail an answer
                log.exception("drift statistics of %s version %s failed", *key)

        return observe

    def _say(self, key: tuple[str, str], window: DriftWindow) -> None:
        for (kind, name), (value, samples) in window.scores().items():
            # Too few samples to say.
            if samples < window.window // 2:
                continue
            flag = (*key, kind, name)
            if value > self.threshold and flag not in self._high:
                self._high.add(flag)
                log.warning(
                    "drift: %s version %s %s '%s': PSI %.3f > %.2f over the last %d samples",
                    *key,
                    kind[:-1],
                    name,
                    value,
                    self.threshold,
                    samples,
                )
            elif value <= self.threshold and flag in self._high:
                self._high.discard(flag)
                log.info(
                    "drift: %s version %s %s '%s' back under %.2f (PSI %.3f)",
                    *key,
                    kind[:-1],
                    name,
                    self.threshold,
                    value,
                )

    def scores(self, loaded: set[tuple[str, str]]) -> dict[tuple[str, str, str, str], float]:
        """{(model, version, "inputs"|"outputs", tensor): PSI} of the `loaded` versions."""
        return {
            (*key, kind, name): value
            for key, window in list(self.windows.items())
            if key in loaded
            for (kind, name), (value, _) in window.scores().items()
        }

    def keep(self, loaded: set[tuple[str, str]]) -> None:
        """Forget the windows of versions no longer loaded."""
        self.windows = {key: w for key, w in self.windows.items() if key in loaded}
