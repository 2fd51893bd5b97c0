"""The gates an exported model must pass before it may be registered, as plain functions.

Each gate returns a dict that goes as-is into `export_report.json`:
    {"passed": bool, "message": "...", <measured values and their limits>}
and `metrics(report)` flattens the numbers for MLflow. A gate never raises on a bad model: it
measures and says by how much it missed, so the report explains every failure.

Parity is measured on real validation inputs against the PyTorch model, through the same
`ExportHead` the graph was exported from. Every output the model returns (each named: `logits`,
`prediction`, a dict's keys, `output_0`...) is held to an allclose-style limit whose relative part
is taken per sample against that sample's largest magnitude: an element-wise ratio explodes on
values that happen to sit near zero and would fail for nothing. Outputs a task adds
(`probabilities`) are reported (and limited for the fp16 variant), and where the task decides by an
argmax over axis 1 (a class per sample or per pixel) the decisions must agree.

An image model's recorded preprocessing (how a server turns an image file into its input) is proven
on the validation split's own image files: decoded and transformed as a server does, they give the
tensors training fed the model (`preprocessing`).

The task's primary metric is computed on the whole validation split twice, through onnxruntime and
through PyTorch, streaming batch by batch (the split need not fit in memory), and the two must agree
within the export's tolerance.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from pipeline.components.data import first_batch, named
from pipeline.distributed.process_group import DistInfo
from pipeline.errors import DataError
from pipeline.tools.logs import clip, first_line

PARITY_BATCHES = (1, 7, 64)
# The served transform of an image file against training's tensor (the same float32 computation, in
# numpy both times: 0 but for a library that rounds otherwise).
PREPROCESSING_ATOL = 1e-6
VAL_BATCH = 64
# fp16 keeps ~3 decimal digits: outputs of magnitude ~10 move by ~1e-2, so the fp16 variant's first
# output is held to scaled limits; a classifier's probabilities and decisions carry its gate.
FP16_PROB_ATOL = 1e-2
FP16_MIN_AGREEMENT = 0.99
# at least this much room on accuracy (export.accuracy_tolerance_pp if larger)
FP16_ACCURACY_PP = 1.0
# at least this much room on another task's metric (export.metric_rtol if larger)
FP16_METRIC_RTOL = 1e-2
# export.atol and export.rtol are multiplied by these for fp16 outputs
FP16_LOGIT_SCALE = (100, 10)
# int8 moves every output by whole quantization steps (~1% of a tensor's range per layer,
# compounding): outputs are held to these multiples of export.atol/rtol, and the task's metric to
# its own int8 tolerance.
INT8_LOGIT_SCALE = (1000, 100)


def session(model: onnx.ModelProto | str | Path, providers: list | None = None, threads: int = 0):
    """An onnxruntime session; CPU unless told otherwise. `providers` as onnxruntime takes them:
    names, or (name, options) pairs.

    onnxruntime creates the session on the next provider when one fails to load, and retries a run
    that fails in a provider on the CPU for good; a gate must know what it measured, so the second
    is switched off here and the first is checked by `provider_gate`."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    sess = ort.InferenceSession(source, options, providers=providers or ["CPUExecutionProvider"])
    sess.disable_fallback()
    return sess


def provider_gate(sess, asked: str) -> dict:
    """Whether `sess` runs on the provider `asked` for (its `get_providers()[0]`): a gate, which
    fails when onnxruntime fell back to another provider: numbers measured there would certify
    nothing about `asked`."""
    ran = sess.get_providers()[0]
    if ran != asked:
        return {
            "passed": False,
            "provider": ran,
            "asked": asked,
            "message": f"asked for {asked}, but onnxruntime created the session on {ran} (the provider did not "
            f"load here): nothing was measured on {asked}",
        }
    return {"passed": True, "provider": ran, "asked": asked, "message": f"runs on {ran}"}


