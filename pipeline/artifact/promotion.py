"""Champion vs challenger: the alias moves only to a model at least as good as the one holding it.

Export calls `decide` after every gate passed. The candidate and the alias holder are measured the
same way: each ONNX file runs over the same validation inputs in its own fresh process (so that peak
memory is the model's alone), with onnxruntime's CPU provider and the same thread count; the task's
metric is then computed here from their outputs and the split's targets. The report says what was
measured and why the alias moved or did not.

One decision at a time per registered model: MLflow has no lock, but it numbers versions atomically. So
the candidate is registered first (no alias, tagged lineage.PROMOTION=pending), waits until every
lower-numbered pending version has decided, and only then compares against whoever holds the alias now
(again, if it moved since the first comparison) and moves it. Two exports at once are thus compared with
each other, never both promoted over a champion only one of them saw (`promote_in_turn`).

Explicit cases: no holder yet (the first model: promoted); a holder that can't be fetched or run
(promoted, since a server following the alias can't load it either, and the reason says so); a
holder of another task or other inputs/outputs (not comparable: promoted only with promote=always).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.tools.logs import first_line
from serving import lineage

log = logging.getLogger(__name__)

MEASURE_THREADS = 2  # the same for both models: a fair latency comparison on any machine
MEASURE_TIMEOUT_S = 600
TAG = lineage.PROMOTION  # on a version: pending | promoted | not promoted
PENDING = "pending"
# A pending version older than this is an export that died mid-decision: its turn passes (two measurements
# and the registry calls fit well within it).
PENDING_STALE_S = 2 * MEASURE_TIMEOUT_S + 300
TURN_POLL_S = 0.5


def decide(
    candidate: Path, name: str, alias: str, val, task, promote: str, tolerance: float
) -> dict[str, Any]:
    """The comparison for export_report.json: {"promote": bool, "reason", "metric", "candidate", "champion", ...}."""
    from pipeline import tracking

    metric, mode = task.primary, task.mode
    result: dict[str, Any] = {
        "policy": promote,
        "tolerance": tolerance,
        "metric": metric,
        "mode": mode,
        "alias": alias,
        "champion": None,
    }
    with tempfile.TemporaryDirectory(prefix="trainserve-compare-") as tmp:
        inputs, targets = _write_inputs(val, Path(tmp) / "inputs.npz")
        result["candidate"] = measure(candidate, inputs, targets, task)
        holder = tracking.alias_version(name, alias)
        if holder is None:
            return result | {"promote": True, "reason": f"first model: {name} has no @{alias} yet"}
        result["champion"] = {"version": holder}
        try:
            champion = tracking.download_version_onnx(name, holder, Path(tmp) / "champion")
            mismatch = not_comparable(candidate, champion)
            if not mismatch:
                result["champion"] |= measure(champion, inputs, targets, task)
        except Exception as exc:  # noqa: BLE001 - a download, a file onnxruntime refuses, a crashed measurement
            why = first_line(exc)
            log.warning("the current @%s (v%s) can't be evaluated: %s", alias, holder, why)
            return result | {
                "promote": True,
                "champion": {"version": holder, "error": why},
                "reason": f"@{alias} v{holder} can't be loaded or run ({why}); a champion that can't "
                "be served can't be compared, so the candidate, which passed every gate, "
                "takes the alias",
            }
    if mismatch:
        result["champion"]["not_comparable"] = mismatch
        return result | {
            "promote": promote == "always",
            "reason": f"@{alias} v{holder} is not comparable ({mismatch})"
            + (
                "; promoted because export.promote=always"
                if promote == "always"
                else "; not promoted: set export.promote=always, or export.registered_model_name "
                "to register this model under its own name"
            ),
        }
    moves, gain, why = verdict(
        result["candidate"][metric], result["champion"][metric], mode, promote, tolerance
    )
    return result | {
        "promote": moves,
        "gain": gain,
        "reason": f"{metric}: candidate {why.format(f'@{alias} v{holder}')}",
    }


def promote_in_turn(
    model_uri: str,
    name: str,
    alias: str,
    challenger_alias: str,
    tags: dict[str, str],
    decision: dict[str, Any],
    compare: Callable[[], dict[str, Any]],
) -> tuple[str, str, dict]:
    """Register `model_uri` as a new version of `name` and move `alias` to it if it wins against the holder at
    its turn (else `challenger_alias`). `decision` is the comparison made before registering; `compare` makes
    it again, against whoever holds the alias then. Returns (version, the alias it got, the decision)."""
    from pipeline import tracking

    version = tracking.register_version(model_uri, name, None, tags | {TAG: PENDING})
    try:
        _wait_for_turn(name, version)
        holder = tracking.alias_version(name, alias)
        compared = (decision.get("champion") or {}).get("version")
        if holder != compared:
            log.info(
                "@%s is at %s now, not %s as when this export compared: comparing again",
                alias,
                f"v{holder}" if holder else "no version",
                f"v{compared}" if compared else "no version",
            )
            decision = compare() | {"compared_again": {"before": compared, "now": holder}}
            decision["reason"] += (
                f" (compared again: another export moved @{alias} from "
                f"{f'v{compared}' if compared else 'nowhere'} to v{holder} meanwhile)"
            )
        won = alias if decision["promote"] else challenger_alias
        tracking.move_alias(name, won, version)
    except BaseException as exc:
        tracking.set_version_tags(name, version, {TAG: "not promoted"})
        tracking.describe_version(
            name, version, tracking.markdown_escaped(f"not promoted: export failed: {exc}")
        )
        raise
    tracking.set_version_tags(
        name, version, {TAG: "promoted" if decision["promote"] else "not promoted"}
    )
    return version, won, decision


def _wait_for_turn(name: str, version: str) -> None:
    """Until no lower-numbered version of `name` is pending (stale ones, of a dead export, don't count)."""
    from pipeline import tracking

    said = False
    while True:
        now_ms = time.time() * 1000
        ahead = [
            v
            for v, created in tracking.versions_tagged(name, TAG, PENDING)
            if int(v) < int(version) and now_ms - created < PENDING_STALE_S * 1000
        ]
        if not ahead:
            return
        if not said:
            log.info(
                "%s v%s waits for v%s to decide its promotion first",
                name,
                version,
                ", v".join(sorted(ahead)),
            )
            said = True
        time.sleep(TURN_POLL_S)


def verdict(
    mine: float, theirs: float, mode: str, promote: str, tolerance: float
) -> tuple[bool, float, str]:
    """Whether the candidate's metric `mine` beats the champion's `theirs` as `promote` asks; the gain
    (positive = better, in the metric's units) and the reason, with {} where the champion is named."""
    gain = (mine - theirs) if mode == "max" else (theirs - mine)
    if gain != gain:  # a metric that could not be computed (NaN) never wins, and always loses
        gain = float("-inf") if mine != mine else float("inf")
    moves = {"always": True, "if_better": gain > tolerance, "if_not_worse": gain >= -tolerance}[
        promote
    ]
    word = "better" if gain > 0 else "worse" if gain < 0 else "equal"
    rule = {
        "always": "always",
        "if_better": f"needs a gain > {tolerance:g}",
        "if_not_worse": f"allows a loss <= {tolerance:g}",
    }[promote]
    return (
        moves,
        gain,
        f"{mine:.6g} vs {{}} {theirs:.6g} ({word}, gain {gain:+.6g}; {promote} {rule})",
    )


def not_comparable(candidate: Path, champion: Path) -> str:
    """Why two models can't be judged on the same inputs by the same metric ('' when they can)."""
    import onnx

    def signature(path: Path):
        m = onnx.load(str(path), load_external_data=False)
        props = {p.key: p.value for p in m.metadata_props}
        ios = [(v.name, v.type.tensor_type.elem_type) for v in m.graph.input]
        return props.get(lineage.TASK, "?"), ios, [v.name for v in m.graph.output]

    (t1, in1, out1), (t2, in2, out2) = signature(candidate), signature(champion)
    if t1 != t2:
        return f"its task is {t2}, this model's is {t1}"
    if in1 != in2:
        return f"its inputs are {[n for n, _ in in2]}, this model's are {[n for n, _ in in1]} (names or dtypes differ)"
    if out1 != out2:
        return f"its outputs are {out2}, this model's are {out1}"
    return ""


def _write_inputs(val, path: Path) -> tuple[Path, list]:
    """The validation split's inputs, batch by batch, for the measuring processes; its targets stay here."""
    from pipeline.artifact.gates import VAL_BATCH, feeds_of
    from pipeline.components.data import eval_loader

    arrays, targets = {}, []
    for i, (inputs, target) in enumerate(eval_loader(val, VAL_BATCH)):
        arrays.update({f"{i}/{k}": v for k, v in feeds_of(inputs).items()})
        targets.append(target)
    np.savez(path, **arrays)
    return path, targets


def measure(onnx_path: Path, inputs: Path, targets: list, task) -> dict[str, Any]:
    """The task's metrics of one ONNX file on the split, with its latency and peak memory, measured in a
    fresh process (which imports no torch: its memory is onnxruntime's and the model's)."""
    import torch

    with tempfile.TemporaryDirectory(prefix="trainserve-measure-") as tmp:
        out = Path(tmp) / "outputs.npz"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pipeline.artifact.promotion",
                str(onnx_path),
                str(inputs),
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=MEASURE_TIMEOUT_S,
            env=dict(os.environ, OMP_NUM_THREADS=str(MEASURE_THREADS)),
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"measuring {onnx_path.name} failed: {proc.stderr.strip().splitlines()[-1:]}"
            )
        stats = json.loads(proc.stdout.strip().splitlines()[-1])
        with np.load(out) as outputs:
            state = task.new_state(torch.device("cpu"))
            for i, target in enumerate(targets):
                named = {
                    key.split("/", 1)[1]: torch.from_numpy(outputs[key])
                    for key in outputs.files
                    if key.startswith(f"{i}/")
                }
                task.update(
                    state, {k: v for k, v in named.items() if k not in task.derived}, target
                )
    from pipeline.distributed import DistInfo

    task.reduce(state, DistInfo.cpu_alone())
    return {**task.metrics(state), **stats}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    """This process image's peak RSS (VmHWM). Not getrusage's ru_maxrss: Linux carries that across
    exec from the forking parent, so it would report the exporting process's size."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # no /proc: an upper bound


def _measure_here(onnx_path: str, inputs_path: str, outputs_path: str) -> dict[str, Any]:
    """In the measuring process: load, warm up on the first batch, then time every batch once."""
    import onnxruntime as ort

    before = _rss_mb()
    options = ort.SessionOptions()
    options.intra_op_num_threads = MEASURE_THREADS
    sess = ort.InferenceSession(onnx_path, options, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    with np.load(inputs_path) as data:
        batches: dict[int, dict[str, np.ndarray]] = {}
        for key in data.files:
            i, name = key.split("/", 1)
            batches.setdefault(int(i), {})[name] = data[key]
    sess.run(names, batches[0])  # warm-up: first-run allocations are not latency
    outputs, times, rows = {}, [], 0
    for i in sorted(batches):
        start = time.perf_counter()
        got = sess.run(names, batches[i])
        times.append(time.perf_counter() - start)
        outputs.update({f"{i}/{name}": value for name, value in zip(names, got)})
        rows += len(next(iter(batches[i].values())))
    np.savez(outputs_path, **outputs)
    peak = _peak_rss_mb()
    return {
        "latency_ms_p50": round(float(np.median(times)) * 1e3, 3),
        "latency_ms_p90": round(float(np.quantile(times, 0.9)) * 1e3, 3),
        "batch_rows": len(next(iter(batches[0].values()))),
        "rows_per_s": round(rows / sum(times), 1),
        "peak_rss_mb": round(peak, 1),
        "model_rss_mb": round(peak - before, 1),
        "threads": MEASURE_THREADS,
    }


if __name__ == "__main__":
    print(json.dumps(_measure_here(*sys.argv[1:4])))
