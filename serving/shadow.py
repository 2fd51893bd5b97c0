"""The challenger judged on live traffic: pairs of answers (the champion's, which the client got,
and the challenger's, computed off the request path), labels that arrive later, and a verdict.

What a pair compares depends on what the model's metadata says it answers (never on a task's name):
    a decision output (lineage.DECISION: its argmax over axis 1 is the answer, a class per
        sample or per pixel)   top-1 agreement of the two
    every other output         the mean |champion - challenger| per output
Both latencies are kept (the champion's as the client saw it, the challenger's run), and the
challenger's errors are counted. Labels posted later (`feedback`) are joined with what both
answered, within a bounded window, into live metrics for each: accuracy on the decision output, RMSE
on the prediction output. Answers are kept under the server's own id of the request
(envelope.new_request_id, random, the receipt's X-Server-Request-Id), never an id the client chose:
no client can predict another's or send its own answers under it, and an id kept is never replaced
by a later request's.

The verdict, under `Rule` (the user's thresholds):
    reject     any challenger error; agreement below `min_agreement` (or a mean difference above
               `max_difference`), labels or not, from any number of clients; a challenger p50 above
               `max_latency_ratio` x the champion's; with labels, a live metric worse than the
               champion's by more than `tolerance`
    promote    only on labels: at least `min_labels` of them on mirrored requests, the challenger's
               live metric within `tolerance` of the champion's on the same requests, agreement at
               its floor
    undecided  otherwise: fewer than `min_pairs` pairs; agreement alone (it can reject, never
               promote); labelled pairs more than `max_source_share` of which one client address
               sent

Why agreement alone never promotes: any inference client shapes it (a hostile review steered it to
"promote" for a 7%-accurate challenger with near-copies of one input the two versions answer alike,
from several addresses). The labels come from the holder of the feedback token (serving/envelope.py,
Auth), are range-checked against the model's answers, and are joined only with answers the server
kept under its own ids. What else no one client can shape: a pair counts once per distinct input (an
input sent again is counted as repeated, not as another pair), the requests mirrored are the
server's random draw, and the report says how many distinct inputs, and how many clients (by
address), made the pairs and the labelled pairs, and the largest share one client sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import random
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from serving.batcher import BatcherClosed, QueueFull, RunTimedOut
from serving.console import clip
from serving.envelope import Refused

log = logging.getLogger("serving.shadow")

# Mirrored requests waiting for the challenger, per model: past it they are dropped.
MIRROR_QUEUE = 64
# per side, for the percentiles
LATENCIES_KEPT = 2000
# request ids whose answers wait for a label
ANSWERS_KEPT = 10000
# and at most this much of them: per-pixel answers are big
ANSWER_BYTES_KEPT = 64 << 20
# digests of the inputs paired so far (a repeat beyond them counts as new)
INPUTS_KEPT = 100_000
# clients counted by address; pairs of any further ones count as one more source, "other"
SOURCES_KEPT = 10_000
# The verdict's basis (the report's "decided_by"): what `pipeline promote` checks a promote rests
# on.
LABELS, AGREEMENT, DIFFERENCE, ERRORS, LATENCY, PAIRS = (
    "labels",
    "agreement",
    "difference",
    "errors",
    "latency",
    "pairs",
)


def input_digest(feeds: dict[str, np.ndarray]) -> bytes:
    """What tells one input from another: a hash of every array's name, shape, dtype and bytes."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(feeds):
        array = np.ascontiguousarray(feeds[name])
        digest.update(f"{name}{array.shape}{array.dtype}".encode())
        digest.update(memoryview(array).cast("B"))
    return digest.digest()


@dataclass
class Rule:
    min_pairs: int = 200
    # decision outputs: top-1 agreement at least this
    min_agreement: float = 0.95
    # other outputs: mean |difference| at most this (per output)
    max_difference: float = math.inf
    # labels needed before they decide
    min_labels: int = 100
    # labels: the challenger's live metric may be this much worse
    tolerance: float = 0.01
    max_latency_ratio: float = math.inf
    # of the labelled pairs, the most one client (address) may have sent for labels to promote
    max_source_share: float = 0.5

    def to_json(self) -> dict[str, Any]:
        return {
            k: (None if isinstance(v, float) and math.isinf(v) else v)
            for k, v in self.__dict__.items()
        }