def check_model(path: Path) -> dict:
    """onnx.checker with the full check (includes strict shape inference), run on the saved file."""
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return {"passed": False, "message": f"onnx.checker failed: {first}"}
    return {"passed": True, "message": "onnx.checker.check_model(full_check=True) passed"}


def preprocessing(onnx_path: Path, val) -> dict[str, dict]:
    """{"preprocessing": gate} for a file that records how an image file becomes its input
    (serving/images.py): the validation split's own image files (its `source_images()`), decoded and
    transformed as a server of this file does, must give the tensors training fed the model for
    those samples, within PREPROCESSING_ATOL. {} for a file that records none."""
    from serving import images

    model = onnx.load(str(onnx_path), load_external_data=False)
    try:
        found = images.recorded({p.key: p.value for p in model.metadata_props})
    except ValueError as exc:
        return {"preprocessing": {"passed": False, "message": f"the file's record: {exc}"}}
    if found is None:
        return {}
    name, served = found
    try:
        files = val.source_images() if hasattr(val, "source_images") else []
    except DataError as exc:
        files, missing = [], str(exc)
    else:
        missing = "the validation data gives no image files (its `source_images()`) to prove it on"
    # files of a format a server does not decode (TIFF) prove nothing of what it serves
    skipped = [f for f in files if f[1].lower() not in images.SUFFIXES]
    files = [f for f in files if f[1].lower() in images.SUFFIXES]
    if not files:
        if skipped:
            missing = (
                f"none of the validation data's {len(skipped)} image files is of a format a server decodes "
                f"({', '.join(images.FORMATS)})"
            )
        return {"preprocessing": {"passed": False, "message": missing}}
    worst, worst_at, problems = 0.0, None, []
    for index, suffix, data in files:
        trained = named(val[index][0])[name].numpy()
        try:
            got = images.tensor(served, data)
        except ValueError as exc:
            problems.append(f"sample {index} ({suffix}) is a file a server can't decode: {exc}")
            continue
        if got.shape != trained.shape:
            problems.append(
                f"sample {index}: the server makes {list(got.shape)}, training fed {list(trained.shape)}"
            )
            continue
        diff = float(np.max(np.abs(got.astype(np.float64) - trained))) if got.size else 0.0
        if not diff <= worst:
            worst, worst_at = diff, index
    if not problems and worst > PREPROCESSING_ATOL:
        problems.append(
            f"the server's tensors differ from training's by up to {worst:.4g} (> {PREPROCESSING_ATOL:g}, "
            f"sample {worst_at}): the file records {json.dumps(served.to_json())}, which is not how training "
            "made its inputs"
        )
    gate = {
        "passed": not problems,
        "images": len(files),
        "skipped": len(skipped),
        "max_abs": worst,
        "atol": PREPROCESSING_ATOL,
        "preprocessing": served.to_json(),
    }
    if problems:
        return {"preprocessing": gate | {"message": "; ".join(problems[:3])}}
    return {
        "preprocessing": gate
        | {
            "message": f"{len(files)} validation image files, decoded and transformed as a server does with "
            f"the preprocessing the file records, give the tensors training fed the model (max abs diff "
            f"{worst:.2g} <= {PREPROCESSING_ATOL:g})"
            + (f"; {len(skipped)} of a format a server does not decode left out" if skipped else "")
        }
    }


def feeds_of(inputs) -> dict[str, np.ndarray]:
    """A collated batch's inputs as onnxruntime takes them: numpy arrays by input name."""
    return {name: np.ascontiguousarray(t.numpy()) for name, t in named(inputs).items()}


