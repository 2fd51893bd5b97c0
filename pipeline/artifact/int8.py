"""The int8 variant: the gated fp32 graph quantized with onnxruntime.quantization, for CPU serving.

Two kinds (export.int8): `static` quantizes weights and activations, the activations' ranges
calibrated once on training samples; right for convolutions, whose activations are large and whose
speed-up needs int8 on both sides. `dynamic` quantizes weights ahead and each activation per batch
at run time; right for linear-heavy graphs (transformers, MLPs), where activation ranges vary from
input to input. `auto` picks by the graph: a Conv present -> static, else dynamic.

Settings are those onnxruntime recommends for x86 CPUs without VNNI (AVX2: what users have): uint8
activations, int8 weights per channel, weights in 7 bits (`reduce_range`): AVX2's u8 x s8
multiply-add (vpmaddubsw) saturates its int16 sums with full-range weights, and 7 bits rule that
out. QDQ format: the CPU provider fuses each DequantizeLinear -> op -> QuantizeLinear into one int8
kernel.

When a gate fails, `sensitivity` ranks the quantized nodes by the error each adds (its output's
error against fp32, per channel, less its nearest quantized ancestors'), and the export keeps the
worst ones in float with the nodes that produce their inputs (`nodes_to_exclude`: in QDQ a producer
quantizes its output for every consumer) and tries again, a bounded number of rounds; the report
names what was kept in float.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import onnx

from pipeline.artifact import onnx_export
from pipeline.artifact.gates import feeds_of, session
from pipeline.components.data import eval_loader

log = logging.getLogger("pipeline.int8")

FILE = "model.int8.onnx"
REJECTED = "model.int8.rejected.onnx"
# The nodes that carry a graph's arithmetic, and what quantization replaces: the candidates for
# exclusion.
QUANTIZED_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
CALIBRATION_BATCH = 32


def choose_mode(model: onnx.ModelProto, asked: str) -> str:
    """static or dynamic: `asked` when it names one, else by the graph (a Conv -> static)."""
    if asked in ("static", "dynamic"):
        return asked
    return (
        "static"
        if any(n.op_type in ("Conv", "ConvTranspose") for n in model.graph.node)
        else "dynamic"
    )


def calibration_feeds(train, samples: int) -> list[dict[str, np.ndarray]]:
    """`samples` training samples spread evenly over the split (a split may be ordered by class: its
    first samples would calibrate on one class), as batches of feeds."""
    from pipeline.components.data import spread_sample

    return [
        feeds_of(inputs)
        for inputs, _ in eval_loader(spread_sample(train, samples)[0], CALIBRATION_BATCH)
    ]


def prepare(source: Path, destination: Path) -> Path:
    """onnxruntime's pre-processing for quantization: shape inference and graph optimization
    (BatchNorm folded into its Conv, so that each Conv quantizes as one node). Node names in it are
    what exclusions name."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    quant_pre_process(str(source), str(destination), skip_symbolic_shape=True)
    return destination