@dataclass
class _Live:
    """Live metrics of one side from the labels joined so far."""

    samples: int = 0
    hits: int = 0
    decided: int = 0
    squared: float = 0.0
    values: int = 0

    def add(self, answer: np.ndarray, label: np.ndarray, decides: bool) -> None:
        """`answer`: the compact form `compact` keeps (decisions, or the prediction), as `label` is
        shaped."""
        self.samples += 1
        truth = np.asarray(label).reshape(answer.shape)
        if decides:
            self.hits += int((answer == truth).sum())
            self.decided += int(answer.size)
        else:
            error = answer.astype(np.float64) - truth.astype(np.float64)
            self.squared += float((error * error).sum())
            self.values += int(error.size)

    def metrics(self) -> dict[str, float]:
        out = {}
        if self.decided:
            out["accuracy"] = self.hits / self.decided
        if self.values:
            out["rmse"] = math.sqrt(self.squared / self.values)
        return out


@dataclass
class ShadowState:
    """Everything one champion/challenger pairing has seen; reset when either side's version
    changes."""

    champion_version: str
    challenger_version: str
    decision: str | None
    prediction: str | None
    # the decision output's classes (axis 1), once an answer showed them
    classes: int | None = None
    # of distinct inputs
    pairs: int = 0
    # pairs of an input paired before: not counted again
    repeated: int = 0
    # digests of the inputs paired (INPUTS_KEPT)
    inputs: OrderedDict = field(default_factory=OrderedDict)
    # client address -> pairs of distinct inputs it sent (SOURCES_KEPT)
    sources: dict = field(default_factory=dict)
    # client address -> labelled pairs of its requests (SOURCES_KEPT)
    labelled_sources: dict = field(default_factory=dict)
    dropped: int = 0
    errors: int = 0
    agree: int = 0
    decided: int = 0
    difference_sums: dict[str, float] = field(default_factory=dict)
    difference_counts: dict[str, int] = field(default_factory=dict)
    champion_ms: deque = field(default_factory=lambda: deque(maxlen=LATENCIES_KEPT))
    challenger_ms: deque = field(default_factory=lambda: deque(maxlen=LATENCIES_KEPT))
    # the server's request id -> (champion's compact answer, challenger's or None, the client's
    # address)
    answers: OrderedDict = field(default_factory=OrderedDict)
    answer_bytes: int = 0
    # request ids already labelled (a late pair skips)
    labelled: OrderedDict = field(default_factory=OrderedDict)
    labels: int = 0
    # the champion on every labelled request; the challenger, and the champion again, on the
    # labelled pairs
    live: dict[str, _Live] = field(
        default_factory=lambda: {
            "champion": _Live(),
            "challenger": _Live(),
            "champion_on_pairs": _Live(),
        }
    )


