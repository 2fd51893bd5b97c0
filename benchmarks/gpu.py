"""The GPU proofs, end to end, in one command (`scripts/gpu-check`): every GPU-only path of
trainserve run for real, asserted, and a serving throughput table. Prints one row per proof and
exits 1 on any FAIL. On a machine without a GPU it says so and exits 0 (`--dry-run-on-cpu` runs the
same harness on the CPU instead, with the GPU-only rows skipped, to prove the harness itself).

Proofs (each a real CLI call in a scratch directory, as a user types it):
  train.bf16            1 rank, NCCL, bf16 autocast, grad clipping and accumulation
  train.fp16            1 rank, fp16 + GradScaler (the run must log train/loss_scale), clipping,
                        accumulation
  train.fsdp_nhwc       FSDP2 with channels_last on the small-image ResNet (BatchNorm under bf16)
  train.cpu_to_gpu      a checkpoint written on the CPU, resumed on the GPU
  export.cuda_gates     export's gates on the CUDA provider, the provider recorded in the report
  serve.cuda            the server on the CUDA provider (asserted from /metrics, not assumed),
                        warmed up
  serve.parity          the CUDA server's answers vs onnxruntime's CPU provider on the same inputs
  throughput            req/s, p50/p99, rows and milliseconds per model run at concurrency 1 and 32:
                        CPU provider vs CUDA provider (batch buckets, the default) vs CUDA with one
                        session for every batch size (--batch-buckets off) vs CUDA with TF32 vs the
                        fp16 variant vs CUDA graphs
  resnet50              a real-sized model (benchmarks/resnet50.py): ResNet-50 224x224 through the
                        server on binary HTTP, gRPC and system shared memory at c=1/32/64, fp32,
                        fp16 and CUDA graphs, against onnxruntime in-process (batch 1, 32) and
                        PyTorch eager; ok when issue 31's targets are met (each said in a table),
                        FAIL naming those that are not; needs torchvision

What a proof needs and does not find (MLflow for the training runs, onnxruntime-gpu with a CUDA
provider that loads for the export and serving rows) is a `skip` row that says what is missing,
never a silent pass. A machine without MLflow takes the wheelhouse `scripts/gpu-wheelhouse` builds.

    scripts/gpu-check                    # the proofs; ~3-5 min on one GPU
    scripts/gpu-check --quick            # shorter throughput runs
    scripts/gpu-check --dry-run-on-cpu   # the harness on the CPU (GPU-only rows skipped)
    scripts/gpu-check --only resnet50    # one proof (or a comma-separated few: train, serve, resnet50)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "configs" / "tiny.yaml"
# Synthetic 8x8 images: a GPU machine may lack scikit-learn (the digits' source); the shapes are
# what matters.
DATA = ["data.name=synthetic", "data.args.size=8", "data.args.samples=512"]


@dataclass
class Row:
    name: str
    # ok | FAIL | skip
    status: str
    seconds: float
    detail: str


class Proofs:
    def __init__(self, workdir: Path, device: str):
        self.workdir, self.device, self.rows = workdir, device, []
        self.env = dict(
            os.environ,
            PYTHONUNBUFFERED="1",
            MLFLOW_TRACKING_URI=f"sqlite:///{workdir / 'mlflow.db'}",
            MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR="false",
        )

    def add(self, name: str, status: str, started: float, detail: str) -> Row:
        row = Row(name, status, time.perf_counter() - started, detail)
        self.rows.append(row)
        print(f"{status:<5} {name:<18} {row.seconds:6.1f}s  {detail}", flush=True)
        return row

    def amend(self, status: str, detail: str) -> None:
        """The last row's verdict after a look past the command's output (printed again, as
        amended)."""
        row = self.rows[-1]
        row.status, row.detail = status, detail
        print(f"{status:<5} {row.name:<18} {'':>7}  {detail} (amended)", flush=True)

    def cli(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pipeline", *args],
            cwd=self.workdir,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def check(
        self,
        name: str,
        proc: subprocess.CompletedProcess,
        started: float,
        *,
        expect: list[str],
        detail: str,
    ) -> bool:
        """ok when the command exited 0 and its output holds every `expect` string."""
        out = proc.stdout + proc.stderr
        missing = [e for e in expect if e not in out]
        if proc.returncode != 0 or missing:
            tail = " | ".join(line.strip() for line in out.strip().splitlines()[-3:])
            self.add(
                name,
                "FAIL",
                started,
                f"exit {proc.returncode}"
                + (f", missing {missing}" if missing else "")
                + f": {tail[:300]}",
            )
            return False
        self.add(name, "ok", started, detail)
        return True


# ---- training --------------------------------------------------------------------------------


def train_proofs(p: Proofs) -> None:
    try:
        import mlflow  # noqa: F401
    except ImportError:
        for name in ("train.bf16", "train.fp16", "train.fsdp_nhwc", "train.cpu_to_gpu"):
            p.add(
                name,
                "skip",
                time.perf_counter(),
                "MLflow is not installed here: pip install the wheelhouse "
                "scripts/gpu-wheelhouse builds, then run again",
            )
        return
    dev, gpu = p.device, p.device == "cuda"
    common = [
        "--config",
        str(TINY),
        *DATA,
        "--nproc-per-node",
        "1",
        f"train.device={dev}",
        "train.max_steps=8",
        "train.clip_grad_norm=1.0",
        "train.grad_accum_steps=2",
        "train.global_batch_size=32",
    ]

    started = time.perf_counter()
    proc = p.cli("train", *common, "train.precision=bf16", "train.run_name=bf16")
    p.check(
        "train.bf16",
        proc,
        started,
        expect=[f"device {dev}", "precision bf16"],
        detail=f"{'NCCL' if gpu else 'gloo'}, bf16 autocast, clip 1.0, 2 micro-batches a step",
    )

    started = time.perf_counter()
    if gpu:
        proc = p.cli("train", *common, "train.precision=fp16", "train.run_name=fp16")
        if p.check(
            "train.fp16", proc, started, expect=["precision fp16"], detail="fp16 + GradScaler"
        ):
            scale = _metric(p, "fp16", "train/loss_scale")
            if scale is None:
                p.amend("FAIL", "the run logged no train/loss_scale: no GradScaler")
            else:
                p.amend("ok", f"fp16 + GradScaler, loss scale {scale:g} at the end")
    else:
        p.add("train.fp16", "skip", started, "fp16 + GradScaler needs CUDA")

    started = time.perf_counter()
    proc = p.cli(
        "train",
        *common,
        "train.strategy=fsdp",
        "train.channels_last=true",
        "train.precision=bf16",
        "train.run_name=fsdp",
    )
    p.check(
        "train.fsdp_nhwc",
        proc,
        started,
        expect=["strategy fsdp"],
        detail="FSDP2, channels_last"
        + (" (inputs NHWC)" if gpu else " (CPU: channels_last is CUDA-only)")
        + ", BatchNorm kept fp32 under bf16",
    )

    started = time.perf_counter()
    first = p.cli(
        "train",
        "--config",
        str(TINY),
        *DATA,
        "train.device=cpu",
        "train.max_steps=4",
        "checkpoint.every_n_steps=4",
        "train.run_name=moved",
    )
    if first.returncode != 0:
        p.check("train.cpu_to_gpu", first, started, expect=[], detail="")
        return
    proc = p.cli(
        "train",
        "--config",
        str(TINY),
        *DATA,
        f"train.device={dev}",
        "train.max_steps=8",
        "train.run_name=moved",
        "--resume",
        "latest",
    )
    p.check(
        "train.cpu_to_gpu",
        proc,
        started,
        expect=["resumed from", "at step 4", f"device {dev}"],
        detail=f"a CPU-written checkpoint resumed on {dev} (RNG keys as stored)",
    )


def _metric(p: Proofs, run_name: str, key: str) -> float | None:
    import mlflow

    client = mlflow.MlflowClient(p.env["MLFLOW_TRACKING_URI"])
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        filter_string=f"attributes.run_name = '{run_name}'",
    )
    return runs[0].data.metrics.get(key) if runs else None


# ---- export and serving ----------------------------------------------------------------------


def cuda_provider_loads() -> str:
    """'' when onnxruntime's CUDA provider really runs a session here, else why not."""
    try:
        import onnxruntime as ort
        from onnx import TensorProto, helper
    except ImportError as exc:
        return f"onnxruntime is not installed ({exc})"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return f"this onnxruntime has no CUDA provider (providers: {ort.get_available_providers()}): pip install onnxruntime-gpu"
    from serving.engine import preload_cuda_libraries

    preload_cuda_libraries()
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    try:
        # An explicit IR version: a newer onnx writes one the installed onnxruntime may not read
        # yet.
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
        sess = ort.InferenceSession(
            model.SerializeToString(), providers=["CUDAExecutionProvider", "CPUExecutionProvider"]
        )
    except Exception as exc:  # noqa: BLE001
        return f"the CUDA provider fails to create a session: {exc}"
    if sess.get_providers()[0] != "CUDAExecutionProvider":
        return (
            "the CUDA provider is listed but does not load (CUDA 13 / cuDNN 9 libraries not found)"
        )
    return ""


