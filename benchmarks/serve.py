"""Serving benchmark: our server against in-process onnxruntime and `mlflow models serve`.

Same models (the 28x28 small-image ResNet-18 and a tiny MLP, random weights), same load generator
(wrk, Debian package `wrk`), the same JSON request of one image ({"inputs": [1x1x28x28]}) to every
server's /invocations, at concurrency 1 and 32. Reports requests/s and p50/p99 latency of:
  (a) onnxruntime in-process, at batch 1 and at the server's max batch size (a call is one batch);
  (b) our server (python -m serving);
  (c) `mlflow models serve --env-manager local` of the same model saved with the PyTorch flavor and
      with the ONNX flavor.

    python benchmarks/serve.py            # ~7 min on 2 cores: 3 rounds, medians
    python benchmarks/serve.py --quick    # ~1.5 min: one round of short runs, the ResNet only

All servers run at once and are measured in turns, round after round, so that other work on the
machine hits every system alike; wrk takes CPU too. Compare rows within one run, never with numbers
from another machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import requests

ROOT = Path(__file__).resolve().parents[1]
MODELS = {  # name -> (the built-in model component, its args): 28x28 one-channel images, 10 classes
    "resnet18": ("pipeline.models:resnet18", {"num_classes": 10, "in_channels": 1, "width": 1.0,
                                              "mean": [0.286], "std": [0.353]}),
    "mlp": ("pipeline.models:mlp", {"num_classes": 10, "in_channels": 1, "image_size": 28, "hidden": [64],
                                    "mean": [0.286], "std": [0.353]}),
}
MAX_BATCH = 32


# ---- models -----------------------------------------------------------------------------------

def build_and_export(name: str, out_dir: Path):
    """The torch module (eval) and its ONNX file, exported the way `pipeline export` does."""
    import onnx
    import torch

    from pipeline.components.build import ModelSpec, instantiate_model

    torch.manual_seed(0)
    model = instantiate_model(ModelSpec(*MODELS[name])).eval()
    sample = torch.rand(2, 1, 28, 28)
    path = out_dir / f"{name}.onnx"
    metadata = {"trainserve.model_name": name}
    try:
        from pipeline.components.onnx_export import ExportHead, export
        from pipeline.components.tasks import Classification

        head = ExportHead(model, Classification(None, 5, num_classes=10), ["input"], True)
        proto = export(head, {"input": sample}, ("logits", "probabilities"), {}, 18, metadata).model
    except ImportError:  # the exporter module is not there: the same graph by hand
        proto = _export_locally(model, sample, metadata)
    onnx.save(proto, str(path))
    return model, path


def _export_locally(model, sample, metadata):
    import onnx
    import torch

    class WithProbabilities(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            logits = self.m(x)
            return logits, torch.softmax(logits, dim=1)

    program = torch.onnx.export(WithProbabilities(model), (sample,), dynamo=True, input_names=["input"],
                                output_names=["logits", "probabilities"],
                                dynamic_shapes={"x": {0: torch.export.Dim("batch")}})
    proto = program.model_proto
    onnx.helper.set_model_props(proto, metadata)
    return proto


# ---- (a) in-process ---------------------------------------------------------------------------

def bench_inprocess(path: Path, batch: int, seconds: float) -> dict:
    """Our Engine called directly: the same onnxruntime session and options the server uses."""
    from serving.engine import Engine

    engine = Engine(str(path), device="cpu")
    feeds = {"input": np.random.default_rng(0).random((batch, 1, 28, 28), dtype=np.float32)}
    for _ in range(5):
        engine.run(feeds)
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 10:
        t = time.perf_counter()
        engine.run(feeds)
        times.append(time.perf_counter() - t)
    times = np.asarray(times)
    return {"rps": batch * len(times) / times.sum(), "p50": np.percentile(times, 50) * 1e3,
            "p99": np.percentile(times, 99) * 1e3, "errors": 0}


# ---- servers and load -------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess in its own process group; stopped (group-wide, by PID) on exit."""

    def __init__(self, cmd: list[str], port: int, ready_path: str, log: Path, env: dict | None = None):
        self.cmd, self.port, self.ready_path, self.log = cmd, port, ready_path, log
        # mlflow serve execs `uvicorn` from PATH: the venv's bin must be on it
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        self.env = {**os.environ, "PATH": path, **(env or {})}

    def __enter__(self):
        self.out = open(self.log, "wb")
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=self.env, stdout=self.out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.cmd[:3]} exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if requests.get(f"http://127.0.0.1:{self.port}{self.ready_path}", timeout=1).ok:
                    return self
            except requests.ConnectionError:
                pass
            time.sleep(0.25)
        self.__exit__()
        raise RuntimeError(f"{self.cmd[:3]} not ready:\n{self.log.read_text()[-3000:]}")

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # mlflow serve starts uvicorn workers: the group
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.out.close()


