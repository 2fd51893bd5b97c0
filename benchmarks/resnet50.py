"""ResNet-50 224x224 on one GPU: the server on every protocol against onnxruntime itself
(scripts/gpu-check's table).

torchvision's ResNet-50 (random weights, 1x3x224x224 FP32, 602 KB an image) exported to ONNX with a
dynamic batch, and its fp16 variant (pipeline.artifact.gates.to_fp16, the export's own converter;
its answers are compared with fp32's and the largest gap printed). One table, one run:

    anchors   onnxruntime in-process on the CUDA provider with the server's options (HEURISTIC, no
              TF32), numpy in and out, batch 1 (img/s and the p50 of a run: the latency a server
              adds to) and batch 32; PyTorch eager fp32 (no TF32) and bf16 autocast at batch 32, the
              input copied from pinned host memory
    ours      `python -m serving --device cuda` with its defaults, then --variant fp16, then
              --cuda-graphs: V2 binary over HTTP at c=1/32/64, gRPC (ModelInfer, raw_input_contents)
              at c=1/64, the V2 system shared-memory extension through tritonclient.grpc at c=32 (a
              region pair per client); then --variant uint8 (the image as UINT8 pixel values,
              150 KB: pipeline.artifact.uint8_inputs) over HTTP and gRPC at c=64; clients are closed
              loops in up to 8 processes, one image a request; rows and ms per model run from the
              server's /metrics

and the verdicts of issue 31's targets: HTTP and gRPC at c=64 >= 0.9x in-process batch 32 with >= 24
rows a run; fp16 >= 1.8x the fp32 server; CUDA graphs >= 1.2x without at c=1; c=1 p50 <= in-process
batch-1 p50 + 0.5 ms.

    python benchmarks/resnet50.py                        # ~3-4 min on one H100
    python benchmarks/resnet50.py --quick                # 2 s a row
    python benchmarks/resnet50.py --device cpu --size 32 --quick   # the harness itself, on a CPU (no verdicts)
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
# benchmarks/ingest.py: the server process and the tritonclient shared-memory load
import ingest  # noqa: E402

# benchmarks/serve.py: the V2 requests and the closed-loop clients
import serve as bench  # noqa: E402

MODEL = "resnet50"
LOAD_PROCESSES = 8


# ---- the model -----------------------------------------------------------------------------------


def network():
    """(torchvision's ResNet-50 with random weights, its name); where torchvision does not import
    (this project's CPU build machine: its torch is a CPU build PyPI's torchvision is not made for),
    the project's ResNet-18 stands in, for a run of the harness only."""
    try:
        import torchvision
    except (ImportError, RuntimeError):
        from pipeline.models import resnet18

        return resnet18(
            num_classes=1000, in_channels=3
        ).eval(), "ResNet-18 (pipeline.models; no torchvision here)"
    return torchvision.models.resnet50(weights=None).eval(), "ResNet-50"


def export(directory: Path, size: int) -> str:
    """model.onnx (fp32) and model.fp16.onnx in `directory`, the layout of an exported model; the
    network's name."""
    import onnx
    import torch

    from pipeline.artifact import uint8_inputs
    from pipeline.artifact.gates import to_fp16

    directory.mkdir(parents=True, exist_ok=True)
    model, name = network()
    path = directory / "model.onnx"
    kwargs = dict(
        input_names=["input"],
        output_names=["logits"],
        opset_version=17,
        dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
    )
    try:
        torch.onnx.export(model, (torch.rand(2, 3, size, size),), str(path), dynamo=False, **kwargs)
    except TypeError:
        # a torch without the dynamo switch
        torch.onnx.export(model, (torch.rand(2, 3, size, size),), str(path), **kwargs)
    proto = onnx.load(str(path))
    # what the installed onnxruntime reads
    proto.ir_version = min(proto.ir_version, 10)
    # A ResNet in eval mode is row-wise, said as export records it: the server batches only such a
    # model.
    onnx.helper.set_model_props(proto, {"trainserve.rows_independent": "by construction"})
    onnx.save(proto, str(path))
    onnx.save(to_fp16(proto), str(directory / "model.fp16.onnx"))
    onnx.save(uint8_inputs.make(proto, ["input"]), str(directory / uint8_inputs.FILE))
    print(
        f"{name} {size}x{size} exported ({path.stat().st_size / 1e6:.0f} MB fp32, fp16 beside it)",
        flush=True,
    )
    return name


def session(path: Path, device: str):
    """An onnxruntime session with the server's provider options (serving/engine.py: HEURISTIC, no
    TF32)."""
    import onnxruntime as ort

    providers = (
        [("CUDAExecutionProvider", {"cudnn_conv_algo_search": "HEURISTIC", "use_tf32": "0"})]
        if device == "cuda"
        else []
    ) + ["CPUExecutionProvider"]
    return ort.InferenceSession(str(path), providers=providers)


def image(size: int, batch: int = 1, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).random((batch, 3, size, size), dtype=np.float32)


# ---- anchors -------------------------------------------------------------------------------------


def ort_anchor(sess, batch: int, size: int, seconds: float) -> dict:
    x = image(size, batch)
    for _ in range(5):
        sess.run(None, {"input": x})
    times = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        sess.run(None, {"input": x})
        times.append(time.perf_counter() - t)
    return {
        "img_s": batch * len(times) / (time.perf_counter() - start),
        "p50": 1e3 * float(np.median(times)),
    }


def torch_anchor(size: int, seconds: float, bf16: bool, device: str) -> dict:
    import torch

    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model = network()[0].to(device)
    x = torch.rand(32, 3, size, size)
    x = x.pin_memory() if device == "cuda" else x
    autocast = torch.autocast(device, torch.bfloat16, enabled=bf16)
    with torch.inference_mode(), autocast:
        for _ in range(3):
            model(x.to(device, non_blocking=True)).float().cpu()
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            model(x.to(device, non_blocking=True)).float().cpu()
            n += 1
    return {"img_s": 32 * n / (time.perf_counter() - start)}


# ---- the server under load -----------------------------------------------------------------------


def _clients(
    protocol: str,
    port: int,
    grpc_port: int,
    request: bytes,
    n: int,
    start: float,
    seconds: float,
    results,
):
    """One load process: n closed-loop clients from wall-clock `start` for `seconds`; their
    latencies (ms)."""

    async def run():
        async with bench.open_clients(protocol, request, port, grpc_port, n) as clients:
            # connected and warm
            await bench.closed_loop(clients, count=2 * n)
            await asyncio.sleep(max(0.0, start - time.time()))
            return await bench.closed_loop(clients, seconds, keep_times=True)

    results.put(asyncio.run(run()))


def closed_loops(
    protocol: str, server: ingest.Server, request: bytes, c: int, seconds: float
) -> dict:
    # not forked: this process may hold a CUDA context
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    shares = [
        s
        for s in (c // LOAD_PROCESSES + (i < c % LOAD_PROCESSES) for i in range(LOAD_PROCESSES))
        if s
    ]
    start = time.time() + 3.0 + 0.2 * len(shares)
    procs = [
        ctx.Process(
            target=_clients,
            args=(protocol, server.port, server.grpc_port, request, n, start, seconds, results),
        )
        for n in shares
    ]
    for p in procs:
        p.start()
    got = [results.get(timeout=seconds + 180) for _ in procs]
    for p in procs:
        p.join(30)
    ms = (
        np.concatenate([g["times_ms"] for g in got])
        if any(len(g["times_ms"]) for g in got)
        else np.array([np.nan])
    )
    return {
        "rps": sum(g["n"] for g in got) / seconds,
        "p50": float(np.percentile(ms, 50)),
        "p99": float(np.percentile(ms, 99)),
        "errors": sum(g["errors"] for g in got),
        "first_error": next((g["first_error"] for g in got if g["first_error"]), None),
        "started": start,
    }


def engine_sums(server: ingest.Server) -> dict:
    import requests

    text = requests.get(f"http://127.0.0.1:{server.port}/metrics", timeout=10).text
    return {
        key: bench.series_total(text, series)
        for key, series in (
            ("runs", "trainserve_batch_size_count"),
            ("rows", "trainserve_batch_size_sum"),
            ("seconds", "trainserve_inference_duration_seconds_sum"),
        )
    }


def measure(
    server: ingest.Server, protocol: str, c: int, size: int, seconds: float, uint8: bool = False
) -> dict:
    before = engine_sums(server)
    # pixel values: 150 KB at 224
    x = np.rint(image(size) * 255).astype(np.uint8) if uint8 else image(size)
    if protocol == "shm":
        result = ingest.shm_load(
            "shm-grpc", server, c, seconds, server.work, None, model=MODEL, x=x, out_bytes=4000
        )
        result.update(p50=float("nan"), p99=float("nan"))
    else:
        which = bench.BINARY_HTTP if protocol == "http" else bench.GRPC
        result = closed_loops(
            which, server, bench.v2_request(which, MODEL, x, server.port), c, seconds
        )
    after = engine_sums(server)
    runs = max(after["runs"] - before["runs"], 1.0)
    return {
        **result,
        "rows_per_run": (after["rows"] - before["rows"]) / runs,
        "ms_per_run": 1e3 * (after["seconds"] - before["seconds"]) / runs,
    }


LOADS = (("http", 1), ("http", 32), ("http", 64), ("grpc", 1), ("grpc", 64), ("shm", 32))
SERVERS = (
    ("fp32", [], LOADS),
    ("fp16", ["--variant", "fp16"], LOADS),
    ("fp32, CUDA graphs", ["--cuda-graphs"], LOADS),
    ("fp32, UINT8 input", ["--variant", "uint8"], (("http", 64), ("grpc", 64))),
)


def serve_rows(
    directory: Path, device: str, size: int, seconds: float, work: Path
) -> tuple[list, dict]:
    rows, by = [], {}
    try:
        import tritonclient.grpc  # noqa: F401

        loads = LOADS
    except ImportError:
        loads = tuple(load for load in LOADS if load[0] != "shm")
        rows.append(
            (
                "shared memory",
                "-",
                "-",
                "skipped: tritonclient is not installed (pip install tritonclient[grpc])",
            )
        )
    for label, extra, wanted in SERVERS:
        if device != "cuda" and ("fp16" in extra or "--cuda-graphs" in extra):
            # the GPU's: the server refuses them on a CPU
            continue
        server = ingest.Server(
            directory, work, None, ["--device", device, *extra], model_name=MODEL
        )
        try:
            server.__enter__()
        except RuntimeError as exc:
            rows.append((label, "-", "-", f"did not start: {str(exc).splitlines()[-1][:200]}"))
            continue
        try:
            for protocol, c in [load for load in wanted if load in loads]:
                r = measure(server, protocol, c, size, seconds, uint8="uint8" in extra)
                by[(label, protocol, c)] = r
                rows.append((label, protocol, c, r))
                print(
                    f"  {label:<18} {protocol:<5} c={c:<3} {r['rps']:7.0f} img/s  p50 {r['p50']:6.2f} ms  "
                    f"{r['rows_per_run']:5.1f} rows/run  {r['ms_per_run']:6.2f} ms/run  errors {r['errors']}",
                    flush=True,
                )
        finally:
            server.__exit__()
    return rows, by


# ---- the verdicts --------------------------------------------------------------------------------


def verdicts(anchor: dict, by: dict) -> list[tuple[str, str, bool | None]]:
    """(target, what was measured, met) for issue 31's GPU targets; None where a row is missing."""

    def get(label, protocol, c, key="rps"):
        r = by.get((label, protocol, c))
        return r[key] if r else float("nan")

    b32, b1_p50 = anchor["ort_b32"]["img_s"], anchor["ort_b1"]["p50"]
    out = []
    for protocol in ("http", "grpc"):
        rps, rows = get("fp32", protocol, 64), get("fp32", protocol, 64, "rows_per_run")
        out.append(
            (
                f"{protocol} c=64 >= 0.9x in-process batch 32, >= 24 rows a run",
                f"{rps:.0f} img/s = {rps / b32:.2f}x of {b32:.0f}; {rows:.1f} rows a run",
                None if np.isnan(rps) else bool(rps >= 0.9 * b32 and rows >= 24),
            )
        )
    fp16, fp32 = get("fp16", "http", 64), get("fp32", "http", 64)
    out.append(
        (
            "fp16 server >= 1.8x fp32 server (http c=64)",
            f"{fp16:.0f} vs {fp32:.0f} img/s = {fp16 / fp32:.2f}x",
            None if np.isnan(fp16) else bool(fp16 >= 1.8 * fp32),
        )
    )
    graphs, plain = get("fp32, CUDA graphs", "http", 1), get("fp32", "http", 1)
    out.append(
        (
            "CUDA graphs >= 1.2x without (http c=1)",
            f"{graphs:.0f} vs {plain:.0f} req/s = {graphs / plain:.2f}x",
            None if np.isnan(graphs) else bool(graphs >= 1.2 * plain),
        )
    )
    p50 = get("fp32", "http", 1, "p50")
    out.append(
        (
            "c=1 p50 <= in-process batch-1 p50 + 0.5 ms",
            f"{p50:.2f} ms vs {b1_p50:.2f} + 0.5 ms",
            None if np.isnan(p50) else bool(p50 <= b1_p50 + 0.5),
        )
    )
    return out


# ---- main ----------------------------------------------------------------------------------------


def run(device: str, size: int, seconds: float, work: Path) -> dict:
    """The whole table; returns {"anchor", "rows", "verdicts", "lines"} (lines: the markdown
    printed)."""
    directory = work / MODEL
    name = export(directory, size)
    import onnxruntime as ort

    fp32 = session(directory / "model.onnx", device)
    print(f"onnxruntime {ort.__version__} on {fp32.get_providers()[0]}", flush=True)
    anchor = {
        "ort_b1": ort_anchor(fp32, 1, size, seconds),
        "ort_b32": ort_anchor(fp32, 32, size, seconds),
    }
    x = image(size, 8)
    if device == "cuda":
        gap = np.abs(
            session(directory / "model.fp16.onnx", device).run(None, {"input": x})[0]
            - fp32.run(None, {"input": x})[0]
        ).max()
        print(f"fp16 variant: largest |fp16 - fp32| over 8 images = {gap:.3g}", flush=True)
    del fp32
    for bf16 in (False, True):
        try:
            anchor["torch_bf16" if bf16 else "torch_fp32"] = torch_anchor(
                size, seconds, bf16, device
            )
        except Exception as exc:  # noqa: BLE001
            # an anchor that can't run here is said, not fatal
            print(
                f"PyTorch eager {'bf16' if bf16 else 'fp32'}: not measured ({exc!r:.200})",
                flush=True,
            )
    for key, value in anchor.items():
        print(
            f"  {key:<18} {value['img_s']:7.0f} img/s"
            + (f"  p50 {value['p50']:.2f} ms" if "p50" in value else ""),
            flush=True,
        )
    rows, by = serve_rows(directory, device, size, seconds, work)
    checks = verdicts(anchor, by) if device == "cuda" else []
    lines = table(name, anchor, rows, checks, device, size, seconds)
    print("\n".join(lines))
    return {"anchor": anchor, "rows": rows, "verdicts": checks, "lines": lines}


def table(
    network_name: str,
    anchor: dict,
    rows: list,
    checks: list,
    device: str,
    size: int,
    seconds: float,
) -> list[str]:
    names = {
        "ort_b1": ("onnxruntime in-process, the server's options", "batch 1"),
        "ort_b32": ("onnxruntime in-process, the server's options", "batch 32"),
        "torch_fp32": ("PyTorch eager fp32 (no TF32), input from pinned host memory", "batch 32"),
        "torch_bf16": ("PyTorch eager bf16 autocast", "batch 32"),
    }
    protocol_names = {
        "http": "V2 binary over HTTP",
        "grpc": "gRPC ModelInfer",
        "shm": "system shm, tritonclient.grpc",
    }
    b32 = anchor["ort_b32"]["img_s"]
    lines = [
        f"\n{network_name} {size}x{size} FP32 input, {device}; {seconds:g} s a row, one run: compare rows of this "
        "table only\n",
        "| system | load | img/s | x in-process batch 32 | p50 / p99 ms | rows per run | "
        "ms per run | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, (name, load) in names.items():
        if key in anchor:
            a = anchor[key]
            p50 = f"{a['p50']:.2f} (a run)" if "p50" in a else ""
            lines.append(
                f"| {name} | {load} | {a['img_s']:.0f} | {a['img_s'] / b32:.2f} | {p50} | | | |"
            )
    for label, protocol, c, r in rows:
        if isinstance(r, str):
            lines.append(f"| `python -m serving` {label} | {protocol} | {r} | | | | | |")
            continue
        first = f" ({r['first_error'][:80]})" if r.get("first_error") else ""
        latency = "-" if np.isnan(r["p50"]) else f"{r['p50']:.2f} / {r['p99']:.2f}"
        lines.append(
            f"| `python -m serving` {label}, {protocol_names[protocol]} | c={c} | {r['rps']:.0f} | "
            f"{r['rps'] / b32:.2f} | {latency} | {r['rows_per_run']:.1f} | "
            f"{r['ms_per_run']:.2f} | {r['errors']}{first} |"
        )
    if checks:
        lines += ["", "| target (issue 31) | measured | met |", "|---|---|---|"]
        lines += [
            f"| {t} | {m} | {'-' if ok is None else 'yes' if ok else '**no**'} |"
            for t, m, ok in checks
        ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--size", type=int, default=224, help="image side (default 224)")
    parser.add_argument("--seconds", type=float, default=5.0, help="a row's measuring time")
    parser.add_argument("--quick", action="store_true", help="2 s a row")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="resnet50-"))
    result = run(args.device, args.size, 2.0 if args.quick else args.seconds, work)
    return 1 if any(ok is False for _, _, ok in result["verdicts"]) else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
