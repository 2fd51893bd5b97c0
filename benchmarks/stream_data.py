"""The stream's memory does not grow with the data set: one epoch of the sharded StreamLoader at two
data sizes, against the same data loaded map-style from memory.

Synthetic images (3x64x64 float32, 48 KiB a sample, random labels of 10 classes) are written with
`pipeline.shards.format.write_split` (default shard and row-group sizes: ~256 MiB and ~4 MiB) at
three sizes, by default ~0.5, 1 and 2 GB on disk (one at a time), under a temporary directory that
is deleted at the end. For each size, in a fresh process each (nothing of one measurement is left in
the next):

  stream     `ShardedStream(dir)` through `make_train_loader` (what `data.name=sharded` trains
             from): its `StreamLoader`, 1 rank, batch 64, 2 loader workers, one epoch.
  in memory  every row group read into one (N, 3, 64, 64) tensor first (an `ImageTensors`, as the
             built-in image data sets hold their data), then the same `make_train_loader`
             (StatefulDataLoader, DistributedSampler, 2 persistent workers), one epoch.

The loop touches nothing but the batch's size: samples/s is pure loading (worker start-up included,
as the first epoch of a run pays it). Memory is of the process tree (the measured process and its
loader workers), sampled by this driver every 50 ms with psutil while the process runs:

  peak RSS   the largest sum of the processes' resident sets. Forked workers share the parent's
             pages (the in-memory data set, torch's libraries): each counts them again, so this
             over-states a tree.
  peak PSS   the largest sum of their proportional set sizes (a page shared by k processes counts
             1/k in each): what the tree really holds; the figure to compare.
  before     the measured process's RSS just before the epoch starts (imports done; for `in memory`,
             the data loaded).
  worker USS the largest unique set (pages no other process shares) of any one loader worker.

The claim holds when doubling the data set (the last two sizes) moves the stream's peak PSS by at
most GROWTH_MB (or 5%), and that peak is a small part of the largest data set; the growth from the
smallest size is printed too (a worker's allocator keeps some of the row groups it freed, a level it
reaches within seconds: a short epoch ends before it does).

    .venv/bin/python benchmarks/stream_data.py            # 0.5, 1 and 2 GB: ~2-3 min, 2.1 GB of
                                                          disk at most
    .venv/bin/python benchmarks/stream_data.py --quick    # 0.05, 0.1 and 0.2 GB: a smoke run, ~30 s
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPE = (3, 64, 64)
# float32
SAMPLE_BYTES = 4 * SHAPE[0] * SHAPE[1] * SHAPE[2]
CLASSES = 10
BATCH = 64
# the stream's peak PSS may grow this much (or 5%) when the data set doubles
GROWTH_MB = 64
RESULT = "RESULT "


# ---- the measured process ------------------------------------------------------------------------


def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def worker_load(a) -> None:
    """One epoch of one loader over the split at a.dir; prints what it read and how fast."""
    import torch

    from pipeline.components.data import make_train_loader, set_epoch
    from pipeline.plan import BatchPlan
    from pipeline.shards.stream import ShardedStream

    torch.set_num_threads(1)
    stream = ShardedStream(a.dir)
    if a.loader == "stream":
        dataset = stream
    else:
        from pipeline.datasets.images import ImageTensors
        from pipeline.shards import format as shard_format

        manifest = stream.manifest
        # filled in place: the data set, held once
        x = torch.empty(manifest.rows, *SHAPE)
        y = torch.empty(manifest.rows, dtype=torch.int64)
        reader = shard_format.ShardReader(manifest)
        at = 0
        for s, shard in enumerate(manifest.shards):
            for g in range(len(shard.row_groups)):
                group = reader.read_group(s, g)
                n = len(group["id"])
                x[at : at + n], y[at : at + n] = (
                    torch.from_numpy(group["input"]),
                    torch.from_numpy(group["target"]),
                )
                at += n
                del group
        reader.close()
        dataset = ImageTensors(x, y, list(stream.classes))
    loader = make_train_loader(
        dataset, BatchPlan(rows=BATCH), 0, seed=0, num_workers=a.workers, pin_memory=False
    )
    set_epoch(loader, 0)
    before = rss_mb()
    samples = batches = 0
    t0 = time.perf_counter()
    for inputs, target in loader:
        samples += len(target)
        batches += 1
    seconds = time.perf_counter() - t0
    print(
        RESULT
        + json.dumps(
            {"samples": samples, "batches": batches, "seconds": seconds, "before_mb": before}
        ),
        flush=True,
    )


# ---- the driver ----------------------------------------------------------------------------------


class TreeSampler(threading.Thread):
    """The largest summed RSS and PSS of a process and its descendants, sampled every `interval`
    s."""

    def __init__(self, pid: int, interval: float = 0.05):
        super().__init__(daemon=True)
        import psutil

        self.root = psutil.Process(pid)
        self.interval = interval
        self.peak_rss = self.peak_pss = self.peak_worker_uss = 0
        self.peak_procs = 0
        self.stop = threading.Event()

    def run(self) -> None:
        import psutil

        while not self.stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                return
            rss = pss = 0
            for p in procs:
                try:
                    full = p.memory_full_info()
                except psutil.Error:
                    continue
                rss += full.rss
                pss += full.pss
                if p.pid != self.root.pid:
                    self.peak_worker_uss = max(self.peak_worker_uss, full.uss)
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            self.peak_procs = max(self.peak_procs, len(procs))
            self.stop.wait(self.interval)


def measure(directory: Path, loader: str, workers: int) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--dir",
        str(directory),
        "--loader",
        loader,
        "--workers",
        str(workers),
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
    )
    sampler = TreeSampler(proc.pid)
    sampler.start()
    out, err = proc.communicate()
    sampler.stop.set()
    sampler.join()
    lines = [line for line in out.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(
            f"worker failed ({proc.returncode}): {' '.join(cmd)}\n{out[-2000:]}\n{err[-4000:]}"
        )
    res = json.loads(lines[-1][len(RESULT) :])
    return {
        **res,
        "peak_rss_mb": sampler.peak_rss / 2**20,
        "peak_pss_mb": sampler.peak_pss / 2**20,
        "worker_uss_mb": sampler.peak_worker_uss / 2**20,
        "procs": sampler.peak_procs,
        "samples_per_s": res["samples"] / res["seconds"],
    }


def write(directory: Path, gb: float) -> dict:
    """~gb GB of random 3x64x64 images as a sharded split; its manifest's rows, shards, row groups
    and bytes."""
    import torch

    from pipeline.shards.format import write_split

    rows = max(BATCH * 2, round(gb * 1e9 / SAMPLE_BYTES))
    g = torch.Generator().manual_seed(0)

    def samples():
        chunk = 256
        for start in range(0, rows, chunk):
            n = min(chunk, rows - start)
            x = torch.rand(n, *SHAPE, generator=g)
            y = torch.randint(0, CLASSES, (n,), generator=g)
            for i in range(n):
                yield start + i, x[i], y[i]

    t0 = time.perf_counter()
    manifest = write_split(samples(), str(directory), classes=[str(c) for c in range(CLASSES)])
    return {
        "rows": manifest.rows,
        "shards": len(manifest.shards),
        "groups": sum(len(s.row_groups) for s in manifest.shards),
        "bytes": sum(s.bytes for s in manifest.shards),
        "seconds": time.perf_counter() - t0,
    }


def load_now() -> str:
    return "/".join(f"{v:.2f}" for v in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: 0.05, 0.1 and 0.2 GB")
    parser.add_argument(
        "--gb",
        help="data sizes in GB on disk, comma-separated, ascending "
        "(default 0.5,1,2; --quick 0.05,0.1,0.2)",
    )
    parser.add_argument(
        "--memory-at",
        default="all",
        choices=["all", "smallest", "none"],
        help="the sizes the in-memory loader is measured at (its RSS holds the whole data set)",
    )
    parser.add_argument("--workers", type=int, default=2, help="loader worker processes")
    parser.add_argument(
        "--tmp", help="where the temporary shards go (default: the system's temporary directory)"
    )
    # internal: the measured process
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--loader", choices=["stream", "memory"], help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.worker:
        worker_load(a)
        return

    sizes = [float(s) for s in (a.gb or ("0.05,0.1,0.2" if a.quick else "0.5,1,2")).split(",")]
    # one size on disk at a time
    need = max(sizes) * 1e9 * 1.05
    tmp_parent = a.tmp or tempfile.gettempdir()
    free = shutil.disk_usage(tmp_parent).free
    if free < need + 2e9:
        raise SystemExit(
            f"{tmp_parent} has {free / 1e9:.1f} GB free; the shards need {need / 1e9:.1f} GB (+2 GB spare)"
        )
    print(
        f"{os.cpu_count()} CPUs; samples 3x64x64 float32 ({SAMPLE_BYTES // 1024} KiB), batch {BATCH}, 1 rank, "
        f"{a.workers} loader workers; load average at start {load_now()}"
        + (" (--quick)" if a.quick else "")
    )
    rows = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="stream-data-", dir=tmp_parent) as tmp:
        for i, gb in enumerate(sizes):
            directory = Path(tmp) / f"split-{i}"
            info = write(directory, gb)
            print(
                f"wrote {info['bytes'] / 1e9:.2f} GB: {info['rows']} samples, {info['shards']} shards, "
                f"{info['groups']} row groups, in {info['seconds']:.0f} s"
            )
            loaders = ["stream"]
            if a.memory_at == "all" or (a.memory_at == "smallest" and i == 0):
                loaders.append("memory")
            for loader in loaders:
                l0 = load_now()
                res = measure(directory, loader, a.workers)
                rows.append(
                    {
                        "gb": info["bytes"] / 1e9,
                        "rows": info["rows"],
                        "loader": loader,
                        **res,
                        "load": f"{l0} -> {load_now()}",
                    }
                )
            # one size on disk at a time
            shutil.rmtree(directory)
    print(
        f"\n## one epoch, batch {BATCH}, {a.workers} workers   [total {time.perf_counter() - started:.0f} s, "
        f"load average at end {load_now()}]"
    )
    print(
        f"{'data GB':>8} {'samples':>8} {'loader':<10} {'before MB':>10} {'peak RSS MB':>12} {'peak PSS MB':>12} "
        f"{'worker USS MB':>13} {'samples/s':>10} {'procs':>6}  load"
    )
    for r in rows:
        print(
            f"{r['gb']:>8.2f} {r['rows']:>8} {('in memory' if r['loader'] == 'memory' else 'stream'):<10} "
            f"{r['before_mb']:>10.0f} {r['peak_rss_mb']:>12.0f} {r['peak_pss_mb']:>12.0f} "
            f"{r['worker_uss_mb']:>13.0f} {r['samples_per_s']:>10.0f} {r['procs']:>6}  {r['load']}"
        )
    bad = [r for r in rows if r["samples"] != r["rows"] // BATCH * BATCH]
    for r in bad:
        print(
            f"!! {r['loader']} at {r['gb']:.2f} GB read {r['samples']} samples, expected {r['rows'] // BATCH * BATCH}"
        )
    stream = [r for r in rows if r["loader"] == "stream"]
    if len(stream) >= 2:
        small, prev, large = stream[0], stream[-2], stream[-1]
        growth = large["peak_pss_mb"] - prev["peak_pss_mb"]
        allowed = max(GROWTH_MB, 0.05 * prev["peak_pss_mb"])
        ok = growth <= allowed
        print()
        for a_, b_ in zip(stream, stream[1:]):
            print(
                f"stream: data x{b_['gb'] / a_['gb']:.1f} ({a_['gb']:.2f} -> {b_['gb']:.2f} GB): peak PSS "
                f"{a_['peak_pss_mb']:.0f} -> {b_['peak_pss_mb']:.0f} MB ({b_['peak_pss_mb'] - a_['peak_pss_mb']:+.0f} MB)"
            )
        print(
            f"stream: the last doubling x{large['gb'] / prev['gb']:.1f} moved its peak PSS {growth:+.0f} MB (allowed "
            f"{allowed:.0f}); from the smallest size x{large['gb'] / small['gb']:.1f}: "
            f"{large['peak_pss_mb'] - small['peak_pss_mb']:+.0f} MB; the largest data set is "
            f"{large['gb'] * 1e9 / 2**20 / large['peak_pss_mb']:.1f}x the tree's peak: "
            + ("holds" if ok and not bad else "DOES NOT HOLD")
        )
        memory = [r for r in rows if r["loader"] == "memory"]
        if len(memory) >= 2:
            print(
                f"in memory: peak PSS {memory[0]['peak_pss_mb']:.0f} -> {memory[-1]['peak_pss_mb']:.0f} MB "
                f"({memory[-1]['peak_pss_mb'] - memory[0]['peak_pss_mb']:+.0f} MB)"
            )
    for r in rows:
        if r["loader"] == "memory":
            s = next(x for x in stream if x["rows"] == r["rows"])
            print(
                f"at {r['gb']:.2f} GB: stream / in memory samples/s {s['samples_per_s'] / r['samples_per_s']:.2f}, "
                f"peak PSS {s['peak_pss_mb'] / r['peak_pss_mb']:.2f}x"
            )


if __name__ == "__main__":
    main()
