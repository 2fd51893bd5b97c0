"""What judging a challenger on live traffic costs the champion's clients: one run, two servers.

The digits demo's ResNet-18 is trained twice with `pipeline run` (1 process): a champion (3 epochs)
and a worse retrain (a few steps) that becomes @challenger. Two servers of the same registry run
side by side, one plain (`--model models:/resnet18-digits@champion`) and one with `--shadow 1.0`,
and are measured in turns, round after round (medians), with the same JSON V2 request of a real
validation digit:
  - concurrency 1: sequential requests from a Python client; the champion's p50 and p99 as the
    client sees them (the mirror runs after the answer, but shares the one engine thread with the
    champion);
  - saturation: wrk at concurrency 32; requests/s, p50, p99, and for the shadowing server how many
    mirrors ran (pairs) and how many were shed (the mirror is dropped whenever the champion has rows
    waiting or 64 mirrors are queued).

    python benchmarks/shadow.py                 # ~3 min on 2 cores: training ~1 min, 3 rounds
    python benchmarks/shadow.py --rounds 1 --seconds 3

Compare rows of one run only; the machine's other work hits both servers alike.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import requests

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
# the serving benchmark's server and wrk helpers
from serve import Server, free_port, wrk  # noqa: E402

NAME = "resnet18-digits"


def pipeline(args: list[str], cwd: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pipeline", *args],
        cwd=cwd,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def train_registry(work: Path) -> None:
    common = [
        "run",
        "--config",
        str(ROOT / "configs/digits_resnet18.yaml"),
        "--nproc-per-node",
        "1",
        "tracking.system_metrics=false",
    ]
    pipeline([*common, "train.epochs=3", "train.run_name=champion"], work)
    pipeline([*common, "train.max_steps=3", "train.run_name=worse"], work)


def request_body(work: Path) -> bytes:
    from pipeline.datasets.digits import digits

    image = np.asarray(digits()["val"][0][0], dtype=np.float32)
    body = {
        "inputs": [
            {
                "name": "input",
                "shape": [1, *image.shape],
                "datatype": "FP32",
                "data": image.reshape(-1).tolist(),
            }
        ]
    }
    import json

    path = work / "body.json"
    path.write_text(json.dumps(body))
    return path.read_bytes()


def sequential(url: str, body: bytes, count: int) -> dict:
    session = requests.Session()
    times = []
    for _ in range(count):
        started = time.perf_counter()
        answer = session.post(
            url, data=body, headers={"Content-Type": "application/json"}, timeout=30
        )
        times.append((time.perf_counter() - started) * 1e3)
        answer.raise_for_status()
    return {"p50": float(np.percentile(times, 50)), "p99": float(np.percentile(times, 99))}


def shadow_counts(port: int) -> tuple[int, int]:
    report = requests.get(f"http://127.0.0.1:{port}/v2/models/{NAME}/shadow", timeout=10).json()
    return report["pairs"], report["dropped"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds of each saturation run")
    parser.add_argument(
        "--requests", type=int, default=300, help="sequential requests per concurrency-1 run"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="trainserve-shadow-bench-") as tmp:
        work = Path(tmp)
        started = time.perf_counter()
        train_registry(work)
        print(
            f"trained the champion and a worse challenger in {time.perf_counter() - started:.0f} s",
            flush=True,
        )
        body = request_body(work)
        env = {"MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}"}
        plain_port, shadow_port = free_port(), free_port()
        base = [
            sys.executable,
            "-m",
            "serving",
            "--model",
            f"models:/{NAME}@champion",
            "--threads",
            "1",
        ]
        plain = Server(
            [*base, "--port", str(plain_port)],
            plain_port,
            "/v2/health/ready",
            work / "plain.log",
            env,
        )
        shadow = Server(
            [*base, "--port", str(shadow_port), "--shadow", "1.0"],
            shadow_port,
            "/v2/health/ready",
            work / "shadow.log",
            env,
        )
        results: dict[str, dict[str, list[float]]] = {"plain": {}, "shadow": {}}
        mirrored = {"c1": [0, 0], "c32": [0, 0]}
        with plain, shadow:
            for _ in range(args.rounds):
                for label, port in (("plain", plain_port), ("shadow", shadow_port)):
                    url = f"http://127.0.0.1:{port}/v2/models/{NAME}/infer"
                    before = shadow_counts(port) if label == "shadow" else (0, 0)
                    one = sequential(url, body, args.requests)
                    # let the last mirrors finish before the next measurement
                    time.sleep(1.0)
                    middle = shadow_counts(port) if label == "shadow" else (0, 0)
                    many = wrk(url, work / "body.json", 32, args.seconds)
                    time.sleep(1.0)
                    after = shadow_counts(port) if label == "shadow" else (0, 0)
                    for key, value in (
                        ("c1_p50", one["p50"]),
                        ("c1_p99", one["p99"]),
                        ("c32_rps", many["rps"]),
                        ("c32_p50", many["p50"]),
                        ("c32_p99", many["p99"]),
                        ("errors", many["errors"]),
                    ):
                        results[label].setdefault(key, []).append(value)
                    if label == "shadow":
                        mirrored["c1"][0] += middle[0] - before[0]
                        mirrored["c1"][1] += middle[1] - before[1]
                        mirrored["c32"][0] += after[0] - middle[0]
                        mirrored["c32"][1] += after[1] - middle[1]
        med = {
            label: {k: statistics.median(v) for k, v in r.items()} for label, r in results.items()
        }
        print(
            "\n| server | c=1 p50 ms | c=1 p99 ms | c=32 req/s | c=32 p50 ms | c=32 p99 ms | errors |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|")
        for label, text in (("plain", "champion alone"), ("shadow", "champion with --shadow 1.0")):
            m = med[label]
            print(
                f"| {text} | {m['c1_p50']:.2f} | {m['c1_p99']:.2f} | {m['c32_rps']:.1f} | {m['c32_p50']:.1f} | "
                f"{m['c32_p99']:.1f} | {m['errors']:.0f} |"
            )
        ratio = med["shadow"]["c32_rps"] / med["plain"]["c32_rps"]
        print(
            f"\nshadow/plain at c=32: {ratio:.2f}x requests/s; c=1 p50 {med['shadow']['c1_p50']:.2f} vs "
            f"{med['plain']['c1_p50']:.2f} ms"
        )
        print(
            f"mirrors at c=1: {mirrored['c1'][0]} paired, {mirrored['c1'][1]} shed; at c=32: {mirrored['c32'][0]} "
            f"paired, {mirrored['c32'][1]} shed (over {args.rounds} rounds)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
