"""A model over 2 GB through every stage, each stage's peak memory and time in one table.

The model is configs/recommender_big_embedding.yaml (examples/recommender/): a ROWS x 128 fp32
item-embedding table (5M rows = 2.56 GB, in 16 row blocks) feeding a small MLP. In a fresh working
directory with its own MLflow store, each stage runs as a user runs it, as its own process:

    train        pipeline train --nproc-per-node 2 (torchrun, gloo, CPU, FSDP2, plain SGD): per rank
    consolidate  pipeline consolidate RUN_DIR (the DCP shards -> model.safetensors)
    export       pipeline export WEIGHTS_DIR (ONNX with external data, gates, MLflow model, registry
                 version)
    serve        python -m serving --model models:/NAME@champion (download, hash checks,
                 onnxruntime), under SERVE_REQUESTS requests of random item bags
    verify       pipeline verify models:/NAME@champion --server URL (every link of the chain, the
                 server's too)

Peak memory is each process's own: `ru_maxrss` of the stage's process from wait4 (this driver
imports nothing heavy, so what a child inherits across exec from it is a few MB); for the training
ranks, which torchrun starts, their VmHWM (the kernel's high-water mark of the process's resident
set) read from /proc every 0.2 s while they run (the mark only grows, so the last reading is the
peak up to then). Ratios are to the model's size (its safetensors file's tensors) and its largest
tensor, both read from the file's header; the `baseline` row is a process with torch, onnxruntime
and mlflow imported and nothing done: what every stage pays before it holds a byte of the model.

Targets (issue 20): consolidation <= 1.5x the largest tensor; export (gates and registration in the
same process), serving <= 1.3x the model; training reported per rank. Needs about 5x the model's
size in free memory (two ranks) and 9x on disk; refuses to start with less memory unless --force.

    .venv/bin/python benchmarks/big_model.py                 # 5M rows: 2.56 GB
    .venv/bin/python benchmarks/big_model.py --rows 600000   # the same path at 0.3 GB
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "recommender_big_embedding.yaml"
NAME = "recommender-big-embedding"
SERVE_REQUESTS = 200
BAG = 8


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows", type=int, default=5_000_000, help="item ids in the table (x 512 bytes each)"
    )
    parser.add_argument("--steps", type=int, default=4, help="training steps")
    parser.add_argument(
        "--workdir", help="working directory (default: a temporary one, deleted at the end)"
    )
    parser.add_argument(
        "--force", action="store_true", help="start even when free memory looks too small"
    )
    args = parser.parse_args()
    model_bytes = args.rows * 128 * 4
    available = _meminfo("MemAvailable")
    if available < 5 * model_bytes and not args.force:
        print(
            f"big_model: {available / 1e9:.1f} GB of memory available, a {model_bytes / 1e9:.2f} GB model needs "
            f"about {5 * model_bytes / 1e9:.0f} GB here (two training ranks); --force to start anyway",
            file=sys.stderr,
        )
        return 2
    work = Path(args.workdir or tempfile.mkdtemp(prefix="trainserve-big-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "TRAINSERVE_TRUSTED_COMPONENTS": "examples.recommender.*",
    }
    # the embedded store of the working directory
    env.pop("MLFLOW_TRACKING_URI", None)
    rows = []
    try:
        rows.append(
            (
                "baseline",
                *measure([sys.executable, "-c", "import torch, onnxruntime, mlflow"], work, env),
            )
        )
        common = [
            "--config",
            str(CONFIG),
            f"data.args.rows={args.rows}",
            f"train.max_steps={args.steps}",
            f"train.eval_every={args.steps}",
            f"checkpoint.every_n_steps={args.steps}",
            "checkpoint.log_to_mlflow=none",
            "train.run_name=big",
            # the same path at every size: at 0.3 GB the weights would otherwise stay inside
            # model.onnx
            "export.external_data=always",
        ]
        seconds, ranks = measure_ranks(
            [sys.executable, "-m", "pipeline", "train", "--nproc-per-node", "2", *common], work, env
        )
        rows += [(f"train rank {rank}", seconds, peak) for rank, peak in sorted(ranks.items())]
        rows.append(
            (
                "consolidate",
                *measure(
                    [sys.executable, "-m", "pipeline", "consolidate", "outputs/big"], work, env
                ),
            )
        )
        weights = work / "outputs" / "big" / "consolidated" / "model.safetensors"
        size, largest = tensor_sizes(weights)
        rows.append(
            (
                "export+gates+register",
                *measure(
                    [sys.executable, "-m", "pipeline", "export", str(weights.parent)], work, env
                ),
            )
        )
        serve_seconds, serve_peak, verify = serve_and_verify(work, env, args.rows)
        rows.append(("serve", serve_seconds, serve_peak))
        rows.append(("verify", *verify))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print_table(rows, size, largest, args.rows)
    return 0


def measure(cmd: list[str], cwd: Path, env: dict) -> tuple[float, int]:
    """(seconds, peak RSS in bytes) of one process run to its end; raises with its output if it
    failed."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, rusage = _wait(proc)
    seconds = time.perf_counter() - start
    _check(cmd, proc, out)
    return seconds, rusage.ru_maxrss * 1024


