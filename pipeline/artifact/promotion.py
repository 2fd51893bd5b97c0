"""Champion vs challenger: the alias moves only to a model at least as good as the one holding it,
and only to one its clients can still call.

Export calls `decide` after every gate passed. First the input/output contract (`contract_of`: input
and output names, dtypes and shapes apart from dynamic axes, the task, which outputs carry the
decision and the prediction, the class labels): a candidate whose contract differs from the holder's
would break every client of the alias, so it is registered under the challenger alias and the reason
names each difference, unless export.allow_contract_change says the change is meant. Then the
metric: the candidate and the holder are measured the same way, each ONNX file over the same
validation inputs in its own fresh process (so that peak memory is the model's alone), with
onnxruntime's CPU provider and the same thread count; the task's metric is computed here from their
outputs and the split's targets. The report says what was measured and why the alias moved or did
not.

"The holder is broken" is decided on the holder alone: it can't be fetched, or it does not load and
run its own input example (the one logged with it; zeros in its declared shapes where none was).
Then a server following the alias can't serve it either, and the candidate takes the alias. A holder
that runs its own inputs but not this split's is not broken: it is another contract, or not
comparable on this data. onnxruntime's error text is kept whole, on one line.

One decision at a time per registered model: MLflow has no lock, but it numbers versions atomically.
So the candidate is registered first (no alias, tagged lineage.PROMOTION=pending), waits until every
lower-numbered pending version has decided, and only then compares against whoever holds the alias
now (again, if it moved since the first comparison) and moves it. Two exports at once are thus
compared with each other, never both promoted over a champion only one of them saw
(`promote_in_turn`). When an alias moves, the version that held it and its run's verdict tag say
which version holds it now (`record_alias_moved`).
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

from serving import lineage

log = logging.getLogger(__name__)

# the same for both models: a fair latency comparison on any machine
MEASURE_THREADS = 2
MEASURE_TIMEOUT_S = 600
# on a version: pending | promoted | not promoted
TAG = lineage.PROMOTION
PENDING = "pending"
# A pending version older than this is an export that died mid-decision: its turn passes (two
# measurements and the registry calls fit well within it).
PENDING_STALE_S = 2 * MEASURE_TIMEOUT_S + 300
TURN_POLL_S = 0.5
# A holder's logged input example is read only below this size (export logs 2 rows).
EXAMPLE_BYTES = 64 << 20


class MeasureError(RuntimeError):
    """A model could not be loaded or run in the measuring process; the message is the error's whole
    text."""


def decide(
    candidate: Path,
    name: str,
    alias: str,
    val,
    task,
    promote: str,
    tolerance: float,
    allow_contract_change: bool = False,
) -> dict[str, Any]:
    """The comparison for export_report.json: {"promote": bool, "reason", "metric", "candidate",
    "champion", ...}."""
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
        held = f"@{alias} v{holder}"
        try:
            champion = tracking.download_version_onnx(name, holder, Path(tmp) / "champion")
        except Exception as exc:  # noqa: BLE001
            # whatever the store raises
            return _broken(result, held, f"it can't be fetched: {one_line(exc)}")
        if broken := run_own_example(champion, Path(tmp) / "own.npz"):
            return _broken(result, held, broken)
        changes = contract_changes(contract_of(champion), contract_of(candidate))
        if changes:
            result["champion"]["contract_changes"] = changes
            said = "; ".join(changes)
            if not allow_contract_change:
                log.warning(
                    "the input/output contract differs from %s's: %s; clients of @%s would break",
                    held,
                    said,
                    alias,
                )
                return result | {
                    "promote": False,
                    "reason": f"the input/output contract differs from {held}'s: {said}; "
                    f"clients of @{alias} would break; register it under another name "
                    "(export.registered_model_name) or pass `export.allow_contract_change=true`",
                }
            if not comparable(changes):
                return result | {
                    "promote": True,
                    "reason": f"the input/output contract differs from {held}'s ({said}), which "
                    "export.allow_contract_change=true allows; the two can't be measured on the "
                    "same inputs, so the candidate, which passed every gate, takes the alias",
                }
        try:
            result["champion"] |= measure(champion, inputs, targets, task)
        except MeasureError as exc:
            # It runs its own example (above): this split is what it can't take, which breaks
            # nothing.
            result["champion"]["error"] = str(exc)
            return result | {
                "promote": promote == "always",
                "reason": f"{held} runs its own input example but not this validation split "
                f"({exc}); not compared"
                + (
                    ": promoted because export.promote=always"
                    if promote == "always"
                    else ": not promoted (export.promote=always would move it)"
                ),
            }
    moves, gain, why = verdict(
        result["candidate"][metric], result["champion"][metric], mode, promote, tolerance
    )
    return result | {
        "promote": moves,
        "gain": gain,
        "reason": f"{metric}: candidate {why.format(held)}"
        + (f" (contract change allowed: {'; '.join(changes)})" if changes else ""),
    }


def _broken(result: dict, held: str, why: str) -> dict[str, Any]:
    log.warning("%s can't be served: %s", held, why)
    return result | {
        "promote": True,
        "champion": result["champion"] | {"error": why},
        "reason": f"{held} can't be served: {why}; a champion that can't be served can't be "
        "compared, so the candidate, which passed every gate, takes the alias",
    }


def one_line(exc: BaseException) -> str:
    """An error's whole text on one line (onnxruntime's span several: the cause is rarely the
    last)."""
    return " ".join(str(exc).split()) or type(exc).__name__


# --- the input/output contract ------------------------------------------------------------------


def contract_of(path: Path) -> dict[str, Any]:
    """What a client of the model at `path` relies on, from the graph and its metadata alone: every
    input and output by name with its dtype and shape (-1 on a dynamic axis), the task, the outputs
    that carry the decision and the prediction, and the class labels."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    props = {p.key: p.value for p in model.metadata_props}

    def values(vs) -> dict[str, tuple[str, tuple]]:
        return {
            v.name: (
                str(onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type))
                if v.type.tensor_type.elem_type
                else "?",
                tuple(
                    d.dim_value if d.HasField("dim_value") else -1
                    for d in v.type.tensor_type.shape.dim
                ),
            )
            for v in vs
        }

    try:
        labels = json.loads(props.get(lineage.LABELS) or "null")
    except ValueError:
        labels = props.get(lineage.LABELS)
    return {
        "inputs": values(model.graph.input),
        "outputs": values(model.graph.output),
        "task": props.get(lineage.TASK, ""),
        "decision": props.get(lineage.DECISION, ""),
        "prediction": props.get(lineage.PREDICTION, ""),
        "labels": labels,
    }


