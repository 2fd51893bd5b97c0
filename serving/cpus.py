"""How many CPUs this process may use: its affinity (cgroup cpusets included), at most its cgroups'
CPU quota rounded up (a container's CPU limit: threads past it are throttled, not run). What sizes
onnxruntime's threads, the HTTP event loops, the front-end processes and training's threads per
rank; read at start and at a model's load, never per request. Imports nothing heavy: the training
ranks use it too."""

from __future__ import annotations

import os
from pathlib import Path

CGROUP_ROOT = "/sys/fs/cgroup"
OWN_CGROUPS = "/proc/self/cgroup"


def usable_cpus() -> int:
    """CPUs this process may run on, at most its quota (rounded up), not the host's count."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        # not on Linux
        return os.cpu_count() or 1
    quota = cpu_quota()
    return cpus if quota is None else max(1, min(cpus, -(-quota[0] // quota[1])))


def cpu_quota(root: str = CGROUP_ROOT, own: str = OWN_CGROUPS) -> tuple[int, int] | None:
    """The tightest CPU quota of this process's cgroups and their parents, as (quota, period) in
    microseconds (cgroup v2's cpu.max, v1's cpu.cfs_quota_us and cpu.cfs_period_us); None where
    none is set or none can be read. A cgroup namespace (a container's) shows its own root: the
    walk up to the mount's root reads the container's limit either way."""
    try:
        lines = Path(own).read_text().splitlines()
    except OSError:
        return None
    tightest = None
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":
            # v2: "quota period", or "max period" for none
            places = [(os.path.join(root, "unified"), "cpu.max"), (root, "cpu.max")]
        elif "cpu" in controllers.split(","):
            places = [(os.path.join(root, controllers), "cpu.cfs_quota_us")]
            places += [(os.path.join(root, "cpu"), "cpu.cfs_quota_us")]
        else:
            continue
        for base, name in places:
            for quota in _quotas(base, path, name):
                if tightest is None or quota[0] * tightest[1] < tightest[0] * quota[1]:
                    tightest = quota
    return tightest


def _quotas(base: str, path: str, name: str):
    """Each quota set on `path` and its parents under `base` (a cgroup mount): (quota, period)."""
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        directory = os.path.join(base, *parts[:depth])
        try:
            if name == "cpu.max":
                quota, period = Path(directory, name).read_text().split()
            else:
                quota = Path(directory, name).read_text().strip()
                period = Path(directory, "cpu.cfs_period_us").read_text().strip()
            if quota not in ("max", "-1") and int(quota) > 0 and int(period) > 0:
                yield int(quota), int(period)
        except (OSError, ValueError):
            continue