def export_and_serve(p: Proofs, quick: bool) -> None:
    started = time.perf_counter()
    weights = p.workdir / "outputs" / "bf16" / "consolidated"
    why_not = cuda_provider_loads() if p.device == "cuda" else "dry run on the CPU"
    trained = (p.workdir / "outputs" / "bf16" / "checkpoints").is_dir()
    if not trained:
        for name in ("export.cuda_gates", "serve.cuda", "serve.parity", "throughput"):
            p.add(name, "skip", started, "no trained model (train.bf16 did not run)")
        return
    proc = p.cli("consolidate", str(p.workdir / "outputs" / "bf16"))
    export = p.cli("export", str(weights), "export.fp16=true") if proc.returncode == 0 else proc
    report_path = weights.parent / "onnx" / "export_report.json"
    if export.returncode != 0 or not report_path.is_file():
        p.check("export.cuda_gates", export, started, expect=[], detail="")
        return
    report = json.loads(report_path.read_text())
    providers = sorted(
        {g["provider"] for g in report["gates"].values() if isinstance(g, dict) and "provider" in g}
    )
    if why_not:
        p.add("export.cuda_gates", "skip", started, f"{why_not}; gated on {providers} only")
    elif "CUDAExecutionProvider" in providers and report["passed"]:
        p.add(
            "export.cuda_gates",
            "ok",
            started,
            f"every gate passed; providers recorded: {providers}",
        )
    else:
        p.add(
            "export.cuda_gates",
            "FAIL",
            started,
            f"passed={report['passed']}, providers recorded: {providers}, "
            f"failed: {report.get('failed_gates')}",
        )
    onnx_path = weights.parent / "onnx" / "model.onnx"
    table = []
    cpu = serve_and_measure(p, onnx_path, "cpu", [], quick, table)
    if why_not:
        for name in ("serve.cuda", "serve.parity"):
            p.add(name, "skip", time.perf_counter(), why_not)
    else:
        started = time.perf_counter()
        cuda = serve_and_measure(p, onnx_path, "cuda", [], quick, table)
        if cuda and cuda["provider"] == "CUDAExecutionProvider":
            p.add(
                "serve.cuda",
                "ok",
                started,
                f"/metrics names {cuda['provider']}; warmed up in {cuda['ready_s']:.1f} s",
            )
            gap = float(abs(cuda["answer"] - cpu["answer"]).max()) if cpu else float("nan")
            limit = 1e-4 + 1e-3 * float(abs(cpu["answer"]).max()) if cpu else 0.0
            p.add(
                "serve.parity",
                "ok" if gap <= limit else "FAIL",
                started,
                f"max |CUDA - CPU| = {gap:.3g} (limit {limit:.3g}) on the same 8 rows",
            )
        else:
            p.add(
                "serve.cuda",
                "FAIL",
                started,
                f"the server runs on {cuda and cuda['provider']}, not the CUDA provider",
            )
            p.add("serve.parity", "skip", started, "no CUDA server")
        # Rows for what the server offers on a GPU: one session for every batch size (what batch
        # buckets replace), TF32 allowed (ungated), the gated fp16 variant, each bucket a captured
        # CUDA graph.
        for variant_args in (
            ["--batch-buckets", "off"],
            ["--allow-tf32"],
            ["--variant", "fp16"],
            ["--cuda-graphs"],
        ):
            serve_and_measure(p, onnx_path, "cuda", variant_args, quick, table)
    started = time.perf_counter()
    p.add("throughput", "ok" if table else "FAIL", started, f"{len(table)} rows below")
    print_table(table)


