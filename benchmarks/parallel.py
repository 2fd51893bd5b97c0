"""Issue 34: the device meshes of `train.parallel` side by side on a transformer, the BERT example
(configs/digit_sequences_bert.yaml, dropout off), each a real `pipeline train` torchrun launch at
the same global batch (64) and seed, in one temporary working directory:

  DDP 2          train.strategy=ddp, 2 processes: the baseline
  FSDP 2         train.strategy=fsdp, 2 processes (dp_shard=2)
  HSDP 2x2       train.strategy=fsdp dp_replicate=2 dp_shard=2, 4 processes
  TP 2           train.parallel.tp=2, 2 processes (one tensor-parallel group, no data parallelism)
  TP 2 x FSDP 2  train.strategy=fsdp tp=2 dp_shard=2, 4 processes
  PP 2           train.parallel.pp=2, 2 processes (the model cut at its 2nd layer; 1F1B, 4
                 micro-batches of 16)
  PP 2 x DDP 2   train.parallel.pp=2 dp_shard=2, 4 processes (each stage DDP over its 2 copies)

For each (train.log_every=1, train.eval_every=0, tracking.system_metrics=false, OMP_NUM_THREADS=1):

  step ms      the median over the steps after the first WARMUP of 1000 x global batch /
               `train/samples_per_s` as logged to MLflow. With log_every=1 each logged window is
               exactly one optimizer step (the forward, backward and optimizer step plus the loss's
               all-reduce across ranks; MLflow's own logging falls outside the window). Not wall
               clock between metric timestamps.
  peak RSS     the largest resident set of each rank's process (found by RANK in its environment;
               its own children, if any, added) over the run, sampled with psutil every 50 ms from
               the launcher's process tree, MB, listed by rank (rank 0 also holds the MLflow client
               and logs for the run).
  loss vs DDP  the first 20 logged `train/loss` values against DDP 2's at the same steps: max |diff| and max
               relative diff. The same global batches reach every mesh (the data order does not depend on the
               world size), so they differ only by the order of float sums: ~1e-6 is agreement.

These are CPU figures over gloo on a small machine (the 4-process meshes share its cores, so their
step times count oversubscription as much as the mesh): they prove that the meshes agree with DDP
and how they spread memory, not GPU speed. The model is small (~80 k parameters: ~1 MB with AdamW's
state), so a rank's RSS is mostly the runtime (Python, torch, transformers, gloo): sharding it saves
nothing visible here, and the column shows that no mesh costs a rank more than DDP does. The load
average is printed with the table (other work on the machine moves the step times); compare rows of
one run only.

    PYTHONPATH=. .venv/bin/python benchmarks/parallel.py            # 7 meshes x 30 steps: a few minutes on 2 cores
    PYTHONPATH=. .venv/bin/python benchmarks/parallel.py --quick    # DDP, HSDP 2x2, TP 2 and PP 2, 12 steps
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
BERT = str(REPO / "configs/digit_sequences_bert.yaml")
EXPERIMENT = "trainserve-digit-sequences"
# steps left out of the step time's median
WARMUP = 5
# losses compared with DDP's
COMPARED = 20
GLOBAL_BATCH = 64

# (name, processes, overrides)
MESHES = [
    ("DDP 2", 2, ["train.strategy=ddp"]),
    ("FSDP 2", 2, ["train.strategy=fsdp"]),
    (
        "HSDP 2x2",
        4,
        ["train.strategy=fsdp", "train.parallel.dp_replicate=2", "train.parallel.dp_shard=2"],
    ),
    ("TP 2", 2, ["train.parallel.tp=2"]),
    (
        "TP 2 x FSDP 2",
        4,
        ["train.strategy=fsdp", "train.parallel.tp=2", "train.parallel.dp_shard=2"],
    ),
    ("PP 2", 2, ["train.parallel.pp=2"]),
    ("PP 2 x DDP 2", 4, ["train.parallel.pp=2", "train.parallel.dp_shard=2"]),
]
QUICK = ["DDP 2", "HSDP 2x2", "TP 2", "PP 2"]


def sample_ranks(
    root: psutil.Process, peaks: dict[int, float], stop: threading.Event, every: float = 0.05
):
    """Every `every` s: each rank process's RSS (its children added), the largest kept per rank, in
    MB."""
    # pid -> rank
    ranks: dict[int, int] = {}
    while not stop.is_set():
        try:
            tree = root.children(recursive=True)
        except psutil.Error:
            break
        for proc in tree:
            try:
                if proc.pid not in ranks:
                    rank = proc.environ().get("RANK")
                    if (
                        rank is None
                        or proc.parent() is None
                        or proc.parent().environ().get("RANK") is not None
                    ):
                        # not a rank, or a rank's child (counted with it)
                        continue
                    ranks[proc.pid] = int(rank)
                rss = proc.memory_info().rss
                for child in proc.children(recursive=True):
                    try:
                        rss += child.memory_info().rss
                    except psutil.Error:
                        pass
                rank = ranks[proc.pid]
                peaks[rank] = max(peaks.get(rank, 0.0), rss / 2**20)
            except psutil.Error:
                continue
        stop.wait(every)


def launch(workdir: Path, name: str, nproc: int, overrides: list[str], steps: int) -> dict:
    run_name = name.replace(" ", "_")
    args = [
        sys.executable,
        "-m",
        "pipeline",
        "train",
        "--config",
        BERT,
        "--nproc-per-node",
        str(nproc),
        "--max-restarts=0",
        f"train.max_steps={steps}",
        "train.log_every=1",
        "train.eval_every=0",
        f"train.global_batch_size={GLOBAL_BATCH}",
        "checkpoint.every_n_steps=1000",
        "model.args.hidden_dropout_prob=0",
        "model.args.attention_probs_dropout_prob=0",
        "tracking.system_metrics=false",
        f"train.run_name={run_name}",
        *overrides,
    ]
    env = dict(os.environ)
    env.pop("MLFLOW_TRACKING_URI", None)
    env.update(
        {
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        }
    )
    peaks: dict[int, float] = {}
    stop = threading.Event()
    start = time.perf_counter()
    proc = subprocess.Popen(
        args,
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    sampler = threading.Thread(
        target=sample_ranks, args=(psutil.Process(proc.pid), peaks, stop), daemon=True
    )
    sampler.start()
    out, err = proc.communicate(timeout=900)
    stop.set()
    sampler.join()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{name}: pipeline train exited {proc.returncode}\n{err[-4000:]}")
    history = metrics(workdir, run_name)
    return {"name": name, "nproc": nproc, "peaks": peaks, "wall": wall, **history}


def metrics(workdir: Path, run_name: str) -> dict:
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    exp = client.get_experiment_by_name(EXPERIMENT)
    run = client.search_runs(
        [exp.experiment_id], filter_string=f"attributes.run_name = '{run_name}'"
    )[0]
    loss = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    rate = {
        m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/samples_per_s")
    }
    step_ms = [1000 * GLOBAL_BATCH / rate[s] for s in sorted(rate) if s > WARMUP]
    return {"loss": loss, "step_ms": statistics.median(step_ms), "step_ms_iqr": iqr(step_ms)}


def iqr(values: list[float]) -> tuple[float, float]:
    if len(values) < 4:
        return min(values), max(values)
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def agreement(mine: dict[int, float], base: dict[int, float]) -> tuple[float, float, int]:
    steps = sorted(set(mine) & set(base))[:COMPARED]
    diffs = [abs(mine[s] - base[s]) for s in steps]
    rels = [abs(mine[s] - base[s]) / abs(base[s]) for s in steps]
    return max(diffs), max(rels), len(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="4 meshes (DDP 2, HSDP 2x2, TP 2, PP 2), 12 steps"
    )
    parser.add_argument(
        "--steps", type=int, default=0, help="optimizer steps per mesh (default 30, --quick 12)"
    )
    opts = parser.parse_args()
    steps = opts.steps or (12 if opts.quick else 30)
    meshes = [m for m in MESHES if not opts.quick or m[0] in QUICK]
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; BERT example (hidden 64, 2 layers), "
        f"global batch {GLOBAL_BATCH}, {steps} steps, dropout off, fp32, gloo; load average before: "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        flush=True,
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_parallel_") as tmp:
        for name, nproc, overrides in meshes:
            result = launch(Path(tmp), name, nproc, overrides, steps)
            print(
                f"  {name}: {result['wall']:.1f} s wall, load average {os.getloadavg()[0]:.2f}",
                flush=True,
            )
            results.append(result)
    base = results[0]["loss"]
    compared = min(COMPARED, steps)
    print()
    print(
        f"| mesh | procs | step ms (median, IQR) | peak RSS MB, rank 0 / 1 / ... | first {compared} losses vs DDP: "
        f"max abs diff | max rel diff |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        rss_s = " / ".join(f"{r['peaks'][k]:.0f}" for k in sorted(r["peaks"])) or "not sampled"
        lo, hi = r["step_ms_iqr"]
        if r is results[0]:
            diff_s, rel_s = "(baseline)", "(baseline)"
        else:
            diff, rel, n = agreement(r["loss"], base)
            diff_s, rel_s = f"{diff:.2e}" + ("" if n == compared else f" ({n} steps)"), f"{rel:.2e}"
        print(
            f"| {r['name']} | {r['nproc']} | {r['step_ms']:.1f} ({lo:.1f}-{hi:.1f}) | {rss_s} | {diff_s} | {rel_s} |"
        )
    print(
        f"\nstep ms: 1000 x {GLOBAL_BATCH} / train/samples_per_s of one-step MLflow windows, steps > {WARMUP}. "
        f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )


if __name__ == "__main__":
    main()