def contract_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Each way a client of `old` would find `new` different, in words: "input 'input': [-1,1,8,8]
    -> [-1,3,32,32]", "output 'logits' removed", "labels: 10 -> 12 (...)" ([]: none)."""

    def shape(dims: tuple) -> str:
        return "[" + ",".join(str(d) for d in dims) + "]"

    changes = []
    for what in ("input", "output"):
        before, after = old[f"{what}s"], new[f"{what}s"]
        for name in before:
            if name not in after:
                changes.append(f"{what} '{name}' removed")
                continue
            (dtype_a, dims_a), (dtype_b, dims_b) = before[name], after[name]
            if dtype_a != dtype_b:
                changes.append(f"{what} '{name}': {dtype_a} -> {dtype_b}")
            if dims_a != dims_b:
                changes.append(f"{what} '{name}': {shape(dims_a)} -> {shape(dims_b)}")
        changes += [f"{what} '{name}' added" for name in after if name not in before]
    for key, said in (
        ("task", "task"),
        ("decision", "the output that decides"),
        ("prediction", "the output that predicts"),
    ):
        if old[key] != new[key]:
            changes.append(f"{said}: {old[key] or '(none)'} -> {new[key] or '(none)'}")
    if old["labels"] != new["labels"]:
        changes.append(f"class labels: {_labels(old['labels'])} -> {_labels(new['labels'])}")
    return changes


def comparable(changes: list[str]) -> bool:
    """Whether two models whose contracts differ by `changes` can still be measured on the same
    inputs by the same metric: only their class labels (names) may differ."""
    return all(change.startswith("class labels:") for change in changes)