class Shadow:
    """The comparison of one model's champion and challenger; thread-safe."""

    def __init__(self, rule: Rule):
        self.rule = rule
        self._lock = threading.Lock()
        self.state: ShadowState | None = None

    def pairing(
        self,
        champion_version: str,
        challenger_version: str,
        decision: str | None,
        prediction: str | None,
    ) -> None:
        """The versions compared now; a change of either starts the comparison afresh."""
        with self._lock:
            s = self.state
            if s is None or (s.champion_version, s.challenger_version) != (
                champion_version,
                challenger_version,
            ):
                self.state = ShadowState(champion_version, challenger_version, decision, prediction)

    def _current(self, versions: tuple[str, str] | None) -> ShadowState | None:
        s = self.state
        if s is None or (
            versions is not None and (s.champion_version, s.challenger_version) != versions
        ):
            # news of a pairing that has since changed: not this one's
            return None
        return s

    def dropped(self, versions: tuple[str, str] | None = None) -> None:
        with self._lock:
            if (s := self._current(versions)) is not None:
                s.dropped += 1

    def error(self, versions: tuple[str, str] | None = None) -> None:
        with self._lock:
            if (s := self._current(versions)) is not None:
                s.errors += 1

    def compact(self, answer: dict[str, np.ndarray]) -> np.ndarray | None:
        """What a label is scored against, kept small: the decision output's argmax (a class per
        sample or per pixel), else the prediction output; None when the model declares neither."""
        s = self.state
        if s is None:
            return None
        if s.decision and s.decision in answer:
            scores = np.asarray(answer[s.decision])
            s.classes = scores.shape[1] if scores.ndim > 1 else s.classes
            decided = scores.argmax(axis=1)
            return decided.astype(np.int32 if decided.max(initial=0) > 32767 else np.int16)
        if s.prediction and s.prediction in answer:
            return np.asarray(answer[s.prediction], dtype=np.float32)
        return None

    def _keep(self, s: ShadowState, request_id: str, kept: tuple) -> None:
        """Keeps (champion's, challenger's, source) under the server's `request_id`. An id kept
        already is never replaced (the server's ids are its own and random: a second request under
        one is no honest request); its champion-only record only gains the challenger's answer,
        once."""
        old = s.answers.get(request_id)
        if old is not None:
            if old[1] is not None or kept[1] is None:
                return
            kept = (old[0], kept[1], kept[2])
            s.answer_bytes -= _nbytes(old)
        s.answers[request_id] = kept
        s.answer_bytes += _nbytes(kept)
        while s.answers and (len(s.answers) > ANSWERS_KEPT or s.answer_bytes > ANSWER_BYTES_KEPT):
            _, gone = s.answers.popitem(last=False)
            s.answer_bytes -= _nbytes(gone)

    def answered(self, request_id: str, champion: dict[str, np.ndarray]) -> None:
        """The champion's answer to a request (`request_id`: the server's own id of it), kept
        (bounded in count and bytes) for a label that may come."""
        with self._lock:
            s = self.state
            kept = self.compact(champion)
            if s is not None and kept is not None and request_id not in s.labelled:
                self._keep(s, request_id, (kept, None, ""))

    def pair(
        self,
        request_id: str,
        champion: dict[str, np.ndarray],
        challenger: dict[str, np.ndarray],
        champion_ms: float,
        challenger_ms: float,
        versions: tuple[str, str],
        digest: bytes = b"",
        source: str = "",
    ) -> None:
        """`digest`: input_digest of the request's inputs; a pair of an input paired before counts
        as repeated. `source`: the client's address (envelope.source_of), whose share of the pairs
        the report gives."""
        with self._lock:
            s = self._current(versions)
            if s is None:
                # a pair of a pairing that has since changed
                return
            s.champion_ms.append(champion_ms)
            s.challenger_ms.append(challenger_ms)
            if digest and digest in s.inputs:
                s.repeated += 1
                return
            if digest:
                s.inputs[digest] = True
                while len(s.inputs) > INPUTS_KEPT:
                    s.inputs.popitem(last=False)
            s.pairs += 1
            if source not in s.sources and len(s.sources) >= SOURCES_KEPT:
                source = "other"
            s.sources[source] = s.sources.get(source, 0) + 1
            if s.decision and s.decision in champion and s.decision in challenger:
                a, b = (
                    np.asarray(champion[s.decision]).argmax(1),
                    np.asarray(challenger[s.decision]).argmax(1),
                )
                s.agree += int((a == b).sum())
                s.decided += int(a.size)
            else:
                for name, value in champion.items():
                    if name in challenger and np.issubdtype(np.asarray(value).dtype, np.number):
                        diff = np.abs(
                            np.asarray(value, dtype=np.float64)
                            - np.asarray(challenger[name], np.float64)
                        )
                        s.difference_sums[name] = s.difference_sums.get(name, 0.0) + float(
                            diff.sum()
                        )
                        s.difference_counts[name] = s.difference_counts.get(name, 0) + int(
                            diff.size
                        )
            kept = self.compact(champion), self.compact(challenger), source
            # labelled already: nothing left to join
            if kept[0] is not None and request_id not in s.labelled:
                self._keep(s, request_id, kept)

    def feedback(self, labels: dict[str, np.ndarray]) -> dict[str, int]:
        """True targets by the server's request id (X-Server-Request-Id), joined with the answers
        still in the window; returns the counts. ValueError, before anything is counted, when a
        label's size is not its answer's."""
        with self._lock:
            s = self.state
            if s is None:
                return {"joined": 0, "unknown": len(labels)}
            for request_id, label in labels.items():
                kept = s.answers.get(request_id)
                if kept is not None and np.asarray(label).size != kept[0].size:
                    raise ValueError(
                        f"the label of {request_id!r} has {np.asarray(label).size} values; its answer "
                        f"has {kept[0].size} ({'a class' if s.decision else 'a value'} per "
                        f"{'position' if kept[0].ndim > 1 else 'row'}): send the true target as the "
                        f"answer is shaped, {list(kept[0].shape)}"
                    )
                if kept is not None:
                    _check_label(request_id, np.asarray(label, dtype=np.float64), s)
            joined = unknown = 0
            decides = bool(s.decision)
            for request_id, label in labels.items():
                kept = s.answers.pop(request_id, None)
                if kept is None:
                    unknown += 1
                    continue
                s.answer_bytes -= _nbytes(kept)
                s.labelled[request_id] = True
                while len(s.labelled) > ANSWERS_KEPT:
                    s.labelled.popitem(last=False)
                champion, challenger, source = kept
                s.live["champion"].add(champion, label, decides)
                # the challenger answered only the mirrored sample
                if challenger is not None:
                    s.live["challenger"].add(challenger, label, decides)
                    s.live["champion_on_pairs"].add(champion, label, decides)
                    if source not in s.labelled_sources and len(s.labelled_sources) >= SOURCES_KEPT:
                        source = "other"
                    s.labelled_sources[source] = s.labelled_sources.get(source, 0) + 1
                s.labels += 1
                joined += 1
        return {"joined": joined, "unknown": unknown}

    def report(self) -> dict[str, Any]:
        with self._lock:
            s = self.state
            if s is None:
                return {
                    "challenger_version": None,
                    "pairs": 0,
                    "dropped": 0,
                    "verdict": "undecided",
                    "reason": "no challenger is being shadowed",
                    "decided_by": PAIRS,
                    "rule": self.rule.to_json(),
                }
            out: dict[str, Any] = {
                "champion_version": s.champion_version,
                "challenger_version": s.challenger_version,
                "pairs": s.pairs,
                "dropped": s.dropped,
                "challenger_errors": s.errors,
                "latency_ms": {
                    "champion_p50": _pct(s.champion_ms, 50),
                    "champion_p99": _pct(s.champion_ms, 99),
                    "challenger_p50": _pct(s.challenger_ms, 50),
                    "challenger_p99": _pct(s.challenger_ms, 99),
                },
                "distinct_inputs": s.pairs,
                "repeated_inputs": s.repeated,
                "sources": len(s.sources),
                "largest_source_share": max(s.sources.values()) / s.pairs if s.pairs else 0.0,
                "labels": s.labels,
                "labelled_pairs": s.live["challenger"].samples,
                "labelled_sources": len(s.labelled_sources),
                "largest_labelled_source_share": (
                    max(s.labelled_sources.values()) / s.live["challenger"].samples
                    if s.labelled_sources
                    else 0.0
                ),
                "live": {side: live.metrics() for side, live in s.live.items()},
                "rule": self.rule.to_json(),
            }
            if s.decided:
                out["agreement"] = s.agree / s.decided
            if s.difference_counts:
                out["mean_abs_difference"] = {
                    k: s.difference_sums[k] / s.difference_counts[k] for k in s.difference_counts
                }
            out["verdict"], out["reason"], out["decided_by"] = self._verdict(out)
            return out

    def _verdict(self, r: dict[str, Any]) -> tuple[str, str, str]:
        """(verdict, reason, what decided it). Agreement, differences, errors and latency can
        reject, from any number of clients; only labels can promote."""
        rule = self.rule
        if r["challenger_errors"]:
            return (
                "reject",
                f"the challenger failed {r['challenger_errors']} of the mirrored requests",
                ERRORS,
            )
        if r["pairs"] < rule.min_pairs:
            return (
                "undecided",
                f"{r['pairs']} pairs so far; the rule needs {rule.min_pairs}",
                PAIRS,
            )
        latency = r["latency_ms"]
        if latency["challenger_p50"] > rule.max_latency_ratio * latency["champion_p50"]:
            return (
                "reject",
                f"challenger p50 {latency['challenger_p50']:.2f} ms > {rule.max_latency_ratio:g} x the "
                f"champion's {latency['champion_p50']:.2f} ms",
                LATENCY,
            )
        # Labels or not, and whoever sent the pairs: labels can't outvote what every request showed.
        if "agreement" in r and r["agreement"] < rule.min_agreement:
            return (
                "reject",
                f"top-1 agreement {r['agreement']:.1%} < {rule.min_agreement:.1%} over {r['pairs']} "
                "pairs of distinct inputs",
                AGREEMENT,
            )
        worst = max((r.get("mean_abs_difference") or {"-": 0.0}).items(), key=lambda kv: kv[1])
        if worst[1] > rule.max_difference:
            return (
                "reject",
                f"mean |difference| of {worst[0]} {worst[1]:.4g} > {rule.max_difference:g} over "
                f"{r['pairs']} pairs of distinct inputs",
                DIFFERENCE,
            )
        if r["labelled_pairs"] < rule.min_labels:
            shown = (
                f"top-1 agreement {r['agreement']:.1%}"
                if "agreement" in r
                else f"mean |difference| at most {worst[1]:.4g}"
            )
            return (
                "undecided",
                f"{shown} over {r['pairs']} pairs, no challenger errors; promoting takes labels "
                f"(--feedback-token): {r['labelled_pairs']} on mirrored requests so far, the rule needs "
                f"{rule.min_labels}",
                LABELS,
            )
        if r["largest_labelled_source_share"] > rule.max_source_share:
            return (
                "undecided",
                f"one client address sent {r['largest_labelled_source_share']:.1%} of the "
                f"{r['labelled_pairs']} labelled pairs; the rule lets one send at most "
                f"{rule.max_source_share:.0%} (--shadow-max-source-share; behind a proxy, where every "
                "client is one address, or when you are the only client, set it to 1)",
                LABELS,
            )
        live = {
            "champion": r["live"]["champion_on_pairs"],
            "challenger": r["live"]["challenger"],
        }
        return (*_by_labels(live, rule.tolerance, r["labelled_pairs"]), LABELS)


