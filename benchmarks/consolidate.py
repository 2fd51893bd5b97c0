"""Consolidation: ours vs `dcp_to_torch_save` vs the I/O floor, measured in the same run.

The floor is what a consolidation that verifies its input cannot avoid: every shard byte read and
hashed once (`sha256sum` of the checkpoint's files) plus the output's bytes written once (fsync'd).
A plain read of the shards (`read`) is shown too, but it is no floor: it neither hashes nor writes.

For each size, a checkpoint of about that many GB (MLP weights + AdamW state, ~1/3 weights) is
written by a real 2-process torchrun (gloo, CPU) through `pipeline.checkpoint.save`, then each
method runs in a fresh process that reports its time and its peak RSS over its own baseline
(getrusage). The page cache can't be dropped here, so the shards are read once to warm it and
every method then reads from memory: the times compare CPU work, not disk speed. Checkpoints live
in a temporary directory, deleted at the end.

    .venv/bin/python benchmarks/consolidate.py --sizes 0.1,0.5,2 [--strategy ddp|fsdp]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAKE = REPO / "tests" / "scripts" / "consolidate_make_checkpoint.py"
MEASURE = REPO / "tests" / "scripts" / "consolidate_peak_rss.py"
# hidden layers of the MLP: a handful of big tensors, as in a real model's blocks
LAYERS = 6
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def model_for_size(gigabytes: float) -> dict:
    """The built-in MLP whose checkpoint (weights + AdamW's two moments) is about `gigabytes` GB."""
    weights = gigabytes * 1e9 / 3
    hidden = int(math.sqrt(weights / (LAYERS * 4)))
    side = max(4, round(math.sqrt(hidden)))
    return {
        "component": "pipeline.models:mlp",
        "args": {
            "in_channels": 1,
            "num_classes": 10,
            "image_size": side,
            "hidden": [hidden] * LAYERS,
            "mean": [0.5],
            "std": [0.25],
        },
    }


def make_checkpoint(gigabytes: float, strategy: str, root: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(MAKE),
        "--strategy",
        strategy,
        "--steps",
        "1",
        "--model",
        json.dumps(model_for_size(gigabytes)),
        "--out",
        str(root),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
    if proc.returncode != 0:
        raise SystemExit(f"making the {gigabytes} GB checkpoint failed:\n{proc.stderr[-4000:]}")
    return next((root / "run" / "checkpoints").glob("step_*"))


def measure(mode: str, ckpt: Path, out: Path, output_bytes: int = 0) -> dict:
    proc = subprocess.run(
        [sys.executable, str(MEASURE), mode, str(ckpt), str(out), str(output_bytes)],
        capture_output=True,
        text=True,
        env=ENV,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{mode} on {ckpt} failed:\n{proc.stderr[-4000:]}")
    shutil.rmtree(out, ignore_errors=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def model_tensor_bytes(ckpt: Path) -> tuple[int, int]:
    """(the largest model tensor's bytes, all model tensors' bytes): the output is about the
    second."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    sizes = [
        m.size.numel() * m.properties.dtype.itemsize
        for k, m in md.items()
        if k.startswith("model.")
    ]
    return max(sizes), sum(sizes)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", default="0.1,0.5,2", help="checkpoint sizes in GB, comma-separated"
    )
    parser.add_argument(
        "--strategy",
        choices=["ddp", "fsdp"],
        default="ddp",
        help="ddp stores each tensor whole (the harder case for memory), fsdp in slices",
    )
    parser.add_argument(
        "--workdir", default=None, help="where to write the checkpoints (default: a temp dir)"
    )
    parser.add_argument(
        "--skip-dcp",
        action="store_true",
        help="leave out dcp_to_torch_save (slow, whole-checkpoint peak)",
    )
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="consolidate-bench-") as tmp:
        for gigabytes in (float(s) for s in args.sizes.split(",")):
            root = Path(tmp) / f"{gigabytes}GB"
            ckpt = make_checkpoint(gigabytes, args.strategy, root)
            size = sum(f.stat().st_size for f in ckpt.iterdir())
            largest, output = model_tensor_bytes(ckpt)
            # warms the page cache; not reported
            measure("read", ckpt, root / "warm")
            modes = ("floor", "read", "ours") + (() if args.skip_dcp else ("dcp_to_torch_save",))
            results = {mode: measure(mode, ckpt, root / mode, output) for mode in modes}
            for mode, r in results.items():
                rows.append(
                    (
                        size,
                        largest,
                        mode,
                        r["seconds"],
                        r["seconds"] / results["floor"]["seconds"],
                        (r["peak"] - r["baseline"]),
                        (r["peak"] - r["baseline"]) / largest,
                    )
                )
            shutil.rmtree(root)
            print(f"done: {size / 1e9:.2f} GB", file=sys.stderr, flush=True)

    print(
        f"\nstrategy {args.strategy}, 2 shards, model + AdamW; floor = sha256sum of the shards + writing the output "
        "once; peak = max RSS over the process's own baseline\n"
    )
    print(
        "| checkpoint | largest tensor | method | time (s) | x floor | peak RSS (MB) | peak / largest |"
    )
    print("|---|---|---|---|---|---|---|")
    for size, largest, mode, seconds, x_read, peak, x_largest in rows:
        print(
            f"| {size / 1e9:.2f} GB | {largest / 1e6:.0f} MB | {mode} | {seconds:.2f} | {x_read:.2f} | "
            f"{peak / 1e6:.0f} | {x_largest:.2f} |"
        )


if __name__ == "__main__":
    main()
