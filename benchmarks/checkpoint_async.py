"""What a checkpoint save costs the training step: synchronous vs `checkpoint.async_save`, in the
same run.

A real 2-process torchrun (gloo, CPU, 1 thread per rank) trains the ResNet-18 of
configs/digits_resnet18.yaml (width 0.5: 2.8 M parameters, with AdamW's moments a ~34 MB state;
--width 1: ~135 MB) with DDP on random batches, and saves through the trainer's own Saver
(pipeline/checkpoint/saver.py) in turns: a synchronous save, then an asynchronous one, round after
round. Reported (rank 0, medians over rounds):
  - a step without a save;
  - the step that saves: the step plus the save call (synchronous: the whole save; asynchronous:
    staging the state to CPU memory and starting the write);
  - the steps while the asynchronous write is in flight (the write and its hashing run in threads on
    the same 2 cores), and the step that publishes it (marker, rename);
  - how many steps the asynchronous save stayed in flight.

    .venv/bin/python benchmarks/checkpoint_async.py [--image-size 8] [--width 0.5] [--batch 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker(args) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from pipeline.checkpoint.saver import Saver
    from pipeline.distributed import DistInfo
    from pipeline.models import resnet18

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    info = DistInfo(rank, world, rank, world, torch.device("cpu"))
    torch.manual_seed(0)
    model = DistributedDataParallel(
        resnet18(num_classes=10, in_channels=1, width=args.width, mean=[0.5], std=[0.25])
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.rand(args.batch, 1, args.image_size, args.image_size)
    y = torch.randint(0, 10, (args.batch,))

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    root = Path(args.out)
    savers = {
        "sync": Saver(root / "sync", info, 2, asynchronous=False),
        "async": Saver(root / "async", info, 2, asynchronous=True),
    }
    for _ in range(5):
        step()
    times: dict[str, list[float]] = {
        "plain": [],
        "sync.save_step": [],
        "async.save_step": [],
        "async.in_flight": [],
        "async.publish_step": [],
        "async.steps_in_flight": [],
        "plain.cpu": [],
        "async.extra_cpu": [],
    }
    n = 0
    for _ in range(args.rounds):
        for mode, saver in savers.items():
            for _ in range(args.plain_steps):
                t, cpu = time.perf_counter(), time.process_time()
                step()
                times["plain"].append(time.perf_counter() - t)
                times["plain.cpu"].append(time.process_time() - cpu)
            n += 1
            t, cpu, plain_cpu = (
                time.perf_counter(),
                time.process_time(),
                float(np.median(times["plain.cpu"])),
            )
            step()
            saver.save(n, model.module, optimizer, {}, (), lambda path: None)
            times[f"{mode}.save_step"].append(time.perf_counter() - t)
            flight = 0
            while mode == "async":
                t = time.perf_counter()
                step()
                saver.poll()
                elapsed = time.perf_counter() - t
                flight += 1
                # Every rank steps until every rank's save is published: a rank whose publish came a
                # step earlier than another's would otherwise start the next save's collectives
                # against its step.
                done = torch.tensor([int(saver.pending is None)])
                dist.all_reduce(done, op=dist.ReduceOp.MIN)
                (times["async.publish_step"] if done.item() else times["async.in_flight"]).append(
                    elapsed
                )
                if done.item():
                    break
            if mode == "async":
                times["async.steps_in_flight"].append(flight)
                # This process's CPU time (every thread) from the saving step to the publish, less
                # what as many plain steps take: what the save itself cost this rank's CPU.
                times["async.extra_cpu"].append(
                    time.process_time() - cpu - (flight + 1) * plain_cpu
                )
    for saver in savers.values():
        saver.close()
    if rank == 0:
        print(json.dumps({k: float(np.median(v)) if v else None for k, v in times.items()}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--image-size", type=int, default=8, help="8 = digits (the demo config), 28 = 28x28 images"
    )
    parser.add_argument(
        "--width", type=float, default=0.5, help="the ResNet's width (0.5: the demo config)"
    )
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--plain-steps", type=int, default=6, help="steps without a save before each save"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory(prefix="ckpt-async-bench-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            __file__,
            "--worker",
            "--out",
            tmp,
            "--image-size",
            str(args.image_size),
            "--width",
            str(args.width),
            "--batch",
            str(args.batch),
            "--rounds",
            str(args.rounds),
            "--plain-steps",
            str(args.plain_steps),
        ]
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
        )
        if proc.returncode:
            raise SystemExit(proc.stderr[-4000:])
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    plain = r["plain"]
    print(
        f"\nResNet-18 (width {args.width}) + AdamW, DDP 2 ranks x 1 thread (gloo), {args.image_size}x{args.image_size} images, batch "
        f"{args.batch} per rank; medians of {args.rounds} rounds\n"
    )
    print("| step | ms | x a step without a save |")
    print("|---|---|---|")
    rows = [
        ("without a save", plain),
        ("synchronous save: the saving step", r["sync.save_step"]),
        ("async save: the saving step (stage + start)", r["async.save_step"]),
        ("async save: a step while writing", r["async.in_flight"]),
        ("async save: the publishing step", r["async.publish_step"]),
    ]
    for label, seconds in rows:
        print(
            f"| {label} | {seconds * 1e3:.0f} | {seconds / plain:.2f} |"
            if seconds
            else f"| {label} | - | - |"
        )
    print(
        f"\nthe async save stayed in flight for {r['async.steps_in_flight']:.0f} steps; it cost rank 0 "
        f"{r['async.extra_cpu'] * 1e3:.0f} ms of CPU time beyond those steps' own ({r['async.extra_cpu'] / r['plain.cpu']:.1f} "
        f"steps' worth), on cores the ranks keep busy"
    )


if __name__ == "__main__":
    main()
