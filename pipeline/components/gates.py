"""The gates an exported model must pass before it may be registered, as plain functions.

Each gate returns a dict that goes as-is into `export_report.json`:
    {"passed": bool, "message": "...", <measured values and their limits>}
and `metrics(report)` flattens the numbers for MLflow. A gate never raises on a bad model: it
measures and says by how much it missed, so the report explains every failure.

Parity is measured on real validation inputs in fp32 against a PyTorch reference model. The
relative difference is taken per sample against the largest logit magnitude of that sample:
an element-wise ratio explodes on logits that happen to sit near zero and would fail for nothing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch

PARITY_BATCHES = (1, 7, 64)
# fp16 keeps ~3 decimal digits: logits of magnitude ~10 move by ~1e-2, so the fp16 variant is
# judged on probabilities and on decisions, with its own limits.
FP16_PROB_ATOL = 1e-2
FP16_MIN_AGREEMENT = 0.99
FP16_ACCURACY_PP = 1.0     # at least this much room on accuracy (export.accuracy_tolerance_pp if larger)
FP16_LOGIT_SCALE = (100, 10)  # export.atol and export.rtol are multiplied by these for fp16 logits


def session(model: onnx.ModelProto | str | Path, providers: list[str] | None = None, threads: int = 0):
    """An onnxruntime session; CPU unless told otherwise (parity is proven on the CPU provider)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(source, options, providers=providers or ["CPUExecutionProvider"])


def check_model(path: Path) -> dict:
    """onnx.checker with the full check (includes strict shape inference), run on the saved file."""
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return {"passed": False, "message": f"onnx.checker failed: {first}"}
    return {"passed": True, "message": "onnx.checker.check_model(full_check=True) passed"}