def _labels(labels) -> str:
    if not isinstance(labels, list):
        return "(none)" if labels is None else repr(labels)
    shown = ", ".join(str(x) for x in labels[:6]) + (", ..." if len(labels) > 6 else "")
    return f"{len(labels)} [{shown}]"


def run_own_example(onnx_path: Path, npz: Path) -> str:
    """Why the model at `onnx_path` can't be served ("" when it can): it is loaded and run, in a
    process of its own, on its own input example (`input_example.json`, which export logs beside
    model.onnx), else on zeros in its declared shapes (1 on a dynamic axis)."""
    try:
        feeds = own_example(onnx_path)
    except Exception as exc:  # noqa: BLE001
        # a file that does not parse as ONNX
        return f"its graph can't be read ({one_line(exc)})"
    np.savez(npz, **{f"0/{k}": v for k, v in feeds.items()})
    try:
        _run_measuring(onnx_path, npz, npz.with_name("own-out.npz"))
    except MeasureError as exc:
        return f"it does not run its own input example: {exc}"
    return ""


def own_example(onnx_path: Path) -> dict[str, np.ndarray]:
    """The model's own example inputs by name, in the dtypes its graph declares."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    declared = {
        v.name: (
            onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type),
            [d.dim_value if d.HasField("dim_value") else 1 for d in v.type.tensor_type.shape.dim],
        )
        for v in model.graph.input
    }
    logged = onnx_path.parent / "input_example.json"
    example = {}
    if logged.is_file() and logged.stat().st_size <= EXAMPLE_BYTES:
        try:
            found = json.loads(logged.read_text())
            if isinstance(found, dict):
                example = {k: np.asarray(found[k], dtype=d) for k, (d, _) in declared.items()}
        except (KeyError, TypeError, ValueError):
            example = {}
    return example or {k: np.zeros(shape, dtype=d) for k, (d, shape) in declared.items()}


def promote_in_turn(
    model_uri: str,
    name: str,
    alias: str,
    challenger_alias: str,
    tags: dict[str, str],
    decision: dict[str, Any],
    compare: Callable[[], dict[str, Any]],
) -> tuple[str, str, dict]:
    """Register `model_uri` as a new version of `name` and move `alias` to it if it wins against the
    holder at its turn (else `challenger_alias`). `decision` is the comparison made before
    registering; `compare` makes it again, against whoever holds the alias then. Returns (version,
    the alias it got, the decision)."""
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
        before = holder if won == alias else tracking.alias_version(name, won)
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
    if before is not None and before != version:
        why = decision["reason"] if won == alias else f"not promoted: {decision['reason']}"
        record_alias_moved(name, won, before, version, why)
    return version, won, decision


def record_alias_moved(name: str, alias: str, old: str, new: str, why: str) -> None:
    """`alias` moved from version `old` to `new` (because `why`): what described `old` as its holder
    says so now. Its description's "Why it holds @alias" becomes "Why it held", with a last
    paragraph naming the new holder and why; the verdict tag of the run it was registered from,
    where it named `old` with that alias, names the new holder. A store that refuses is said in the
    log, never a failed export: the alias has moved."""
    from pipeline import tracking

    esc = tracking.markdown_escaped
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    try:
        text = tracking.version_description(name, old)
        text = text.replace(f"Why it holds {esc('@' + alias)}:", f"Why it held {esc('@' + alias)}:")
        tracking.describe_version(
            name,
            old,
            text
            + "\n\n"
            + esc(f"@{alias} is on v{new} since {when}: {why}. This version no longer holds it."),
        )
        run_id = tracking.version_run_id(name, old)
        verdict = tracking.run_tags(run_id).get(lineage.VERDICT, "") if run_id else ""
        if verdict.startswith(f"{name} v{old} @{alias}"):
            tracking.set_tags(
                {lineage.VERDICT: f"{name} v{old}: @{alias} moved to v{new} ({when})"}, run_id
            )
    except Exception as exc:  # noqa: BLE001
        # the record of a move that is made
        log.warning(
            "@%s moved from v%s to v%s, but v%s's record could not say so: %s",
            alias,
            old,
            new,
            old,
            one_line(exc),
        )


def record_alias_taken(name: str, version: str, old_alias: str, alias: str, why: str) -> None:
    """Version `version` left `old_alias` for `alias` (`pipeline promote`): its description's "Why
    it holds @old_alias" becomes "Why it held", and its run's verdict tag, where it named it with
    `old_alias`, names `alias` and why."""
    from pipeline import tracking

    esc = tracking.markdown_escaped
    try:
        text = tracking.version_description(name, version)
        held = f"Why it holds {esc('@' + old_alias)}:"
        if held in text:
            tracking.describe_version(
                name, version, text.replace(held, f"Why it held {esc('@' + old_alias)}:")
            )
        run_id = tracking.version_run_id(name, version)
        verdict = tracking.run_tags(run_id).get(lineage.VERDICT, "") if run_id else ""
        if verdict.startswith(f"{name} v{version} @{old_alias}"):
            tracking.set_tags({lineage.VERDICT: f"{name} v{version} @{alias} ({why})"}, run_id)
    except Exception as exc:  # noqa: BLE001
        # the record of a move that is made
        log.warning(
            "v%s's record could not say it holds @%s now: %s", version, alias, one_line(exc)
        )


def _wait_for_turn(name: str, version: str) -> None:
    """Until no lower-numbered version of `name` is pending (stale ones, of a dead export, don't
    count)."""
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
    """Whether the candidate's metric `mine` beats the champion's `theirs` as `promote` asks; the
    gain (positive = better, in the metric's units) and the reason, with {} where the champion is
    named."""
    gain = (mine - theirs) if mode == "max" else (theirs - mine)
    # a metric that could not be computed (NaN) never wins, and always loses
    if gain != gain:
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


def _write_inputs(val, path: Path) -> tuple[Path, list]:
    """The validation split's inputs, batch by batch, for the measuring processes; its targets stay
    here."""
    from pipeline.artifact.gates import VAL_BATCH, feeds_of
    from pipeline.components.data import eval_loader

    arrays, targets = {}, []
    for i, (inputs, target) in enumerate(eval_loader(val, VAL_BATCH)):
        arrays.update({f"{i}/{k}": v for k, v in feeds_of(inputs).items()})
        targets.append(target)
    np.savez(path, **arrays)
    return path, targets


def measure(onnx_path: Path, inputs: Path, targets: list, task) -> dict[str, Any]:
    """The task's metrics of one ONNX file on the split, with its latency and peak memory, measured
    in a fresh process (which imports no torch: its memory is onnxruntime's and the model's)."""
    import torch

    with tempfile.TemporaryDirectory(prefix="trainserve-measure-") as tmp:
        out = Path(tmp) / "outputs.npz"
        stats = _run_measuring(onnx_path, inputs, out)
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


def _run_measuring(onnx_path: Path, inputs: Path, outputs: Path) -> dict[str, Any]:
    """`_measure_here` in a fresh process; its figures, or MeasureError with the error's whole
    text."""
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pipeline.artifact.promotion",
                str(onnx_path),
                str(inputs),
                str(outputs),
            ],
            capture_output=True,
            text=True,
            timeout=MEASURE_TIMEOUT_S,
            env=dict(os.environ, OMP_NUM_THREADS=str(MEASURE_THREADS)),
        )
    except subprocess.TimeoutExpired:
        raise MeasureError(f"it ran past {MEASURE_TIMEOUT_S} s") from None
    said = proc.stdout.strip().splitlines()[-1:] or [""]
    try:
        answer = json.loads(said[0])
    except ValueError:
        answer = None
    if proc.returncode == 0 and isinstance(answer, dict) and "error" not in answer:
        return answer
    if isinstance(answer, dict) and "error" in answer:
        raise MeasureError(" ".join(str(answer["error"]).split()))
    # it died without a word of its own (a signal, a crash in native code): what it printed, whole
    text = " ".join((proc.stderr or proc.stdout).split()) or f"exit status {proc.returncode}"
    raise MeasureError(f"the measuring process ended with status {proc.returncode}: {text}")


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
    # no /proc: an upper bound
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


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
    # warm-up: first-run allocations are not latency
    sess.run(names, batches[0])
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
    try:
        print(json.dumps(_measure_here(*sys.argv[1:4])))
    except Exception as exc:  # noqa: BLE001
        # onnxruntime's own errors: the parent says them whole
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        sys.exit(1)
