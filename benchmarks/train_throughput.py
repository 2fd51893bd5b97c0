"""Training throughput: our loop against a bare torch loop, fp32 against bf16, 2-process DDP against
1 process.

Same model (the small-image ResNet-18, one seeded init), same data in memory, global batch 64,
SGD with Nesterov momentum and weight decay, same torch threads, on two inputs: the real 8x8 digits
(width 0.5, as configs/digits_resnet18.yaml) and synthetic 1x28x28 images (width 1.0, as
configs/fashion_mnist_resnet18.yaml). Three sections:

  loop   In one process with 2 threads: our real `train_step` fed by our real loader
         (`make_train_loader` -> StatefulDataLoader, DistributedSampler, `chunked`), plus the
         scheduler step and the grad norm every `log_every` steps as `train_loop` does them, against
         a bare `zero_grad / cross_entropy / backward / step` over tensors sliced from memory; each
         at fp32 and under bf16 autocast. Blocks of steps in adjacent (ours, bare) pairs, the order
         flipped round after round. At 2 threads (one process on 2 cores) and at 1 thread: 2-thread
         runs collapse when anything else runs on the machine (OpenMP waits for the descheduled
         thread), so when the load average is above ~1 trust the 1-thread rows.
  stage  The whole `pipeline train` stage (`pipeline.train.main(cfg)`, MLflow in a temporary SQLite
         store, system metrics off), fp32, read back as MLflow's `train/samples_per_s` windows
         (the first window, with the warm-up, dropped), against the bare loop in the same process.
  ddp    Our loop in fresh processes: 1 process x 1 thread, 1 process x 2 threads, and a real
         torchrun of 2 processes x 1 thread (DDP over gloo), launched in turns, round after round.
         Scaling efficiency = 2-process samples/s / (2 x 1-process-1-thread samples/s).
  stream Our loop (as `loop`, fp32) fed by `make_train_loader` over the training set in memory against
         the same loop fed by the same samples written as Parquet shards (`write_split`, default
         shard and row-group sizes) and streamed (`ShardedStream` -> its `StreamLoader`, what
         `data.name=sharded` trains from): same model init, batch and seed, with 0 and 2 loader workers,
         in one process with 1 torch thread (2 workers + 1 thread fill the 2 cores). Blocks of steps in
         adjacent (memory, stream) pairs, the order flipped round after round; blocks run on across
         epoch ends (the stream starts its workers afresh each epoch; the in-memory loader keeps
         persistent ones), so each median includes them in proportion. Target (issue 32): stream /
         memory >= 0.95.

Other work on the machine slows every configuration of a round alike, so each row is the median
over rounds and each ratio the median of the per-round ratios; the load average is printed with
the table. Compare rows within one run, never with numbers from another run or machine.

    .venv/bin/python benchmarks/train_throughput.py            # ~7 min on 2 idle cores, ~14 under
                                                               load
    .venv/bin/python benchmarks/train_throughput.py --quick    # smoke run, tiny widths: ~1 min idle
    .venv/bin/python benchmarks/train_throughput.py --sections stream   # the stream rows alone: ~2-3 min
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BATCH = 64
LR = 0.05
# as the train config's default: the grad norm is computed on logging steps
LOG_EVERY = 10
INPUTS = {
    # size -> what it trains on and the ResNet width of the config that trains on it
    8: {"data": "digits", "width": 0.5},
    28: {"data": "synthetic", "width": 1.0},
}
# Per size: warm-up steps, steps per timed block, rounds. 28x28 steps take ~5-10x longer than 8x8.
# Per section and size. loop: (warm-up steps, steps per timed block, rounds); stage: (max_steps,
# log_every, rounds); ddp: (warm-up steps, steps per block, rounds). A 28x28 step costs ~5-10x an
# 8x8 one. --quick shrinks the models (width / 8) as well: it checks the machinery, its numbers mean
# nothing.
PLANS = {
    "default": {
        "loop": {8: (4, 10, 6), 28: (2, 1, 6)},
        "stage": {8: (60, 10, 2), 28: (12, 3, 2)},
        "ddp": {8: (4, 10, 4), 28: (2, 2, 3)},
        # 22 steps: one epoch of the digits (1437 samples); a 28x28 width-1 step at 1 thread takes
        # ~1 s
        "stream": {8: (6, 22, 6), 28: (1, 2, 4)},
    },
    "quick": {
        "loop": {8: (1, 2, 2), 28: (1, 1, 2)},
        "stage": {8: (6, 2, 1), 28: (4, 2, 1)},
        "ddp": {8: (1, 2, 1), 28: (1, 1, 1)},
        "stream": {8: (1, 4, 2), 28: (1, 2, 2)},
    },
}
RESULT = "RESULT "


# ---- pieces every worker uses ------------------------------------------------------------------


def load_inputs(size: int):
    """The training set (in memory, batched by one index operation) of the built-in data set."""
    from pipeline.datasets import digits, synthetic

    if INPUTS[size]["data"] == "digits":
        return digits(0.2, 0)["train"]
    return synthetic(1, 28, 10, 1024)["train"]


def build(train, width: float):
    """The built-in ResNet-18 with the arguments the training set suggests, as `pipeline train`
    builds it."""
    from pipeline.components.build import ModelSpec, instantiate_model

    return instantiate_model(
        ModelSpec(
            "pipeline.models:resnet18",
            {
                "num_classes": len(train.classes),
                "width": width,
                **{k: train.model_args[k] for k in ("in_channels", "mean", "std")},
            },
        )
    )


def optim_cfg():
    from pipeline.config import OptimConfig

    return OptimConfig(name="sgd", lr=LR, momentum=0.9, weight_decay=5e-4, schedule="constant")


def our_stepper(model, splits, precision: str, info, batch_per_rank: int, num_workers: int = 0):
    """One call = one iteration of `train_loop` minus its logging: next batch from our loader,
    `train_step` (grad norm on logging steps), scheduler step. `splits`: a map-style training set
    or a ShardedStream (make_train_loader gives its StreamLoader)."""
    import torch.nn.functional as F

    from pipeline.components import amp
    from pipeline.components.data import make_train_loader, set_epoch
    from pipeline.components.optim import build_optimizer, build_scheduler
    from pipeline.plan import BatchPlan
    from pipeline.train import Learner, chunked, train_step

    optimizer = build_optimizer(model.parameters(), optim_cfg())
    scheduler = build_scheduler(optimizer, optim_cfg(), total_steps=10**9)
    learner = Learner(
        model=model,
        optimizer=optimizer,
        scaler=amp.grad_scaler(precision, info.device),
        device=info.device,
        precision=precision,
        loss_fn=F.cross_entropy,
    )
    loader = make_train_loader(
        splits,
        BatchPlan(rows=batch_per_rank, data_parallel=info.world_size),
        info.rank,
        seed=0,
        num_workers=num_workers,
        pin_memory=False,
    )

    def batches():
        epoch = 0
        while True:
            # as train_loop: the sampler's epoch, or the stream's
            set_epoch(loader, epoch)
            yield from chunked(loader, 1)
            epoch += 1

    it, step = batches(), 0

    def step_fn() -> float:
        nonlocal step
        step += 1
        loss, _ = train_step(learner, next(it), want_norm=step % LOG_EVERY == 0)
        scheduler.step()
        return loss

    return step_fn


def bare_stepper(model, splits, precision: str, batch: int):
    """The hand-written loop: contiguous slices of the in-memory tensors, nothing else."""
    import torch
    import torch.nn.functional as F

    x_all, y_all = splits.x, splits.y
    n = len(y_all) // batch
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, nesterov=True, weight_decay=5e-4)
    i = 0

    def step_fn() -> torch.Tensor:
        nonlocal i
        x, y = x_all[i * batch : (i + 1) * batch], y_all[i * batch : (i + 1) * batch]
        i = (i + 1) % n
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step_fn


def timed(step_fn, steps: int) -> float:
    """Seconds for `steps` calls."""
    t0 = time.perf_counter()
    for _ in range(steps):
        step_fn()
    return time.perf_counter() - t0


def emit(obj: dict) -> None:
    print(RESULT + json.dumps(obj), flush=True)


# ---- workers (each runs in its own process) ------------------------------------------------------


def worker_loop(a) -> None:
    """Ours vs bare x fp32 vs bf16 in one process: blocks of steps in adjacent pairs (ours, bare),
    the order flipped every round, so that a burst of outside load hits both sides of a pair."""
    import torch

    from pipeline import distributed

    info = distributed.setup("cpu", a.threads)
    splits = load_inputs(a.size)
    torch.manual_seed(0)
    base = build(splits, a.width).train()
    steppers = {}
    for precision in ("fp32", "bf16"):
        steppers[f"ours/{precision}"] = our_stepper(
            copy.deepcopy(base), splits, precision, info, BATCH
        )
        steppers[f"bare/{precision}"] = bare_stepper(copy.deepcopy(base), splits, precision, BATCH)
    for name in steppers:
        timed(steppers[name], a.warmup)
    per_round = {name: [] for name in steppers}
    for r in range(a.rounds):
        for precision in ("fp32", "bf16") if r % 2 == 0 else ("bf16", "fp32"):
            for who in ("ours", "bare") if (r // 2) % 2 == 0 else ("bare", "ours"):
                name = f"{who}/{precision}"
                per_round[name].append(a.steps * BATCH / timed(steppers[name], a.steps))
    final = {name: float(step_fn()) for name, step_fn in steppers.items()}
    emit({"samples_per_s": per_round, "threads": torch.get_num_threads(), "final_loss": final})


def worker_ddp(a) -> None:
    """Our loop under whatever launched this process: plain (a world of one) or torchrun. It stays
    up and runs a block of steps on each `run N` line on stdin (read by rank 0, broadcast to the
    others), so the configurations take turns without paying a start-up per round."""
    import torch

    from pipeline import distributed
    from pipeline.config import TrainConfig
    from pipeline.distributed.parallelize import wrap_model

    info = distributed.setup("cpu", a.threads)
    model = step_fn = None
    try:
        splits = load_inputs(a.size)
        torch.manual_seed(0)
        model = wrap_model(build(splits, a.width), TrainConfig(), a.precision, info)
        step_fn = our_stepper(model, splits, a.precision, info, BATCH // info.world_size)
        timed(step_fn, a.warmup)
        if info.is_main:
            emit({"ready": True, "ranks": info.world_size, "threads": torch.get_num_threads()})
        while True:
            command = distributed.broadcast_object(
                sys.stdin.readline().split() if info.is_main else None, info
            )
            if not command or command[0] != "run":
                break
            distributed.barrier(info)
            # DDP all-reduces every step: the ranks stay in lockstep
            elapsed = timed(step_fn, int(command[1]))
            if info.is_main:
                emit({"samples_per_s": int(command[1]) * BATCH / elapsed})
    finally:
        # DDP's reducer holds the group: drop it (and the stepper that holds it) first, or gloo's
        # destructor can hang the rank at exit (see pipeline.train.main).
        model = step_fn = None  # noqa: F841
        # never wait for peers on an error path
        distributed.teardown(clean=sys.exc_info()[0] is None)


def write_shards(splits, directory: str):
    """The training set written as a sharded split (default shard and row-group sizes), opened as a
    stream."""
    from pipeline.shards.format import write_split
    from pipeline.shards.stream import ShardedStream

    write_split(
        ((i, splits.x[i], splits.y[i]) for i in range(len(splits))),
        directory,
        classes=list(splits.classes),
        model_args=dict(splits.model_args),
    )
    return ShardedStream(directory)


def worker_stream(a) -> None:
    """Our loop fed from memory and from the stream of the same samples, for each loader-worker
    count: blocks of steps in adjacent (memory, stream) pairs, the order flipped every round."""
    import torch

    from pipeline import distributed

    info = distributed.setup("cpu", a.threads)
    splits = load_inputs(a.size)
    stream = write_shards(splits, f"{a.workdir}/shards-{a.size}")
    torch.manual_seed(0)
    base = build(splits, a.width).train()
    steppers = {}
    for workers in a.loader_workers:
        steppers[f"memory/{workers}"] = our_stepper(
            copy.deepcopy(base), splits, "fp32", info, BATCH, workers
        )
        steppers[f"stream/{workers}"] = our_stepper(
            copy.deepcopy(base), stream, "fp32", info, BATCH, workers
        )
    for name in steppers:
        timed(steppers[name], a.warmup)
    per_round = {name: [] for name in steppers}
    for r in range(a.rounds):
        order = a.loader_workers if r % 2 == 0 else a.loader_workers[::-1]
        for workers in order:
            for who in ("memory", "stream") if (r // 2) % 2 == 0 else ("stream", "memory"):
                name = f"{who}/{workers}"
                per_round[name].append(a.steps * BATCH / timed(steppers[name], a.steps))
    final = {name: float(step_fn()) for name, step_fn in steppers.items()}
    emit(
        {
            "samples_per_s": per_round,
            "threads": torch.get_num_threads(),
            "final_loss": final,
            "samples": len(splits),
            "shard_rows": len(stream),
            "row_groups": sum(len(s.row_groups) for s in stream.manifest.shards),
        }
    )


def worker_stage(a) -> None:
    """`pipeline.train.main(cfg)` and the bare loop in one process, in the order asked."""
    import mlflow
    import torch

    from pipeline.config import load_config
    from pipeline.train import main

    def stage() -> list[float]:
        spec = INPUTS[a.size]
        data_args = (
            ["data.args.size=28", "data.args.samples=1024"] if spec["data"] == "synthetic" else []
        )
        overrides = [
            f"data.name={spec['data']}",
            *data_args,
            "model.name=resnet18",
            f"model.args.width={a.width}",
            "optim.name=sgd",
            f"optim.lr={LR}",
            "optim.schedule=constant",
            "train.device=cpu",
            "train.precision=fp32",
            f"train.global_batch_size={BATCH}",
            f"train.max_steps={a.steps}",
            f"train.log_every={a.warmup}",
            f"train.eval_every={10**6}",
            "train.consistency_every=0",
            f"train.output_dir={a.workdir}/outputs",
            f"train.run_name=bench-{a.size}-{time.time_ns()}",
            "checkpoint.every_n_steps=0",
            "checkpoint.log_to_mlflow=none",
            f"tracking.tracking_uri=sqlite:///{a.workdir}/mlflow.db",
            "tracking.experiment=train-throughput",
            "tracking.system_metrics=false",
        ]
        result = main(load_config(None, overrides))
        history = mlflow.MlflowClient().get_metric_history(result.run_id, "train/samples_per_s")
        # the first window holds the warm-up
        return [m.value for m in sorted(history, key=lambda m: m.step)][1:]

    def bare() -> list[float]:
        splits = load_inputs(a.size)
        torch.manual_seed(0)
        step_fn = bare_stepper(build(splits, a.width).train(), splits, "fp32", BATCH)
        windows = [a.warmup * BATCH / timed(step_fn, a.warmup) for _ in range(a.steps // a.warmup)]
        return windows[1:]

    out = {}
    for name in ("bare", "stage") if a.bare_first else ("stage", "bare"):
        out[name] = statistics.median((bare if name == "bare" else stage)())
        out[f"{name}_threads"] = torch.get_num_threads()
    emit(out)


# ---- the driver ----------------------------------------------------------------------------------


def run_worker(cmd: list[str], env: dict, cwd: Path | None = None) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(
            f"worker failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    return json.loads(lines[-1][len(RESULT) :])


def me(*args) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *map(str, args)]


def med(values) -> float:
    return statistics.median(values)


def spread(values) -> str:
    return f"{min(values):.0f}-{max(values):.0f}" if len(values) > 1 else ""


def load_now() -> str:
    return "/".join(f"{v:.2f}" for v in os.getloadavg())


def section_loop(size: int, plan, width: float, threads: int, env: dict) -> dict:
    warmup, steps, rounds = plan
    return run_worker(
        me(
            "--worker",
            "loop",
            "--size",
            size,
            "--width",
            width,
            "--threads",
            threads,
            "--warmup",
            warmup,
            "--steps",
            steps,
            "--rounds",
            rounds,
        ),
        env,
    )


def section_stream(
    size: int, plan, width: float, threads: int, workers: str, env: dict, workdir: Path
) -> dict:
    warmup, steps, rounds = plan
    return run_worker(
        me(
            "--worker",
            "stream",
            "--size",
            size,
            "--width",
            width,
            "--threads",
            threads,
            "--warmup",
            warmup,
            "--steps",
            steps,
            "--rounds",
            rounds,
            "--workdir",
            workdir,
            "--loader-workers",
            workers,
        ),
        env,
    )


def section_stage(size: int, plan, width: float, env: dict, workdir: Path) -> list[dict]:
    max_steps, log_every, rounds = plan
    return [
        run_worker(
            me(
                "--worker",
                "stage",
                "--size",
                size,
                "--width",
                width,
                "--steps",
                max_steps,
                "--warmup",
                log_every,
                "--workdir",
                workdir,
                *(["--bare-first"] if r % 2 else []),
            ),
            env,
            cwd=workdir,
        )
        for r in range(rounds)
    ]


class Worker:
    """A `--worker ddp` process (or torchrun of them) that runs a block of steps when told to."""

    def __init__(self, cmd: list[str], env: dict):
        self.cmd = cmd
        self.err = tempfile.TemporaryFile(mode="w+")
        # Its own session: torchrun and its ranks can be ended together, by this group's id only.
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
            env=env,
            bufsize=1,
            start_new_session=True,
        )

    def result(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT) :])
        self.err.seek(0)
        raise SystemExit(
            f"worker exited ({self.proc.wait()}): {' '.join(self.cmd)}\n{self.err.read()[-4000:]}"
        )

    def run(self, steps: int) -> float:
        self.proc.stdin.write(f"run {steps}\n")
        self.proc.stdin.flush()
        return self.result()["samples_per_s"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                # the group this worker started, ranks included
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.err.close()


def section_ddp(size: int, plan, width: float, precision: str, env: dict) -> dict:
    """All three configurations start (and warm up) one after another, then take turns."""
    warmup, steps, rounds = plan
    common = [
        "--worker",
        "ddp",
        "--size",
        size,
        "--width",
        width,
        "--warmup",
        warmup,
        "--precision",
        precision,
    ]
    configs = {
        "1 proc x 1 thread": me(*common, "--threads", 1),
        "1 proc x 2 threads": me(*common, "--threads", 2),
        "2 procs x 1 thread (DDP)": [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            *me(*common, "--threads", 1)[1:],
        ],
    }
    workers: dict[str, Worker] = {}
    try:
        for name, cmd in configs.items():
            workers[name] = Worker(cmd, env)
            # one at a time: a warm-up must not slow another's
            ready = workers[name].result()
            want = 2 if "DDP" in name else 1
            # count the ranks you got
            if ready["ranks"] != want:
                raise SystemExit(f"{name}: got {ready['ranks']} ranks, expected {want}")
        names = list(configs)
        out = {n: [] for n in names}
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                out[name].append(workers[name].run(steps))
        return out
    finally:
        for w in workers.values():
            w.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: few steps, one or two rounds"
    )
    parser.add_argument(
        "--sizes", default="8,28", help="input sizes to measure: 8 (digits) and/or 28"
    )
    parser.add_argument(
        "--sections", default="loop,stage,ddp,stream", help="which of loop,stage,ddp,stream to run"
    )
    parser.add_argument(
        "--loop-threads",
        default="2,1",
        help="torch threads of the loop section, comma-separated: 2 is what one process uses "
        "on 2 cores; 1 (what each DDP rank uses) holds up better when others load the machine",
    )
    parser.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--ddp-precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument(
        "--stream-workers",
        default="0,2",
        help="loader workers of the stream section, comma-separated",
    )
    parser.add_argument(
        "--stream-threads", type=int, default=1, help="torch threads of the stream section"
    )
    # internal: what a worker process runs
    parser.add_argument(
        "--worker", choices=["loop", "ddp", "stage", "stream"], help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--loader-workers", type=lambda v: [int(w) for w in v.split(",")], help=argparse.SUPPRESS
    )
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--width", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--bare-first", action="store_true", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.worker:
        {"loop": worker_loop, "ddp": worker_ddp, "stage": worker_stage, "stream": worker_stream}[
            a.worker
        ](a)
        return

    import torch

    from pipeline.components import amp

    plan = PLANS["quick" if a.quick else "default"]
    width = {size: INPUTS[size]["width"] / (8 if a.quick else 1) for size in INPUTS}
    sizes = [int(s) for s in a.sizes.split(",")]
    sections = a.sections.split(",")
    # torchrun would set OMP_NUM_THREADS=1 with a warning; every worker sets its threads itself.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    auto = amp.resolve_precision("auto", torch.device("cpu"))
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, avx512_bf16={torch.cpu._is_avx512_bf16_supported()} "
        f"amx={torch.cpu._is_amx_tile_supported()}: precision auto -> {auto}"
    )
    print(
        f"global batch {BATCH}, SGD nesterov lr {LR}; load average at start {load_now()}"
        + (" (--quick: too few steps to trust)" if a.quick else "")
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="train-throughput-") as tmp:
        for size in sizes:
            for threads in (int(t) for t in a.loop_threads.split(",") if "loop" in sections):
                t0, l0 = time.perf_counter(), load_now()
                res = section_loop(size, plan["loop"][size], width[size], threads, env)
                print_loop(size, width[size], res, l0, load_now(), time.perf_counter() - t0, auto)
            if "stage" in sections:
                t0, l0 = time.perf_counter(), load_now()
                res = section_stage(size, plan["stage"][size], width[size], env, Path(tmp))
                print_stage(size, width[size], res, l0, load_now(), time.perf_counter() - t0)
            if "ddp" in sections:
                t0, l0 = time.perf_counter(), load_now()
                res = section_ddp(size, plan["ddp"][size], width[size], a.ddp_precision, env)
                print_ddp(
                    size,
                    width[size],
                    a.ddp_precision,
                    res,
                    l0,
                    load_now(),
                    time.perf_counter() - t0,
                )
            if "stream" in sections:
                t0, l0 = time.perf_counter(), load_now()
                res = section_stream(
                    size,
                    plan["stream"][size],
                    width[size],
                    a.stream_threads,
                    a.stream_workers,
                    env,
                    Path(tmp),
                )
                print_stream(size, width[size], res, l0, load_now(), time.perf_counter() - t0)
    print(f"\ntotal {time.perf_counter() - started:.0f} s; load average at end {load_now()}")


def label(size: int, width: float) -> str:
    return f"{size}x{size} {INPUTS[size]['data']}, ResNet-18 width {width:g}"


def header(title: str, l0: str, l1: str, seconds: float) -> None:
    print(f"\n## {title}   [load {l0} -> {l1}, {seconds:.0f} s]")


def print_loop(
    size: int, width: float, res: dict, l0: str, l1: str, seconds: float, auto: str
) -> None:
    sps = res["samples_per_s"]
    rounds = len(next(iter(sps.values())))
    header(
        f"loop, {label(size, width)}, 1 process x {res['threads']} threads, {rounds} rounds",
        l0,
        l1,
        seconds,
    )
    print(
        f"{'loop':<6} {'precision':<10} {'samples/s':>10} {'range':>10} {'ours/bare':>10} {'bf16/fp32':>10}"
    )
    for who in ("bare", "ours"):
        for precision in ("fp32", "bf16"):
            v = sps[f"{who}/{precision}"]
            ratio = med([o / b for o, b in zip(sps[f"ours/{precision}"], sps[f"bare/{precision}"])])
            bf = med([b / f for b, f in zip(sps[f"{who}/bf16"], sps[f"{who}/fp32"])])
            print(
                f"{who:<6} {precision:<10} {med(v):>10.1f} {spread(v):>10} "
                f"{(f'{ratio:.3f}' if who == 'ours' else ''):>10} {(f'{bf:.2f}' if precision == 'bf16' else ''):>10}"
            )
    bf = med([b / f for b, f in zip(sps["ours/bf16"], sps["ours/fp32"])])
    faster = "bf16" if bf > 1 else "fp32"
    print(
        f"precision auto picks {auto} here; the faster one at this size is {faster} ({bf:.2f}x)"
        + ("" if auto == faster else "  <-- auto picks the slower one")
    )


def print_stage(
    size: int, width: float, rounds: list[dict], l0: str, l1: str, seconds: float
) -> None:
    header(
        f"`pipeline train` stage vs bare, {label(size, width)}, fp32, {len(rounds)} rounds",
        l0,
        l1,
        seconds,
    )
    stage, bare = [r["stage"] for r in rounds], [r["bare"] for r in rounds]
    print(f"{'loop':<28} {'samples/s':>10} {'range':>10} {'vs bare':>10}")
    print(f"{'bare':<28} {med(bare):>10.1f} {spread(bare):>10}")
    print(
        f"{'pipeline.train.main (MLflow)':<28} {med(stage):>10.1f} {spread(stage):>10} "
        f"{med([s / b for s, b in zip(stage, bare)]):>10.3f}"
    )
    print(f"threads: stage {rounds[0]['stage_threads']}, bare {rounds[0]['bare_threads']}")


def print_ddp(
    size: int, width: float, precision: str, res: dict, l0: str, l1: str, seconds: float
) -> None:
    rounds = len(next(iter(res.values())))
    header(
        f"DDP (gloo) vs 1 process, our loop, {label(size, width)}, {precision}, {rounds} rounds",
        l0,
        l1,
        seconds,
    )
    one = res["1 proc x 1 thread"]
    print(f"{'configuration':<26} {'samples/s':>10} {'range':>10} {'vs 1x1':>8}")
    for name, v in res.items():
        print(
            f"{name:<26} {med(v):>10.1f} {spread(v):>10} {med([x / o for x, o in zip(v, one)]):>8.2f}"
        )
    two = res["2 procs x 1 thread (DDP)"]
    eff = med([d / (2 * o) for d, o in zip(two, one)])
    vs2t = med([d / t for d, t in zip(two, res["1 proc x 2 threads"])])
    print(
        f"scaling efficiency 2 procs / (2 x 1 proc x 1 thread): {eff:.2f}; 2 procs / 1 proc x 2 threads: {vs2t:.2f}"
    )


def print_stream(size: int, width: float, res: dict, l0: str, l1: str, seconds: float) -> None:
    sps = res["samples_per_s"]
    rounds = len(next(iter(sps.values())))
    header(
        f"stream vs memory, our loop, {label(size, width)}, fp32, 1 process x {res['threads']} threads, "
        f"{rounds} rounds",
        l0,
        l1,
        seconds,
    )
    print(
        f"{res['samples']} samples in memory; as shards: {res['shard_rows']} rows in {res['row_groups']} row groups"
    )
    print(f"{'data':<8} {'workers':>7} {'samples/s':>10} {'range':>12} {'stream/memory':>14}")
    for workers in sorted({name.split("/")[1] for name in sps}, key=int):
        for who in ("memory", "stream"):
            v = sps[f"{who}/{workers}"]
            ratio = med([s / m for s, m in zip(sps[f"stream/{workers}"], sps[f"memory/{workers}"])])
            verdict = (
                f"{ratio:.3f} {'ok' if ratio >= 0.95 else '< 0.95'}" if who == "stream" else ""
            )
            print(f"{who:<8} {workers:>7} {med(v):>10.1f} {spread(v):>12} {verdict:>14}")


if __name__ == "__main__":
    main()