def run_onnx(sess, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


@torch.no_grad()
def run_torch(head: torch.nn.Module, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The PyTorch reference on `feeds`: every output of the graph (`head.output_names`), as
    numpy."""
    head.eval()
    outputs = head(*(torch.from_numpy(np.array(feeds[n])) for n in head.input_names))
    return {
        name: (out.float() if out.is_floating_point() else out).numpy()
        for name, out in zip(head.output_names, outputs)
    }


class ParityStats:
    """Differences between ONNX and PyTorch outputs, per output, accumulated over batches.

    Every output the model returns is held to atol/rtol; the ones a task derives in the graph
    (`derived`: probabilities) are reported and limited by `prob_atol` only; the decision output's
    argmax over axis 1 (a class per sample, or per pixel) must agree on at least `min_agreement` of
    its positions."""

    def __init__(self, names, derived=(), decision: str | None = None):
        self.derived = [n for n in derived if n in names]
        self.checked = [n for n in names if n not in self.derived]
        self.decision = decision
        self.per = {
            n: {"max_abs": 0.0, "max_rel": 0.0, "max_excess": -np.inf, "worst": 0}
            for n in self.checked
        }
        self.samples = self.nonfinite = self.disagree = self.decided = 0
        self.prob_max_abs = 0.0

    def add(
        self,
        onnx_out: dict[str, np.ndarray],
        ref_out: dict[str, np.ndarray],
        atol: float,
        rtol: float,
    ) -> None:
        n = len(next(iter(ref_out.values())))
        # a sample counts once, however many of its outputs are NaN/Inf
        bad = np.zeros(n, dtype=bool)
        for v in onnx_out.values():
            if np.issubdtype(v.dtype, np.floating):
                bad |= (~np.isfinite(_rows(v))).any(axis=1)
        self.nonfinite += int(bad.sum())
        for name in self.checked:
            self._add_one(self.per[name], _rows(onnx_out[name]), _rows(ref_out[name]), atol, rtol)
        for name in self.derived:
            self.prob_max_abs = max(
                self.prob_max_abs,
                float(np.abs(onnx_out[name].astype(np.float64) - ref_out[name]).max(initial=0.0)),
            )
        if self.decision:
            got, ref = onnx_out[self.decision].argmax(1), ref_out[self.decision].argmax(1)
            self.disagree += int((got != ref).sum())
            self.decided += got.size
        self.samples += n

    def _add_one(
        self, stats: dict, got: np.ndarray, ref: np.ndarray, atol: float, rtol: float
    ) -> None:
        diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
        scale = np.maximum(
            np.abs(ref.astype(np.float64)).max(axis=1, keepdims=True), np.finfo(np.float32).tiny
        )
        if not diff.size:
            return
        finite = np.isfinite(diff).any()
        stats["max_abs"] = max(stats["max_abs"], float(np.nanmax(diff)) if finite else np.inf)
        stats["max_rel"] = max(
            stats["max_rel"], float(np.nanmax(diff / scale)) if finite else np.inf
        )
        # allclose-style, per element: |diff| <= atol + rtol * (the sample's largest |value|).
        # Either limit alone is wrong: logits of 180 legitimately differ by 1e-4 in fp32, and
        # near-zero values make any relative measure explode. NaN counts as a miss (it compares
        # false).
        excess = np.where(np.isnan(diff), np.inf, diff - (atol + rtol * scale))
        batch_worst = float(excess.max())
        if batch_worst > stats["max_excess"]:
            stats["max_excess"] = batch_worst
            stats["worst"] = self.samples + int(np.unravel_index(excess.argmax(), excess.shape)[0])

    def result(
        self, atol: float, rtol: float, prob_atol: float | None = None, min_agreement: float = 1.0
    ) -> dict:
        per = {
            name: {
                k: (v if self.samples else 0.0) if k == "max_excess" else v
                for k, v in stats.items()
            }
            for name, stats in self.per.items()
        }
        worst = max(per, key=lambda name: per[name]["max_excess"]) if per else None
        out: dict[str, Any] = {
            "samples": self.samples,
            "output": worst,
            "atol": atol,
            "rtol": rtol,
            "max_abs": max((p["max_abs"] for p in per.values()), default=0.0),
            "max_rel": max((p["max_rel"] for p in per.values()), default=0.0),
            "max_excess": per[worst]["max_excess"] if worst else 0.0,
        }
        if len(per) > 1:
            out["outputs"] = {
                name: {k: p[k] for k in ("max_abs", "max_rel", "max_excess")}
                for name, p in per.items()
            }
        misses = []
        if self.nonfinite:
            misses.append(f"{self.nonfinite} samples with NaN/Inf outputs")
        for name, p in per.items():
            if not p["max_excess"] <= 0:
                misses.append(
                    f"|diff| of {name} exceeds atol {atol:.3g} + rtol {rtol:.3g} x |{name}| by "
                    f"{p['max_excess']:.3g} (max_abs {p['max_abs']:.3g}, max_rel {p['max_rel']:.3g}; worst at "
                    f"sample {p['worst']})"
                )
        if self.derived:
            out["prob_max_abs"] = self.prob_max_abs
            if prob_atol is not None:
                out["prob_atol"] = prob_atol
                if not self.prob_max_abs <= prob_atol:
                    misses.append(f"prob_max_abs {self.prob_max_abs:.3g} > {prob_atol:.3g}")
        if self.decision:
            agreement = 1 - self.disagree / self.decided if self.decided else 1.0
            out.update(argmax_agreement=agreement, min_agreement=min_agreement)
            if agreement < min_agreement:
                misses.append(
                    f"argmax agreement {agreement:.2%} < {min_agreement:.2%} "
                    f"({self.disagree} of {self.decided} differ)"
                )
        out["passed"] = not misses
        shown = (
            f"max_abs {out['max_abs']:.3g}, max_rel {out['max_rel']:.3g}"
            + (f" over {len(per)} outputs" if len(per) > 1 else "")
            + (f", argmax agreement {out['argmax_agreement']:.2%}" if self.decision else "")
        )
        out["message"] = "; ".join(misses) if misses else shown
        return out


def _rows(a: np.ndarray) -> np.ndarray:
    return a.reshape(len(a), -1)


def compare(
    onnx_out: dict[str, np.ndarray],
    ref_out: dict[str, np.ndarray],
    atol: float,
    rtol: float,
    prob_atol: float | None = None,
    min_agreement: float = 1.0,
    *,
    derived=(),
    decision: str | None = None,
) -> dict:
    """One batch's outputs against the reference's (see ParityStats)."""
    stats = ParityStats(list(ref_out), derived, decision)
    stats.add(onnx_out, ref_out, atol, rtol)
    return stats.result(atol, rtol, prob_atol, min_agreement)


def parity_batches(
    val, dynamic_axes: dict[str, list[int]], head: torch.nn.Module, sizes=PARITY_BATCHES
) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, dict]]:
    """The inputs parity is checked on, by gate name: the first validation samples at each batch
    size (cycling through a split smaller than the batch), and for each dynamic axis the batch of 7
    cut to a shorter length and tiled to a longer one (axes of equal length change together: a token
    axis and its mask). A length the PyTorch model itself can't run (positions past its maximum) is
    replaced by another shorter one. An axis declared dynamic that the PyTorch model can't run at
    two other lengths is a failed gate (returned second): the graph would claim to take lengths it
    was never checked on."""
    batches = {f"b{size}": feeds_of(first_batch(val, size)[0]) for size in sizes}
    failed: dict[str, dict] = {}
    base = batches.get("b7") or next(iter(batches.values()))
    covered: set[tuple[str, int]] = set()
    for name, axes in dynamic_axes.items():
        for axis in axes:
            if (name, axis) in covered:
                continue
            length = base[name].shape[axis]
            together = [
                (n, a) for n, ax in dynamic_axes.items() for a in ax if base[n].shape[a] == length
            ]
            covered.update(together)
            shorter = [
                x
                for x in dict.fromkeys((length // 2, length - 1, (3 * length) // 4))
                if 0 < x < length
            ]
            candidates = [length + length // 2 + 1, *shorter]
            found, errors = 0, []
            for other in candidates:
                feeds = {
                    n: _resized(v, [a for m, a in together if m == n], other)
                    for n, v in base.items()
                }
                try:
                    run_torch(head, feeds)
                except Exception as exc:  # noqa: BLE001
                    # the model's own limit (max positions): try another length
                    errors.append(
                        f"{other}: {type(exc).__name__}: {clip(str(exc).splitlines()[0], 120)}"
                        if str(exc)
                        else f"{other}: {type(exc).__name__}"
                    )
                    continue
                batches[f"{name}_{axis}.len{other}"] = feeds
                found += 1
                if found == 2:
                    break
            if found < 2:
                axes_named = ", ".join(f"{n} axis {a}" for n, a in together)
                failed[f"parity.{name}_{axis}"] = {
                    "passed": False,
                    "message": f"export.dynamic_axes declares {axes_named} dynamic (length {length} in "
                    f"the data), but the PyTorch model itself runs it at {found} of the other lengths tried "
                    f"({'; '.join(errors) or 'none besides it'}): the axis does not vary, or must change together "
                    "with another one (same length in the data)",
                }
    return batches, failed


def rows_independent(head: torch.nn.Module, batches, atol: float, rtol: float) -> dict:
    """Whether the model's rows are its samples' own, which the server's batching rests on: at each
    parity batch size (b1, b7, b64: the first validation samples, so a smaller batch is the first
    rows of a larger one), every output's first axis is the batch size, and a smaller batch's
    outputs are the larger one's first rows within atol/rtol. Checked on the PyTorch model; the
    parity gates hold the graph to it at each of those sizes."""
    sizes = sorted(int(label[1:]) for label in batches if re.fullmatch(r"b[0-9]+", label))
    outputs = {size: run_torch(head, batches[f"b{size}"]) for size in sizes}
    misses = [
        f"{name} of shape {list(out.shape)} at batch {size}"
        for size, found in outputs.items()
        for name, out in found.items()
        if not out.ndim or len(out) != size
    ]
    for small, large in zip(sizes, sizes[1:]):
        if misses:
            break
        first = {name: out[:small] for name, out in outputs[large].items()}
        found = compare(first, outputs[small], atol, rtol)
        if not found["passed"]:
            misses.append(f"the first {small} rows at batch {large} differ: {found['message']}")
    independent = not misses and len(sizes) > 1
    return {
        "independent": independent,
        "batch_sizes": sizes,
        "message": f"rows independent at batch sizes {', '.join(map(str, sizes))}"
        if independent
        else f"rows not independent: {'; '.join(misses) or 'fewer than two batch sizes'}",
    }


def _resized(array: np.ndarray, axes: list[int], length: int) -> np.ndarray:
    """`array` cut or tiled along `axes` to `length`: real values, only their count changes."""
    for axis in axes:
        reps = -(-length // array.shape[axis])
        array = np.take(np.concatenate([array] * reps, axis=axis), range(length), axis=axis)
    return np.ascontiguousarray(array)


def parity(
    sess,
    head: torch.nn.Module,
    batches: dict[str, dict[str, np.ndarray]],
    task,
    atol: float,
    rtol: float,
    **limits,
) -> dict[str, dict]:
    """One gate per prepared batch, each fed as a single run; every output compared."""
    gates = {}
    for label, feeds in batches.items():
        try:
            got = run_onnx(sess, feeds)
        except Exception as exc:  # noqa: BLE001
            # onnxruntime's errors are untyped: a failing gate
            gates[f"parity.{label}"] = {"passed": False, "message": _ort_failure(exc, feeds)}
            continue
        gates[f"parity.{label}"] = compare(
            got,
            run_torch(head, feeds),
            atol,
            rtol,
            derived=task.derived,
            decision=task.decision,
            **limits,
        )
    return gates


def validation(
    sess,
    head: torch.nn.Module,
    val,
    task,
    atol: float,
    rtol: float,
    metric_tolerance: float,
    metric_atol: float = 0.0,
    kept: dict | None = None,
    **limits,
) -> dict[str, dict]:
    """`parity.val` over the whole split and the task's metric gate: onnxruntime and PyTorch side by
    side, a batch at a time, the task's metrics computed from each side's outputs. `kept`: given, it
    gets the ONNX side's metric state ("onnx"), from which export draws the exported model's
    figure."""
    from pipeline.components.data import eval_loader

    stats = ParityStats(head.output_names, task.derived, task.decision)
    onnx_state, torch_state = (
        task.new_state(torch.device("cpu")),
        task.new_state(torch.device("cpu")),
    )
    model_outputs = [n for n in head.output_names if n not in task.derived]
    for inputs, target in eval_loader(val, VAL_BATCH):
        feeds = feeds_of(inputs)
        try:
            got = run_onnx(sess, feeds)
        except Exception as exc:  # noqa: BLE001
            failure = {"passed": False, "message": _ort_failure(exc, feeds)}
            return {"parity.val": failure, task.primary: dict(failure)}
        ref = run_torch(head, feeds)
        stats.add(got, ref, atol, rtol)
        task.update(onnx_state, {n: torch.from_numpy(got[n]) for n in model_outputs}, target)
        task.update(torch_state, {n: torch.from_numpy(ref[n]) for n in model_outputs}, target)
    one = DistInfo.cpu_alone()
    task.reduce(onnx_state, one)
    task.reduce(torch_state, one)
    if kept is not None:
        kept["onnx"] = onnx_state
    gate = task.metric_gate(
        task.metrics(onnx_state), task.metrics(torch_state), metric_tolerance, metric_atol
    )
    # primary: known once measured
    return {
        "parity.val": stats.result(atol, rtol, **limits),
        task.primary: gate,
    }


def metric_gate_limits(export_cfg, variant: str = "fp32") -> dict[str, Any]:
    """The limits of a task gated on a relative metric (regression, custom): export.metric_rtol, at
    least FP16_METRIC_RTOL for fp16, export.int8_metric_rtol for int8 (outputs within
    INT8_LOGIT_SCALE x atol/rtol)."""
    if variant == "int8":
        return {
            "atol": export_cfg.atol * INT8_LOGIT_SCALE[0],
            "rtol": export_cfg.rtol * INT8_LOGIT_SCALE[1],
            "tolerance": export_cfg.int8_metric_rtol,
        }
    if variant == "fp16":
        return {"tolerance": max(export_cfg.metric_rtol, FP16_METRIC_RTOL)}
    return {"tolerance": export_cfg.metric_rtol}


def points_gate(name: str, got: float, ref: float, tolerance: float) -> dict:
    """A fraction (accuracy, mean IoU) through onnxruntime vs PyTorch, within `tolerance` percentage
    points."""
    gap = abs(got - ref) * 100
    passed = gap <= tolerance + 1e-9
    return {
        "passed": passed,
        "metric": name,
        f"onnx_{name}_pct": got * 100,
        f"torch_{name}_pct": ref * 100,
        "gap_pp": gap,
        "tolerance_pp": tolerance,
        "message": (
            f"ONNX {got:.2%} vs PyTorch {ref:.2%}: gap {gap:.3f} pp"
            + ("" if passed else f" > {tolerance} pp (by {gap - tolerance:.3f} pp)")
        ),
    }


def relative_gate(name: str, got: float, ref: float, tolerance: float, atol: float = 0.0) -> dict:
    """Any other metric through onnxruntime vs PyTorch, within `atol` + `tolerance` x
    |PyTorch's|."""
    difference = abs(got - ref)
    limit = atol + tolerance * abs(ref)
    passed = bool(difference <= limit and np.isfinite(got))
    return {
        "passed": passed,
        "metric": name,
        f"onnx_{name}": got,
        f"torch_{name}": ref,
        "difference": difference,
        "rtol": tolerance,
        "atol": atol,
        "message": (
            f"{name}: ONNX {got:.6g} vs PyTorch {ref:.6g}, difference {difference:.3g}"
            + ("" if passed else f" > {atol:g} + {tolerance:g} x {abs(ref):.6g}")
        ),
    }


def values_text(value) -> str:
    """A few numbers of one sample's output or target, for a line of text."""
    flat = np.asarray(value, dtype=np.float64).reshape(-1)
    shown = ", ".join(f"{v:.4g}" for v in flat[:4]) + (", ..." if len(flat) > 4 else "")
    return shown if len(flat) == 1 else f"[{shown}]"


def _ort_failure(exc: Exception, feeds: dict[str, np.ndarray]) -> str:
    shapes = ", ".join(f"{k} {list(v.shape)} {v.dtype}" for k, v in feeds.items())
    first = first_line(exc)
    hint = (
        "; an axis that varies in the data but is fixed in the graph needs export.dynamic_axes"
        if "dimension" in first.lower()
        else ""
    )
    return f"onnxruntime could not run inputs {shapes}: {first}{hint}"


def ort_optimize(source: Path, destination: Path) -> Path:
    """onnxruntime's offline graph optimization, saved. EXTENDED fusions are tuned for the provider
    they ran with (CPU here): serve the optimized file with that provider, the plain one
    elsewhere."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(destination)
    ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
    return destination


def to_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """fp16 weights and compute for GPU serving; inputs and outputs stay fp32 (casts at the
    edges)."""
    import onnx_ir as ir
    from onnxruntime.transformers.float16 import convert_float_to_float16

    converted = convert_float_to_float16(model, keep_io_types=True)
    # The converter appends its input casts at the end of the node list; onnxruntime tolerates that,
    # onnx.checker (rightly) does not: sort the graph topologically.
    graph = ir.from_proto(converted)
    graph.graph.sort()
    return ir.to_proto(graph)


def headline(gates: dict[str, dict]) -> dict[str, float]:
    """The few gate figures a person reads on the run's page: passed, how many gates failed, the
    validation split's parity, and the task's metric on both sides. Every figure of every gate is in
    the table (`table`)."""
    out = {
        "export.passed": float(all(g["passed"] for g in gates.values())),
        "export.failed_gates": float(sum(not g["passed"] for g in gates.values())),
    }
    val = gates.get("parity.val") or {}
    for key in ("max_abs", "argmax_agreement"):
        if _number(val.get(key)):
            out[f"export.parity.val.{key}"] = float(val[key])
    # the task's metric gate ("accuracy", "rmse", ...; not a variant's)
    for (
        name,
        gate,
    ) in gates.items():
        if "." not in name and name != "checker":
            out |= {
                f"export.{name}.{key}": float(v)
                for key, v in gate.items()
                if key.startswith(("onnx_", "torch_")) and _number(v)
            }
    return out


def table(gates: dict[str, dict], prefix: str = "") -> list[dict[str, Any]]:
    """Every gate and every number it measured, a row each (gate, passed, figure, value): the run's
    one table of gate figures (tracking.log_table), where single-value metrics would be dozens of
    one-bar charts."""
    rows = []
    for name, gate in gates.items():
        figures = [(key, value) for key, value in gate.items() if _number(value)]
        figures += [
            (f"{output}.{key}", value)
            for output, numbers in (gate.get("outputs") or {}).items()
            for key, value in numbers.items()
            if _number(value)
        ]
        for figure, value in figures or [("", None)]:
            rows.append(
                {
                    "gate": prefix + name,
                    "passed": bool(gate["passed"]),
                    "figure": figure,
                    "value": None if value is None or not math.isfinite(value) else float(value),
                }
            )
    return rows


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