def serve_and_measure(
    p: Proofs, onnx_path: Path, device: str, extra: list[str], quick: bool, table: list
) -> dict | None:
    """Starts the server, reads its provider, asks 8 rows for parity, then measures concurrency 1
    and 32."""
    import numpy as np
    import requests

    from pipeline.tracking import free_port

    port = free_port()
    label = " ".join([device, *extra])
    log = open(
        p.workdir / f"server-{device}-{'-'.join(a.strip('-') for a in extra) or 'plain'}.log", "w"
    )
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "serving",
            "--model",
            str(onnx_path),
            "--port",
            str(port),
            "--device",
            device,
            *extra,
        ],
        cwd=p.workdir,
        env=p.env,
        stdout=log,
        stderr=log,
    )
    base = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    try:
        while time.perf_counter() - started < 180:
            if server.poll() is not None:
                table.append((label, "did not start (see its log)", "", "", "", "", ""))
                return None
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{base}/v2/health/ready", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        ready_s = time.perf_counter() - started
        info = next(
            line
            for line in requests.get(f"{base}/metrics", timeout=5).text.splitlines()
            if line.startswith("trainserve_model_info{")
        )
        provider, name = (info.split(f'{k}="')[1].split('"')[0] for k in ("provider", "name"))
        models = requests.get(f"{base}/v2/models/{name}", timeout=5).json()
        spec = models["inputs"][0]
        shape = [8 if d < 0 else d for d in spec["shape"]]
        x = np.random.default_rng(0).random(shape, dtype=np.float32)
        body = {
            "inputs": [
                {
                    "name": spec["name"],
                    "shape": shape,
                    "datatype": "FP32",
                    "data": x.ravel().tolist(),
                }
            ]
        }
        answer = np.asarray(
            requests.post(f"{base}/v2/models/{name}/infer", json=body, timeout=30).json()[
                "outputs"
            ][0]["data"],
            dtype=np.float32,
        )
        one = {
            "inputs": [
                {
                    "name": spec["name"],
                    "shape": [1, *shape[1:]],
                    "datatype": "FP32",
                    "data": x[:1].ravel().tolist(),
                }
            ]
        }
        for concurrency in (1, 32):
            before = engine_sums(requests.get(f"{base}/metrics", timeout=5).text)
            rps, p50, p99 = load(
                f"{base}/v2/models/{name}/infer", one, concurrency, 2.0 if quick else 8.0
            )
            after = engine_sums(requests.get(f"{base}/metrics", timeout=5).text)
            runs = max(1.0, after["runs"] - before["runs"])
            table.append(
                (
                    label,
                    provider,
                    concurrency,
                    f"{rps:.0f}",
                    f"{p50:.2f} / {p99:.2f}",
                    f"{(after['rows'] - before['rows']) / runs:.1f}",
                    f"{1e3 * (after['seconds'] - before['seconds']) / runs:.2f}",
                )
            )
        return {"provider": provider, "answer": answer, "ready_s": ready_s}
    finally:
        server.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(30)
        if server.poll() is None:
            server.kill()
        log.close()