def measure_ranks(cmd: list[str], cwd: Path, env: dict) -> tuple[float, dict[int, int]]:
    """(seconds, {rank: peak RSS}) of a command that starts torchrun ranks: every process below it
    that has RANK in its environment, its VmHWM read until it exits."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    os.set_blocking(proc.stdout.fileno(), False)
    out, peaks = b"", {}
    while proc.poll() is None:
        out += proc.stdout.read() or b""
        for pid in _descendants(proc.pid):
            rank, hwm = _rank(pid), _status(pid, "VmHWM")
            if rank is not None and hwm:
                peaks[rank] = max(peaks.get(rank, 0), hwm)
        time.sleep(0.2)
    out += proc.stdout.read() or b""
    seconds = time.perf_counter() - start
    _check(cmd, proc, out)
    return seconds, peaks


def serve_and_verify(cwd: Path, env: dict, rows: int) -> tuple[float, int, tuple[float, int]]:
    """The server from the registry: start until ready (its time), SERVE_REQUESTS inferences, then
    `pipeline verify` against it; the server stopped by SIGTERM and its peak RSS read from wait4."""
    port = _free_port()
    start = time.perf_counter()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "serving",
            "--model",
            f"models:/{NAME}@champion",
            "--port",
            str(port),
        ],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        while not _ready(base):
            if server.poll() is not None:
                _check(["serving"], server, server.stdout.read())
            time.sleep(0.5)
        ready = time.perf_counter() - start
        rng = random.Random(0)
        for _ in range(SERVE_REQUESTS):
            items = [rng.randrange(rows) for _ in range(BAG)]
            body = json.dumps(
                {
                    "inputs": [
                        {"name": "input", "datatype": "INT64", "shape": [1, BAG], "data": items}
                    ]
                }
            )
            request = urllib.request.Request(
                f"{base}/v2/models/{NAME}/infer",
                body.encode(),
                {"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=60) as answer:
                json.loads(answer.read())
        verify = measure(
            [
                sys.executable,
                "-m",
                "pipeline",
                "verify",
                f"models:/{NAME}@champion",
                "--server",
                base,
            ],
            cwd,
            env,
        )
    finally:
        server.send_signal(signal.SIGTERM)
    out, rusage = _wait(server)
    return ready, rusage.ru_maxrss * 1024, verify


def tensor_sizes(path: Path) -> tuple[int, int]:
    """(bytes of all tensors, bytes of the largest) from a safetensors file's header, no tensor
    read."""
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    sizes = [
        end - begin
        for key, entry in header.items()
        if key != "__metadata__"
        for begin, end in [entry["data_offsets"]]
    ]
    return sum(sizes), max(sizes)


def print_table(
    rows: list[tuple[str, float, int]], size: int, largest: int, table_rows: int
) -> None:
    """One line per stage: its peak and the ratios the targets are stated in, on the whole peak and
    on what it holds over the baseline process (the imports alone), which at small sizes is most of
    a peak."""
    targets = {
        "consolidate": ("<= 1.5x largest", largest, 1.5),
        "export+gates+register": ("<= 1.3x model", size, 1.3),
        "serve": ("<= 1.3x model", size, 1.3),
    }
    base = dict((stage, peak) for stage, _, peak in rows).get("baseline", 0)
    print(
        f"\nmodel: {table_rows:,} x 128 fp32 table + head = {size / 1e9:.2f} GB; largest tensor "
        f"{largest / 1e9:.2f} GB; peak RSS of each stage's process\n"
    )
    print(
        "| stage | time s | peak RSS GB | x model | x largest | over baseline: x model | x largest | target |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for stage, seconds, peak in rows:
        target, of, limit = targets.get(stage, ("", 0, 0))
        verdict = f"{target}: {'met' if peak <= limit * of else 'missed'}" if target else ""
        if target and stage != "baseline":
            verdict += f" ({'met' if peak - base <= limit * of else 'missed'} over baseline)"
        over = max(peak - base, 0)
        print(
            f"| {stage} | {seconds:.1f} | {peak / 1e9:.2f} | {peak / size:.2f} | {peak / largest:.2f} | "
            f"{over / size:.2f} | {over / largest:.2f} | {verdict} |"
        )
    print(
        "\ntrain: the time is the whole `pipeline train` (both ranks); serve: start until ready (download, "
        "hash checks, session), the peak over the start and the requests; baseline: python with torch, "
        "onnxruntime and mlflow imported"
    )


# ---------------------------------------------------------------------------------------------


def _wait(proc: subprocess.Popen):
    """Reads the output to the end, then reaps the process with wait4 for its own rusage."""
    out = proc.stdout.read()
    _, status, rusage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return out, rusage


def _check(cmd: list[str], proc: subprocess.Popen, out: bytes) -> None:
    if proc.returncode not in (0, None):
        tail = out.decode(errors="replace")[-6000:]
        raise SystemExit(f"big_model: {' '.join(cmd[:4])} ... exited {proc.returncode}\n{tail}")


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def _rank(pid: int) -> int | None:
    try:
        entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for entry in entries:
        if entry.startswith(b"RANK="):
            return int(entry[5:])
    return None


def _status(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/v2/health/ready", timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
