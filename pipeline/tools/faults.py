"""Fault injection for the crash-recovery tests (kill -9 at a chosen point of training)."""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)


def inject_fault(where: str, step: int, info) -> None:
    """Test hook for crash recovery: TRAINSERVE_FAULT=<where>:<step>:<rank> makes that rank die by
    SIGKILL (a real kill -9, nothing caught) at that point, on the first attempt only."""
    fault = os.environ.get("TRAINSERVE_FAULT", "")
    if not fault or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    f_where, f_step, f_rank = fault.split(":")
    if f_where == where and int(f_step) == step and int(f_rank) == info.rank:
        log.warning("TRAINSERVE_FAULT: killing rank %d at %s %d", info.rank, where, step)
        os.kill(os.getpid(), signal.SIGKILL)