def wrk(url: str, body_path: Path, concurrency: int, seconds: float) -> dict:
    script = body_path.with_suffix(".lua")
    script.write_text(f'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                      f'wrk.body = io.open("{body_path}", "rb"):read("*a")\n')
    threads = min(concurrency, 2)
    out = subprocess.run(["wrk", f"-t{threads}", f"-c{concurrency}", f"-d{max(1, round(seconds))}s", "--timeout", "10s",
                          "--latency", "-s", str(script), url], capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    errors = int(m.group(1)) if (m := re.search(r"Non-2xx or 3xx responses: (\d+)", out)) else 0
    if m := re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out):
        errors += sum(int(g) for g in m.groups())
    return {"rps": rps, "p50": _latency(out, "50%"), "p99": _latency(out, "99%"), "errors": errors}


def _latency(out: str, pct: str) -> float:
    value, unit = re.search(rf"^\s+{re.escape(pct)}\s+([\d.]+)(us|ms|s)\s*$", out, re.M).groups()
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]


def batch_stats(port: int) -> tuple[float, float]:
    """(rows, model runs) so far, from the server's batch-size histogram."""
    text = requests.get(f"http://127.0.0.1:{port}/metrics").text
    total = float(re.search(r"^trainserve_batch_size_sum ([\d.e+]+)", text, re.M).group(1))
    count = float(re.search(r"^trainserve_batch_size_count ([\d.e+]+)", text, re.M).group(1))
    return total, count


def check_prediction(port: int, body: bytes, want: np.ndarray) -> None:
    """The server answers what the torch model does; the first requests also warm it up (a pt2
    model compiles on its first call)."""
    for _ in range(5):
        r = requests.post(f"http://127.0.0.1:{port}/invocations", data=body,
                          headers={"Content-Type": "application/json"}, timeout=120)
        r.raise_for_status()
    got = r.json()["predictions"]
    got = got["logits"] if isinstance(got, dict) else got
    np.testing.assert_allclose(np.asarray(got, np.float32).reshape(want.shape), want, rtol=1e-3, atol=1e-4)


# ---- main -------------------------------------------------------------------------------------

def run_model(name: str, work: Path, seconds: float, rounds: int, mlflow_servers: bool) -> list:
    """All servers up at once, then `rounds` rounds that measure every system in turn; the median
    of each is reported. On a machine shared with other work, noise then hits every system alike."""
    import mlflow
    import onnx
    import torch

    model, onnx_path = build_and_export(name, work)
    x = np.random.default_rng(1).random((1, 1, 28, 28), dtype=np.float32)
    body = work / f"{name}.json"
    body.write_bytes(json.dumps({"inputs": x.tolist()}).encode())
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()

    servers = {}  # system -> (Server, port)
    port = free_port()
    servers["(b) trainserve (python -m serving)"] = (Server(
        [sys.executable, "-m", "serving", "--model", str(onnx_path), "--port", str(port),
         "--max-batch-size", str(MAX_BATCH), "--log-level", "warning"],
        port, "/v2/health/ready", work / f"ours-{name}.log"), port)
    if mlflow_servers:
        flavors = {"(c) mlflow models serve, pytorch flavor":
                   lambda p: mlflow.pytorch.save_model(model, p, input_example=x, pip_requirements=["torch"]),
                   "(c) mlflow models serve, onnx flavor":
                   lambda p: mlflow.onnx.save_model(onnx.load(str(onnx_path)), p, input_example=x,
                                                   pip_requirements=["onnxruntime"])}
        for system, save in flavors.items():
            path = work / f"mlflow-{name}-{system.split(',')[1].split()[0]}"
            save(str(path))
            port = free_port()
            servers[system] = (Server(
                [sys.executable, "-m", "mlflow", "models", "serve", "-m", str(path), "--env-manager", "local",
                 "-h", "127.0.0.1", "-p", str(port)], port, "/ping", work / f"{path.name}.log"), port)

    samples: dict[tuple[str, object], list[dict]] = {}
    notes: dict[tuple[str, object], list[float]] = {}
    with contextlib.ExitStack() as stack:
        for system, (server, port) in servers.items():
            stack.enter_context(server)
            check_prediction(port, body.read_bytes(), want)
        for round_ in range(rounds):
            for batch in (1, MAX_BATCH):
                key = (f"(a) onnxruntime in-process, batch {batch}", "-")
                samples.setdefault(key, []).append(bench_inprocess(onnx_path, batch, seconds))
            for system, (_, port) in servers.items():
                ours = system.startswith("(b)")
                for c in (1, 32):
                    before = batch_stats(port) if ours else None
                    r = wrk(f"http://127.0.0.1:{port}/invocations", body, c, seconds)
                    samples.setdefault((system, c), []).append(r)
                    if ours:
                        after = batch_stats(port)
                        notes.setdefault((system, c), []).append((after[0] - before[0]) / max(after[1] - before[1], 1))
                    print(f"  round {round_ + 1}/{rounds} {name:8s} {system:40s} c={c:<3d} {r['rps']:8.1f} req/s  "
                          f"p50 {r['p50']:7.2f} ms  p99 {r['p99']:7.2f} ms", file=sys.stderr, flush=True)
    rows = []
    for (system, c), runs in samples.items():
        median = {k: float(np.median([r[k] for r in runs])) for k in ("rps", "p50", "p99")}
        median["errors"] = sum(r["errors"] for r in runs)
        note = "images/s; latency per run" if c == "-" else ""
        if (system, c) in notes:
            note = f"mean batch {np.mean(notes[(system, c)]):.1f}"
        rows.append((name, system, c, median, note))
    return rows