def run_onnx(sess, x: np.ndarray, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(logits, probabilities) for all of `x`, fed in batches of `batch_size`."""
    logits, probs = [], []
    for i in range(0, len(x), batch_size):
        lo, pr = sess.run(["logits", "probabilities"], {"input": x[i:i + batch_size]})
        logits.append(lo)
        probs.append(pr)
    return np.concatenate(logits), np.concatenate(probs)


@torch.no_grad()
def run_torch(model: torch.nn.Module, x: np.ndarray, batch_size: int = 256) -> tuple[np.ndarray, np.ndarray]:
    model.eval()
    logits = torch.cat([model(torch.from_numpy(x[i:i + batch_size])) for i in range(0, len(x), batch_size)])
    return logits.numpy(), torch.softmax(logits, dim=1).numpy()


def batch_of(x: np.ndarray, size: int) -> np.ndarray:
    """The first `size` validation samples, cycling when the split is smaller than the batch."""
    idx = np.arange(size) % len(x)
    return np.ascontiguousarray(x[idx])


def compare(onnx_out: tuple[np.ndarray, np.ndarray], ref_out: tuple[np.ndarray, np.ndarray],
            atol: float, rtol: float, prob_atol: float | None = None, min_agreement: float = 1.0) -> dict:
    """Differences between two (logits, probabilities) pairs, and whether they are within limits.

    fp32 parity limits logits (atol, rtol); `prob_atol` adds a limit on probabilities (fp16 variant,
    where logits are only checked loosely); decisions must agree on at least `min_agreement`.
    """
    (lo, pr), (rlo, rpr) = onnx_out, ref_out
    diff = np.abs(lo.astype(np.float64) - rlo.astype(np.float64))
    scale = np.maximum(np.abs(rlo).max(axis=1, keepdims=True), np.finfo(np.float32).tiny)
    out = {
        "samples": int(len(lo)),
        "max_abs": float(diff.max(initial=0.0)),
        "max_rel": float((diff / scale).max(initial=0.0)),
        "prob_max_abs": float(np.abs(pr.astype(np.float64) - rpr).max(initial=0.0)),
        "argmax_agreement": float((lo.argmax(1) == rlo.argmax(1)).mean()) if len(lo) else 1.0,
        "atol": atol, "rtol": rtol, "min_agreement": min_agreement,
    }
    misses = []
    nonfinite = int((~np.isfinite(lo)).any(axis=1).sum() + (~np.isfinite(pr)).any(axis=1).sum())
    if nonfinite:  # NaN compares false with everything: without this, NaN outputs would pass
        misses.append(f"{nonfinite} samples with NaN/Inf outputs")
    # allclose-style, per element: |diff| <= atol + rtol * (the sample's largest |logit|). Either
    # limit alone is wrong: logits of 180 legitimately differ by 1e-4 in fp32, and near-zero
    # logits make any relative measure explode.
    excess = diff - (atol + rtol * scale)
    out["max_excess"] = float(excess.max(initial=-np.inf)) if diff.size else 0.0
    if not out["max_excess"] <= 0:
        worst = np.unravel_index(np.nanargmax(excess), excess.shape) if np.isfinite(excess).any() else (0, 0)
        misses.append(f"|diff| exceeds atol {atol:.3g} + rtol {rtol:.3g} x |logits| by {out['max_excess']:.3g} "
                      f"(max_abs {out['max_abs']:.3g}, max_rel {out['max_rel']:.3g}; worst at sample {worst[0]})")
    if prob_atol is not None:
        out["prob_atol"] = prob_atol
        if not out["prob_max_abs"] <= prob_atol:
            misses.append(f"prob_max_abs {out['prob_max_abs']:.3g} > {prob_atol:.3g}")
    if out["argmax_agreement"] < min_agreement:
        misses.append(f"argmax agreement {out['argmax_agreement']:.2%} < {min_agreement:.2%} "
                      f"({round((1 - out['argmax_agreement']) * out['samples'])} of {out['samples']} differ)")
    out["passed"] = not misses
    out["message"] = "; ".join(misses) if misses else (
        f"max_abs {out['max_abs']:.3g}, max_rel {out['max_rel']:.3g}, argmax agreement {out['argmax_agreement']:.2%}")
    return out


def parity(sess, reference: torch.nn.Module, val_x: np.ndarray, atol: float, rtol: float,
           batches=PARITY_BATCHES, **limits) -> dict[str, dict]:
    """One gate per batch size (each fed as a single run), plus the whole split in batches of 64."""
    gates = {}
    for size in batches:
        x = batch_of(val_x, size)
        gates[f"parity.b{size}"] = compare(run_onnx(sess, x, size), run_torch(reference, x), atol, rtol, **limits)
    gates["parity.val"] = compare(run_onnx(sess, val_x, 64), run_torch(reference, val_x), atol, rtol, **limits)
    return gates


def accuracy(sess, reference: torch.nn.Module, val_x: np.ndarray, val_y: np.ndarray, tolerance_pp: float) -> dict:
    """Accuracy through onnxruntime on the whole split vs the PyTorch model's, in percentage points."""
    onnx_pred = run_onnx(sess, val_x, 64)[0].argmax(1)
    torch_pred = run_torch(reference, val_x)[0].argmax(1)
    onnx_acc = float((onnx_pred == val_y).mean() * 100)
    torch_acc = float((torch_pred == val_y).mean() * 100)
    gap = abs(onnx_acc - torch_acc)
    passed = gap <= tolerance_pp + 1e-9
    return {
        "passed": passed, "samples": int(len(val_y)),
        "onnx_accuracy_pct": onnx_acc, "torch_accuracy_pct": torch_acc, "gap_pp": gap, "tolerance_pp": tolerance_pp,
        "message": (f"ONNX {onnx_acc:.2f}% vs PyTorch {torch_acc:.2f}%: gap {gap:.3f} pp"
                    + ("" if passed else f" > {tolerance_pp} pp (by {gap - tolerance_pp:.3f} pp)")),
    }


def ort_optimize(source: Path, destination: Path) -> Path:
    """onnxruntime's offline graph optimization, saved. EXTENDED fusions are tuned for the provider
    they ran with (CPU here): serve the optimized file with that provider, the plain one elsewhere."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(destination)
    ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
    return destination


def to_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """fp16 weights and compute for GPU serving; inputs and outputs stay fp32 (casts at the edges)."""
    import onnx_ir as ir
    from onnxruntime.transformers.float16 import convert_float_to_float16

    converted = convert_float_to_float16(model, keep_io_types=True)
    # The converter appends its input casts at the end of the node list; onnxruntime tolerates that,
    # onnx.checker (rightly) does not: sort the graph topologically.
    graph = ir.from_proto(converted)
    graph.graph.sort()
    return ir.to_proto(graph)


def metrics(gates: dict[str, dict]) -> dict[str, float]:
    """MLflow metrics: `export.<gate>.passed` (1/0) and every number a gate measured."""
    out: dict[str, float] = {}
    for name, gate in gates.items():
        out[f"export.{name}.passed"] = float(gate["passed"])
        for key, value in gate.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"export.{name}.{key}"] = float(value)
    out["export.passed"] = float(all(g["passed"] for g in gates.values()))
    return out
