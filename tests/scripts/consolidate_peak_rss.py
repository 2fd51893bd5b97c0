"""Peak memory of one consolidation, measured in a fresh process; prints one JSON line.

    python consolidate_peak_rss.py {ours|dcp_to_torch_save|read} CHECKPOINT_DIR OUT_DIR

`baseline` is the resident size once everything is imported, just before the work starts;
`peak` is this process image's high-water mark (VmHWM) after it; `seconds` the work's time.
`ru_maxrss` (getrusage) is reported too but not used: Linux carries it across execve, so a child
spawned by a big process starts at its parent's peak (a child of a 550 MB pytest reported 550 MB).
Mode `read` reads every shard file once in 8 MiB blocks: the I/O floor.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import psutil
import safetensors.torch  # noqa: F401  (imported up front so it is part of the baseline)
import torch  # noqa: F401
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from pipeline import consolidate


def read_shards(ckpt: Path) -> None:
    for f in sorted(ckpt.iterdir()):
        with open(f, "rb") as fh:
            while fh.read(8 << 20):
                pass


def peak_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:  # not Linux: there ru_maxrss is the process's own
        pass
    return ru_maxrss()


def ru_maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def main() -> None:
    mode, ckpt, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    baseline = psutil.Process().memory_info().rss
    start = time.perf_counter()
    if mode == "ours":
        consolidate.main(ckpt, output=out, log_to_mlflow=False)
    elif mode == "dcp_to_torch_save":
        dcp_to_torch_save(ckpt, out / "model.pt")
    elif mode == "read":
        read_shards(ckpt)
    else:
        raise SystemExit(f"unknown mode {mode}")
    seconds = time.perf_counter() - start
    print(json.dumps({"mode": mode, "baseline": baseline, "peak": peak_rss(), "ru_maxrss": ru_maxrss(),
                      "seconds": seconds}))


if __name__ == "__main__":
    main()