def print_table(rows: list) -> None:
    print("\n| model | system | concurrency | req/s | p50 ms | p99 ms | errors | note |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for model, system, c, r, note in rows:
        print(f"| {model} | {system} | {c} | {r['rps']:.1f} | {r['p50']:.2f} | {r['p99']:.2f} | {r['errors']} | {note} |")


def print_targets(rows: list) -> None:
    def find(model, prefix, c="-"):
        for m, system, conc, r, _ in rows:
            if m == model and system.startswith(prefix) and conc == c:
                return r
        return None

    print("\nTargets (issue 6):")
    for model in dict.fromkeys(r[0] for r in rows):
        ours32, ours1 = find(model, "(b)", 32), find(model, "(b)", 1)
        base32, base1 = find(model, f"(a) onnxruntime in-process, batch {MAX_BATCH}"), find(model, "(a) onnxruntime in-process, batch 1")
        pt32, ox32 = find(model, "(c) mlflow models serve, pytorch", 32), find(model, "(c) mlflow models serve, onnx", 32)
        checks = []
        if ours32 and base32:
            checks.append((f"c32 throughput / in-process batch {MAX_BATCH}", ours32["rps"] / base32["rps"], ">= 0.8"))
        if ours32 and pt32:
            checks.append(("c32 throughput / mlflow pytorch flavor", ours32["rps"] / pt32["rps"], ">= 3"))
        if ours32 and ox32:
            checks.append(("c32 throughput / mlflow onnx flavor", ours32["rps"] / ox32["rps"], ">= 1.5"))
        if ours1 and base1:
            checks.append(("c1 p50 - in-process batch-1 p50 (ms)", ours1["p50"] - base1["p50"], "<= 1.5"))
        for what, value, target in checks:
            print(f"  {model:8s} {what:45s} {value:7.2f}  (target {target})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round of 3 s runs, the ResNet only")
    parser.add_argument("--seconds", type=float, default=None, help="seconds per measurement (default 5, quick 3)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds over all systems; medians reported "
                                                                  "(default 3, quick 1)")
    parser.add_argument("--models", default=None, help="comma-separated: resnet18,mlp (default both; quick: resnet18)")
    parser.add_argument("--no-mlflow", action="store_true", help="skip (c), the mlflow servers")
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        print("wrk not found: apt-get install -y wrk", file=sys.stderr)
        return 2
    seconds = args.seconds or (3.0 if args.quick else 5.0)
    rounds = args.rounds or (1 if args.quick else 3)
    models = (args.models or ("resnet18" if args.quick else "resnet18,mlp")).split(",")
    work = Path(tempfile.mkdtemp(prefix="trainserve-bench-"))
    rows = []
    try:
        for name in models:
            rows += run_model(name, work, seconds, rounds, not args.no_mlflow)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table(rows)
    print_targets(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
