"""The int8 variant against the fp32 model of the same export: accuracy, file size, speed in-process
and served.

Input: an export's directory (`outputs/<run>/onnx/`, from e.g.
`pipeline run --config configs/digits_resnet18.yaml --nproc-per-node 2 export.int8=true`), holding
model.onnx, model.int8.onnx and export_report.json. Prints one table:

  - accuracy on the validation split through onnxruntime, and PyTorch's (from the export's gates);
  - file size;
  - in-process samples/s at batch 1 and 32: the server's Engine (same session options) called
    directly;
  - served requests/s at concurrency 1 and 32: `python -m serving --model <file>` (one image a
    request, V2 binary over HTTP, the server batching as it does), driven by benchmarks/serve.py's
    load generator (a Python asyncio closed loop on the same cores: compare rows of one run only).

The two models are measured in turns, round after round (medians), so that other work on the machine
hits both alike.

    .venv/bin/python benchmarks/int8.py outputs/<run>/onnx [--seconds 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
# benchmarks/serve.py: its server wrapper and load generator
import serve as loadgen  # noqa: E402

VARIANTS = {"fp32": "model.onnx", "int8": "model.int8.onnx"}


def input_shape(path: Path) -> tuple[int, ...]:
    import onnx

    dims = onnx.load(str(path), load_external_data=False).graph.input[0].type.tensor_type.shape.dim
    return tuple(d.dim_value for d in dims[1:])


def inprocess(path: Path, shape: tuple[int, ...], batch: int, seconds: float) -> float:
    """Samples/s of the server's Engine on one batch, run back to back for `seconds`."""
    # the measure export records, on the same Engine
    from pipeline.artifact.int8 import (
        images_per_second,
    )
    from serving.engine import Engine

    engine = Engine(str(path), device="cpu")
    feeds = {"input": np.random.default_rng(0).random((batch, *shape), dtype=np.float32)}
    # warm-up beyond the one images_per_second runs itself
    for _ in range(2):
        engine.run(feeds)
    return images_per_second(engine, feeds, seconds)


def served(
    path: Path, shape: tuple[int, ...], concurrencies: tuple[int, ...], seconds: float, log: Path
) -> dict:
    port = loadgen.free_port()
    cmd = [
        sys.executable,
        "-m",
        "serving",
        "--model",
        str(path),
        "--model-name",
        "m",
        "--port",
        str(port),
    ]
    x = np.random.default_rng(0).random((1, *shape), dtype=np.float32)
    request = loadgen.v2_request(loadgen.BINARY_HTTP, "m", x, port)
    out = {}
    with loadgen.Server(cmd, port, "/v2/health/ready", log):
        # warm-up
        asyncio.run(loadgen.measure(loadgen.BINARY_HTTP, request, port, None, 4, seconds=1.0))
        for c in concurrencies:
            r = asyncio.run(
                loadgen.measure(loadgen.BINARY_HTTP, request, port, None, c, seconds=seconds)
            )
            if r["errors"]:
                raise SystemExit(
                    f"{path.name} at c={c}: {r['errors']} errors, first: {r['first_error']}"
                )
            out[c] = r["rps"]
    return out


def accuracy(report: dict) -> dict[str, tuple[float, float]]:
    """variant -> (its accuracy %, PyTorch's %), as the export gated them."""
    primary = report["task"].get("primary", "accuracy")
    fp32 = report["gates"][primary]
    int8 = report["int8"]["gates"][f"int8.{primary}"]
    key = f"onnx_{primary}_pct"
    return {
        "fp32": (fp32[key], fp32[f"torch_{primary}_pct"]),
        "int8": (int8[key], int8[f"torch_{primary}_pct"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "onnx_dir", type=Path, help="an export's output directory (model.onnx, model.int8.onnx)"
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of turns; medians are reported"
    )
    args = parser.parse_args()
    report = json.loads((args.onnx_dir / "export_report.json").read_text())
    if not (report.get("int8") or {}).get("passed"):
        raise SystemExit(f"{args.onnx_dir}: no gated int8 variant in the export report")
    paths = {v: args.onnx_dir / f for v, f in VARIANTS.items()}
    shape = input_shape(paths["fp32"])
    samples: dict[str, dict[str, list[float]]] = {v: {} for v in paths}
    for r in range(args.rounds):
        for variant, path in paths.items():
            got = samples[variant]
            for batch in (1, 32):
                got.setdefault(f"b{batch}", []).append(
                    inprocess(path, shape, batch, args.seconds / 2)
                )
            for c, rps in served(
                path, shape, (1, 32), args.seconds, args.onnx_dir / f"bench-{variant}.log"
            ).items():
                got.setdefault(f"c{c}", []).append(rps)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    med = {v: {k: float(np.median(x)) for k, x in m.items()} for v, m in samples.items()}
    acc = accuracy(report)
    print(
        f"\n{args.onnx_dir}: int8 {report['int8']['mode']}, nodes kept in float: "
        f"{report['int8']['excluded'] or 'none'}; medians of {args.rounds} rounds\n"
    )
    print(
        "| variant | accuracy (PyTorch) | file | in-process b1 /s | in-process b32 /s | served c=1 req/s | "
        "served c=32 req/s |"
    )
    print("|---|---|---|---|---|---|---|")
    for v in paths:
        m = med[v]
        print(
            f"| {v} | {acc[v][0]:.2f}% ({acc[v][1]:.2f}%) | {paths[v].stat().st_size / 1e6:.1f} MB | {m['b1']:.0f} | "
            f"{m['b32']:.0f} | {m['c1']:.0f} | {m['c32']:.0f} |"
        )
    ratio = {k: med["int8"][k] / med["fp32"][k] for k in ("b1", "b32", "c1", "c32")}
    print(
        f"| int8 / fp32 | {acc['int8'][0] - acc['fp32'][0]:+.2f} pp | "
        f"{paths['int8'].stat().st_size / paths['fp32'].stat().st_size:.2f}x | {ratio['b1']:.2f}x | "
        f"{ratio['b32']:.2f}x | {ratio['c1']:.2f}x | {ratio['c32']:.2f}x |"
    )


if __name__ == "__main__":
    main()