def quantize(
    prepared: Path,
    destination: Path,
    mode: str,
    feeds: list[dict[str, np.ndarray]],
    exclude: list[str],
    metadata: dict[str, str],
) -> Path:
    """`prepared` quantized to `destination`, the nodes in `exclude` kept in float; the fp32 file's
    metadata (model name, labels, lineage) copied over: the server names what it serves from it."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )

    if mode == "static":

        class Reader(CalibrationDataReader):
            def __init__(self):
                self._it = iter(feeds)

            def get_next(self):
                return next(self._it, None)

        quantize_static(
            str(prepared),
            str(destination),
            Reader(),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            reduce_range=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            nodes_to_exclude=list(exclude),
            calibrate_method=CalibrationMethod.MinMax,
        )
    else:
        quantize_dynamic(
            str(prepared),
            str(destination),
            per_channel=True,
            reduce_range=True,
            weight_type=QuantType.QInt8,
            nodes_to_exclude=list(exclude),
        )
    model = onnx.load(str(destination))
    onnx.helper.set_model_props(model, metadata)
    # the one writer of ONNX files: a data file past 2 GB
    onnx_export.save(model, destination)
    return destination


def candidates(prepared: onnx.ModelProto, exclude: list[str]) -> list[onnx.NodeProto]:
    return [
        n
        for n in prepared.graph.node
        if n.op_type in QUANTIZED_OPS and n.name and n.name not in exclude
    ]


def sensitivity(
    prepared_path: Path, quantized_path: Path, feeds: dict[str, np.ndarray], exclude: list[str]
) -> list[dict]:
    """The quantized nodes, most harmful first: for each, the error (`channel_error`, against fp32
    on `feeds`) of its output as the next nodes see it, less the largest of its nearest quantized
    ancestors'. Errors compound down the graph; the difference is what this node's own quantization
    added."""
    prepared, quantized = onnx.load(str(prepared_path)), onnx.load(str(quantized_path))
    nodes = candidates(prepared, exclude)
    pairs = _measured(nodes, prepared, quantized)
    ref = _intermediates(prepared, [r for r, _ in pairs.values()], feeds)
    got = _intermediates(quantized, [q for _, q in pairs.values()], feeds)
    error = {
        node: channel_error(got[q], ref[r])
        for node, (r, q) in pairs.items()
        if r in ref and q in got and ref[r].shape == got[q].shape
    }
    ancestors = _nearest(prepared, {n.name for n in nodes})
    ranked = []
    for n in nodes:
        if n.name in error:
            before = max((error.get(a, 0.0) for a in ancestors[n.name]), default=0.0)
            ranked.append(
                {
                    "node": n.name,
                    "op": n.op_type,
                    "output_error": round(error[n.name], 5),
                    "added_error": round(error[n.name] - before, 5),
                }
            )
    return sorted(ranked, key=lambda r: -r["added_error"])


def channel_error(got: np.ndarray, ref: np.ndarray) -> float:
    """The mean over channels (axis 1) of each channel's relative L2 error. Per channel, not over
    the whole tensor: one channel of large values (an outlier) sets the tensor's one quantization
    scale and dominates its norm, while every other channel is rounded away: a whole-tensor error
    would call that small."""
    ref = ref.astype(np.float64)
    got = got.astype(np.float64)
    if ref.ndim < 2:
        return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-12))
    axes = (0, *range(2, ref.ndim))
    # a dead channel (all 0) is not infinitely wrong
    floor = 1e-6 * max(np.linalg.norm(ref), 1e-12)
    per = np.sqrt(((got - ref) ** 2).sum(axis=axes)) / np.maximum(
        np.sqrt((ref**2).sum(axis=axes)), floor
    )
    return float(per.mean())


def with_producers(prepared: onnx.ModelProto, nodes: list[str], quantized: set[str]) -> list[str]:
    """`nodes` and the nearest quantized nodes that produce their inputs (through ops that are not
    quantized here: a Relu, a Reshape). In QDQ a producer quantizes its output for every consumer: a
    node's input stays float only when its producer is kept in float too."""
    producer = {o: n for n in prepared.graph.node for o in n.output}
    by_name = {n.name: n for n in prepared.graph.node}
    out = list(nodes)
    for name in nodes:
        stack, seen = list(by_name[name].input), set()
        while stack:
            tensor = stack.pop()
            if tensor in seen or tensor not in producer:
                continue
            seen.add(tensor)
            p = producer[tensor]
            if p.name in quantized:
                if p.name not in out:
                    out.append(p.name)
            elif p.op_type not in QUANTIZED_OPS:
                stack.extend(p.input)
    return out


def _measured(
    nodes, prepared: onnx.ModelProto, quantized: onnx.ModelProto
) -> dict[str, tuple[str, str]]:
    """node -> (its output in the fp32 graph, the same value in the int8 graph). Quantization keeps
    node names but may rename outputs: a Relu after a Conv is folded into its quantized range (the
    Conv then produces the Relu's output, compared with the fp32 Relu's), and an output feeding a
    QuantizeLinear gets a suffix."""
    in_fp32 = {o for n in prepared.graph.node for o in n.output}
    by_name = {n.name: n for n in quantized.graph.node}
    consumers: dict[str, list] = {}
    for n in quantized.graph.node:
        for t in n.input:
            consumers.setdefault(t, []).append(n)
    pairs = {}
    for n in nodes:
        q = by_name.get(n.name)
        if q is None or not q.output:
            continue
        out = seen = q.output[0]
        # The value the next nodes see: after its QuantizeLinear -> DequantizeLinear (which also
        # applies a folded Relu: the quantized range starts at 0), when quantization put one there.
        qz = [c for c in consumers.get(out, []) if c.op_type == "QuantizeLinear"]
        dq = (
            [c for c in consumers.get(qz[0].output[0], []) if c.op_type == "DequantizeLinear"]
            if qz
            else []
        )
        if dq:
            seen = dq[0].output[0]
        pairs[n.name] = (out if out in in_fp32 else n.output[0], seen)
    return pairs


def _nearest(model: onnx.ModelProto, marked: set[str]) -> dict[str, set[str]]:
    """For each node named in `marked`, the marked nodes met first walking up the graph from its
    inputs."""
    producer = {o: n for n in model.graph.node for o in n.output}
    found: dict[str, set[str]] = {}
    for node in model.graph.node:
        if node.name not in marked:
            continue
        seen, stack, hits = set(), list(node.input), set()
        while stack:
            t = stack.pop()
            if t in seen or t not in producer:
                continue
            seen.add(t)
            if producer[t].name in marked:
                hits.add(producer[t].name)
            else:
                stack.extend(producer[t].input)
        found[node.name] = hits
    return found