def _check_label(request_id: str, label: np.ndarray, s: ShadowState) -> None:
    """ValueError naming a label no answer of this model could match: not finite, or (a decision)
    not a class."""
    if not np.isfinite(label).all():
        raise ValueError(f"the label of {request_id!r} holds NaN or Inf: send the true target")
    if s.decision and s.classes is not None:
        bad = label[(label != np.rint(label)) | (label < 0) | (label >= s.classes)]
        if bad.size:
            raise ValueError(
                f"the label of {request_id!r} holds {bad[0]:g}, not a class of this model: a class index "
                f"is a whole number from 0 to {s.classes - 1}"
            )


def _by_labels(live: dict[str, dict[str, float]], tolerance: float, labels: int) -> tuple[str, str]:
    champion, challenger = live["champion"], live["challenger"]
    if "accuracy" in champion and "accuracy" in challenger:
        a, b = champion["accuracy"], challenger["accuracy"]
        if b < a - tolerance:
            return (
                "reject",
                f"live accuracy {b:.1%} vs the champion's {a:.1%} on {labels} labels (tolerance {tolerance:g})",
            )
        return "promote", f"live accuracy {b:.1%} vs the champion's {a:.1%} on {labels} labels"
    if "rmse" in champion and "rmse" in challenger:
        a, b = champion["rmse"], challenger["rmse"]
        if b > a * (1 + tolerance):
            return (
                "reject",
                f"live RMSE {b:.4g} vs the champion's {a:.4g} on {labels} labels (tolerance {tolerance:g})",
            )
        return "promote", f"live RMSE {b:.4g} vs the champion's {a:.4g} on {labels} labels"
    return (
        "undecided",
        f"{labels} labels, but the model declares no decision or prediction output to score",
    )


