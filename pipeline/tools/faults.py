"""Fault injection for the crash-recovery tests (kill -9 at a chosen point of training)."""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)


def inject_fault(where: str, step: int, info=None) -> None:
    """Test hook for crash recovery: TRAINSERVE_FAULT=<where>:<step>:<rank>[:TERM] makes that rank
    die by SIGKILL (a real kill -9, nothing caught), or receive SIGTERM, at that point. It holds one
    fault per attempt, comma-separated: the first for the first attempt, the Nth for torchrun's Nth
    restart; an empty one, or none left, for none."""
    faults = os.environ.get("TRAINSERVE_FAULT", "").split(",")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    fault = faults[attempt] if attempt < len(faults) else ""
    if not fault:
        return
    f_where, f_step, f_rank, *how = fault.split(":")
    rank = info.rank if info is not None else 0
    if f_where == where and int(f_step) == step and int(f_rank) == rank:
        sig = signal.SIGTERM if how == ["TERM"] else signal.SIGKILL
        log.warning("TRAINSERVE_FAULT: %s to rank %d at %s %d", sig.name, rank, where, step)
        os.kill(os.getpid(), sig)


def record_samples(record: dict) -> None:
    """Test hook for the data-order proofs: TRAINSERVE_SAMPLE_LOG=<file> makes each rank append one
    JSON line per micro-batch it trains on (its epoch, index, rank and sample ids), so a test counts
    the ids a run, and a resume at another world size, actually trained on."""
    path = os.environ.get("TRAINSERVE_SAMPLE_LOG")
    if path:
        import json

        # one short line a write: O_APPEND keeps the ranks' lines whole
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