def _intermediates(
    model: onnx.ModelProto, names: list[str], feeds: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """The values of the tensors `names` (those the graph computes) on `feeds`: each made a graph
    output."""
    produced = {o for n in model.graph.node for o in n.output}
    wanted = [t for t in names if t in produced]
    known = {v.name: v for v in model.graph.value_info}
    present = {o.name for o in model.graph.output}
    for t in wanted:
        if t not in present:
            model.graph.output.append(known.get(t) or onnx.ValueInfoProto(name=t))
    sess = session(model)
    return dict(zip(wanted, sess.run(wanted, feeds)))


def images_per_second(engine, feeds: dict[str, np.ndarray], seconds: float) -> float:
    """Samples per second of `engine` on `feeds` (one batch), run back to back for about
    `seconds`."""
    rows = len(next(iter(feeds.values())))
    engine.run(feeds)
    runs, start = 0, time.perf_counter()
    while runs < 3 or time.perf_counter() - start < seconds:
        engine.run(feeds)
        runs += 1
    return runs * rows / (time.perf_counter() - start)


def make_variant(fp32_path: Path, out: Path, ref, batches, cfg, metadata: dict[str, str]) -> dict:
    """Quantizes the gated fp32 file and gates the result as export gates every variant
    (rebuild.run_gates, the int8 limits); when a gate fails, keeps the nodes `sensitivity` ranks
    worst in float and tries again, up to `cfg.int8_exclusion_rounds` more times (1, 2, 4... more
    nodes each round). Returns the variant's report: passed, mode, path (`model.int8.onnx`, or
    `model.int8.rejected.onnx` when it failed: no one serves that by accident), the last round's
    gates, each round's excluded nodes and failures, and the ranking that chose them."""
    from pipeline.artifact.gates import check_model
    from pipeline.artifact.rebuild import run_gates

    prepared = prepare(fp32_path, out / "model.int8.prepared.onnx")
    mode = choose_mode(onnx.load(str(prepared)), cfg.int8)
    feeds = calibration_feeds(ref.splits.train, cfg.int8_calibration_samples)
    path, excluded, rounds, ranking = out / FILE, [], [], []
    try:
        for attempt in range(cfg.int8_exclusion_rounds + 1):
            quantize(prepared, path, mode, feeds if mode == "static" else [], excluded, metadata)
            results = {"int8.checker": check_model(path)}
            results.update(
                {
                    f"int8.{k}": v
                    for k, v in run_gates(session(path), ref, batches, cfg, variant="int8").items()
                }
            )
            failed = [k for k, v in results.items() if not v["passed"]]
            rounds.append({"excluded": list(excluded), "failed_gates": failed})
            if not failed or attempt == cfg.int8_exclusion_rounds:
                break
            ranking = sensitivity(
                prepared, path, feeds[0] if feeds else _first_feeds(ref), excluded
            )
            worst = [r["node"] for r in ranking[: 2**attempt]]
            graph = onnx.load(str(prepared))
            quantized = {n.name for n in candidates(graph, excluded)}
            more = [n for n in with_producers(graph, worst, quantized) if n not in excluded]
            if not more:
                break
            log.info(
                "int8: %s failed; keeping %s in float (most error added: %s)",
                ", ".join(failed),
                ", ".join(more),
                ", ".join(f"{r['added_error']:.3g}" for r in ranking[: len(more)]),
            )
            excluded += more
    finally:
        prepared.unlink(missing_ok=True)
    passed = not failed
    if not passed:
        path = path.replace(out / REJECTED)
        log.warning(
            "int8 variant rejected after %d round(s): %s; kept as %s, not logged or served",
            len(rounds),
            "; ".join(f"{k}: {results[k]['message']}" for k in failed),
            path,
        )
    return {
        "passed": passed,
        "mode": mode,
        "path": str(path),
        "excluded": excluded,
        "rounds": rounds,
        "sensitivity": ranking[:16],
        "gates": results,
        "failed_gates": failed,
    }


def _first_feeds(ref) -> dict[str, np.ndarray]:
    """dynamic mode calibrates nothing: the sensitivity ranking runs on one training batch."""
    return calibration_feeds(ref.splits.train, CALIBRATION_BATCH)[0]


def measure(
    paths: dict[str, Path],
    feeds_by_batch: dict[int, dict[str, np.ndarray]],
    device: str = "cpu",
    rounds: int = 3,
    seconds: float = 0.3,
) -> dict:
    """{variant: {"batch<N>_per_s": samples/s}} for each file on one device, in this process,
    through the server's own Engine (its session options: threads, no spinning) since the server is
    what `--variant auto` picks for. Variants are measured in turns, `rounds` times, and the medians
    kept: other work on the machine then hits each alike."""
    from serving.engine import Engine, GpuOptions

    engines = {
        v: Engine(str(p), device=device, gpu=GpuOptions() if device == "cuda" else None)
        for v, p in paths.items()
    }
    runs: dict[str, dict[int, list[float]]] = {v: {b: [] for b in feeds_by_batch} for v in paths}
    for _ in range(rounds):
        for variant, engine in engines.items():
            for batch, feeds in feeds_by_batch.items():
                runs[variant][batch].append(images_per_second(engine, feeds, seconds))
    return {
        v: {f"batch{b}_per_s": round(float(np.median(r)), 1) for b, r in per.items()}
        for v, per in runs.items()
    }


def fastest(measured: dict[str, dict[str, float]], batch: int = 32) -> str:
    """The variant with the most samples/s at `batch`."""
    return max(measured, key=lambda v: measured[v][f"batch{batch}_per_s"])
