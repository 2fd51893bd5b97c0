"""Peak memory of one consolidation, measured in a fresh process; prints one JSON line.

    python consolidate_peak_rss.py {ours|dcp_to_torch_save|read|floor} CHECKPOINT_DIR OUT_DIR [OUTPUT_BYTES]

`baseline` is the resident size once everything is imported, just before the work starts; `peak` is
this process image's high-water mark (VmHWM) after it; `seconds` the work's time. `ru_maxrss`
(getrusage) is reported too but not used: Linux carries it across execve, so a child spawned by a
big process starts at its parent's peak (a child of a big pytest reports the pytest's). Mode `read`
reads every shard file once in 8 MiB blocks (from the page cache, here: no hashing, no writing).
Mode `floor` is what any consolidation that verifies its input must do at least: every shard byte
read and hashed once (`sha256sum` of the checkpoint's files, the real tool) plus the output's bytes
written once (OUTPUT_BYTES, fsync'd, as consolidation fsyncs its file).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import psutil

# imported up front so it is part of the baseline
import safetensors.torch  # noqa: F401
import torch  # noqa: F401
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from pipeline import consolidate


def read_shards(ckpt: Path) -> None:
    for f in sorted(ckpt.iterdir()):
        with open(f, "rb") as fh:
            while fh.read(8 << 20):
                pass


def floor(ckpt: Path, out: Path, size: int) -> None:
    subprocess.run(
        ["sha256sum", *sorted(str(f) for f in ckpt.iterdir() if f.is_file())],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    block = bytes(8 << 20)
    with open(out / "floor.bin", "wb") as f:
        for start in range(0, size, len(block)):
            f.write(memoryview(block)[: min(len(block), size - start)])
        f.flush()
        os.fsync(f.fileno())


def peak_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    # kB
                    return int(line.split()[1]) * 1024
    except OSError:
        # not Linux: there ru_maxrss is the process's own
        pass
    return ru_maxrss()


def ru_maxrss() -> int:
    # KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


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
    elif mode == "floor":
        floor(ckpt, out, int(sys.argv[4]))
    else:
        raise SystemExit(f"unknown mode {mode}")
    seconds = time.perf_counter() - start
    print(
        json.dumps(
            {
                "mode": mode,
                "baseline": baseline,
                "peak": peak_rss(),
                "ru_maxrss": ru_maxrss(),
                "seconds": seconds,
            }
        )
    )


if __name__ == "__main__":
    main()