def _nbytes(kept: tuple) -> int:
    return sum(a.nbytes for a in kept[:2] if a is not None)


def _pct(values, q: float) -> float:
    return round(float(np.percentile(np.asarray(values), q)), 3) if values else 0.0


class Mirror:
    """The challenger's half of the pairs, an observer of the server's answers (serving/core.py).

    A random `fraction` of each shadowed model's champion answers, drawn by the server (never from
    an id a client chose), runs again on the challenger: off the request path, on the server's main
    loop, one request at a time per model. Shed first under load: when its queue is full, or the
    champion has rows waiting, the pair is dropped and counted; the champion's answer never waits
    for it. Both answers are kept under the server's own id of the request.
    """

    def __init__(self, repository, alias: str, fraction: float, rule: Rule, timeout: float):
        self.repository = repository
        self.alias = alias
        self.fraction = fraction
        self.timeout = timeout
        # model -> its comparison: with a fraction to mirror (--shadow), each model loaded from an
        # alias that ends in @<alias>
        self.comparisons = {
            name: Shadow(rule)
            for name, served in repository.aliases()
            if fraction and served.rpartition("@")[2] == alias
        }
        self.loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._workers: list[asyncio.Task] = []

    def start(self) -> None:
        """On the server's main loop: each model's queue and the worker that empties it."""
        self.loop = asyncio.get_running_loop()
        for name in self.comparisons:
            self._queues[name] = asyncio.Queue(MIRROR_QUEUE)
            self._workers.append(asyncio.create_task(self._worker(name), name=f"shadow {name}"))

    async def stop(self) -> None:
        for task in self._workers:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def keeps(self, slot, request_id: str) -> bool:
        """Whether this request is drawn for the sample: its inputs are then kept past its run."""
        return slot.model.info.name in self.comparisons and random.random() < self.fraction

    def answered(self, answer) -> None:
        """The champion's answer kept for labels; a drawn one queued for the challenger."""
        if answer.results is None:
            return
        name, slot = answer.slot.model.info.name, answer.slot
        shadow = self.comparisons.get(name)
        if shadow is None:
            return
        champion, challenger = self._pair(name, shadow)
        # A request that named another version is not the champion's traffic.
        if challenger is None or slot is not champion:
            return
        server_id = answer.exchange.server_id
        shadow.answered(server_id, answer.results)
        if self not in answer.keepers:
            return
        pair = (
            challenger,
            slot.version,
            server_id,
            answer.inputs,
            answer.request.rows,
            answer.results,
            answer.ms,
            answer.exchange.source,
        )
        if asyncio.get_running_loop() is self.loop:
            self._enqueue(name, slot, pair)
        else:
            # Answered on another HTTP loop: the queues are the main loop's.
            self.loop.call_soon_threadsafe(self._enqueue, name, slot, pair)

    def _enqueue(self, name: str, slot, pair: tuple) -> None:
        queue = self._queues.get(name)
        if queue is None or queue.full() or slot.batcher.queued_rows > 0:
            self.comparisons[name].dropped((slot.version, pair[0].version))
            return
        queue.put_nowait(pair)

    async def _worker(self, name: str) -> None:
        """One model's mirrored requests, one at a time, on its challenger's batcher."""
        queue, shadow = self._queues[name], self.comparisons[name]
        while True:
            (
                challenger,
                version,
                server_id,
                feeds,
                rows,
                champion,
                champion_ms,
                source,
            ) = await queue.get()
            versions = (version, challenger.version)
            started = time.perf_counter()
            try:
                answer = await asyncio.wait_for(
                    challenger.batcher.submit(feeds, rows), self.timeout
                )
            except (QueueFull, BatcherClosed, RunTimedOut, asyncio.TimeoutError):
                # The server's load, not the challenger's fault.
                shadow.dropped(versions)
                continue
            except Exception as exc:  # noqa: BLE001
                # a failing challenger is what is counted
                log.warning(
                    "shadow: %s version %s failed request %s: %s",
                    name,
                    challenger.version,
                    server_id,
                    clip(str(exc) or type(exc).__name__, 200),
                )
                shadow.error(versions)
                continue
            took = (time.perf_counter() - started) * 1e3
            # Hashing a large input takes a while: off the loop.
            digest = await asyncio.to_thread(input_digest, feeds)
            shadow.pair(server_id, champion, answer, champion_ms, took, versions, digest, source)

    def _pair(self, name: str, shadow: Shadow):
        """(champion, challenger) served now, and the comparison set to that pairing (afresh when
        either moved); (None, None) when there is nothing to compare."""
        model = self.repository.models.get(name)
        champion = model.default_slot() if model is not None else None
        challenger = self._challenger(model) if champion is not None else None
        if challenger is None or challenger is champion:
            return None, None
        info = champion.model.info
        shadow.pairing(champion.version, challenger.version, info.decision, info.prediction)
        return champion, challenger

    def _challenger(self, model):
        """The loaded version behind the model's @<alias>, if any."""
        served = [a for a in model.alias_served if a.rpartition("@")[2] == self.alias]
        return model.slots.get(model.alias_served[served[0]]) if served else None

    def comparison(self, name: str) -> Shadow:
        """The comparison of `name`, paired with the versions served now; Refused 404 if none."""
        # A 404 naming the models for an unknown one.
        self.repository.model(name)
        shadow = self.comparisons.get(name)
        if shadow is None:
            raise Refused(
                404,
                f"model '{name}' has no shadow comparison: start the server with --shadow FRACTION "
                f"and the model as models:/<name>@<alias> with an @{self.alias}",
            )
        self._pair(name, shadow)
        return shadow

    def reports(self) -> dict[str, dict]:
        """The report of each loaded model's comparison, for /metrics."""
        return {
            name: self.comparison(name).report()
            for name in self.comparisons
            if name in self.repository.models
        }