def engine_sums(metrics: str) -> dict[str, float]:
    """Model runs, rows and seconds in them so far, from the server's /metrics: what the engine
    did."""
    # benchmarks/serve.py's reader of a /metrics series
    from serve import series_total

    return {
        key: series_total(metrics, series)
        for key, series in (
            ("runs", "trainserve_batch_size_count"),
            ("rows", "trainserve_batch_size_sum"),
            ("seconds", "trainserve_inference_duration_seconds_sum"),
        )
    }


def load(url: str, body: dict, concurrency: int, seconds: float) -> tuple[float, float, float]:
    """Closed-loop load: `concurrency` clients, each one request at a time, for `seconds`. The
    clients are threads of up to one process per 8 (at most half the CPUs): one Python process of
    HTTP clients tops out below what the server does on a GPU
    (docs/benchmarks.md#benchmarksgpupy)."""
    import multiprocessing

    import numpy as np

    processes = max(1, min(concurrency // 8, (os.cpu_count() or 2) // 2))
    shares = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    payload = json.dumps(body)
    if processes == 1:
        timed = _clients(url, payload, shares[0], seconds)
    else:
        # spawned, not forked: this process has CUDA initialised
        with multiprocessing.get_context("spawn").Pool(processes) as pool:
            timed = [
                x
                for part in pool.starmap(_clients, [(url, payload, n, seconds) for n in shares])
                for x in part
            ]
    if not timed:
        return 0.0, float("nan"), float("nan")
    # Requests answered over the span from the first one's start to the last one's end.
    starts, ends = np.asarray([t[0] for t in timed]), np.asarray([t[1] for t in timed])
    ms = (ends - starts) * 1e3
    return (
        len(timed) / float(ends.max() - starts.min()),
        float(np.percentile(ms, 50)),
        float(np.percentile(ms, 99)),
    )


def _clients(url: str, payload: str, threads: int, seconds: float) -> list[tuple[float, float]]:
    """`threads` clients in this process for `seconds`; (start, end) of each answered request, in
    wall-clock seconds (comparable across processes, which start at slightly different times)."""
    import requests

    stop = time.time() + seconds
    latencies: list[tuple[float, float]] = []
    lock = threading.Lock()

    def client():
        mine = []
        with requests.Session() as s:
            while time.time() < stop:
                t = time.time()
                r = s.post(
                    url, data=payload, headers={"Content-Type": "application/json"}, timeout=30
                )
                if r.status_code == 200:
                    mine.append((t, time.time()))
        with lock:
            latencies.extend(mine)

    workers = [threading.Thread(target=client) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return latencies


def print_table(table: list) -> None:
    if not table:
        return
    print(
        "\n| server | provider | concurrency | req/s | p50 / p99 ms | rows per model run | ms per model run |\n"
        "| --- | --- | --- | --- | --- | --- | --- |"
    )
    for row in table:
        print("| " + " | ".join(str(c) for c in row) + " |")


def resnet50_proof(p: Proofs, quick: bool) -> None:
    """benchmarks/resnet50.py's table (on the CPU: a 32x32 input, the harness only, no verdicts)."""
    started = time.perf_counter()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import resnet50

    gpu = p.device == "cuda"
    try:
        result = resnet50.run(
            p.device, 224 if gpu else 32, 2.0 if quick or not gpu else 5.0, p.workdir
        )
    except Exception as exc:  # noqa: BLE001
        # a proof that broke is a FAIL row, the others still run
        p.add("resnet50", "FAIL", started, f"{type(exc).__name__}: {str(exc)[:300]}")
        return
    missed = [target for target, _, ok in result["verdicts"] if ok is False]
    unknown = [target for target, _, ok in result["verdicts"] if ok is None]
    if not gpu:
        p.add(
            "resnet50",
            "ok",
            started,
            "the harness ran on the CPU (32x32, no verdicts: the targets are a GPU's)",
        )
    elif missed:
        p.add("resnet50", "FAIL", started, f"targets not met: {'; '.join(missed)}")
    else:
        p.add(
            "resnet50",
            "ok" if not unknown else "FAIL",
            started,
            "every target met" if not unknown else f"not measured: {'; '.join(unknown)}",
        )


# ---- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu-check", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dry-run-on-cpu", action="store_true", help="run the harness on the CPU, GPU rows skipped"
    )
    parser.add_argument("--quick", action="store_true", help="2 s throughput runs instead of 8 s")
    parser.add_argument(
        "--workdir", help="keep the runs here (default: a temporary directory, removed)"
    )
    parser.add_argument(
        "--only",
        default="train,serve,resnet50",
        help="which proofs: of train (the four train.* rows), "
        "serve (export, serve.*, throughput: they need train.bf16's model), resnet50",
    )
    args = parser.parse_args(argv)
    only = {o.strip() for o in args.only.split(",") if o.strip()}
    if only - {"train", "serve", "resnet50"}:
        parser.error(
            f"--only: unknown {sorted(only - {'train', 'serve', 'resnet50'})}; of train, serve, resnet50"
        )

    import torch

    if torch.cuda.is_available():
        device = "cuda"
        print(
            f"GPU: {torch.cuda.get_device_name(0)}, capability {torch.cuda.get_device_capability(0)}, "
            f"torch {torch.__version__} (CUDA {torch.version.cuda})",
            flush=True,
        )
    elif args.dry_run_on_cpu:
        device = "cpu"
        print(
            "no GPU here: --dry-run-on-cpu runs the harness on the CPU; GPU-only rows are skipped",
            flush=True,
        )
    else:
        print(
            f"gpu-check: no GPU here (torch {torch.__version__}: torch.cuda.is_available() is False): every GPU "
            "proof skipped. Run it on a machine with an NVIDIA GPU, or --dry-run-on-cpu to test the harness."
        )
        return 0
    workdir = (
        Path(args.workdir)
        if args.workdir
        else Path(tempfile.mkdtemp(prefix="trainserve-gpu-check-"))
    )
    workdir.mkdir(parents=True, exist_ok=True)
    proofs = Proofs(workdir, device)
    try:
        # serve's model is train.bf16's
        if "train" in only or "serve" in only:
            train_proofs(proofs)
        if "serve" in only:
            export_and_serve(proofs, args.quick)
        if "resnet50" in only:
            resnet50_proof(proofs, args.quick)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    failed = [r.name for r in proofs.rows if r.status == "FAIL"]
    skipped = [r.name for r in proofs.rows if r.status == "skip"]
    print(
        f"\ngpu-check: {len(proofs.rows) - len(failed) - len(skipped)} ok, {len(failed)} failed"
        + (f" ({', '.join(failed)})" if failed else "")
        + f", {len(skipped)} skipped"
        + (f" ({', '.join(skipped)})" if skipped else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
