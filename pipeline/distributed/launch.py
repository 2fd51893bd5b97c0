"""Launching a stage under torchrun on this machine: the command, its environment, and a launcher that
passes a SIGTERM on to torchrun (so the workers stop gracefully) and returns torchrun's exit code.
Multi-node jobs start torchrun themselves (c10d rendezvous); a stage then just runs in each worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def torchrun_command(
    module: str, nproc_per_node: int, max_restarts: int, arguments: list[str]
) -> list[str]:
    """`python -m module arguments...` under torchrun on this machine (`--standalone`: a private rendezvous)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc_per_node}",
        f"--max-restarts={max_restarts}",
        "-m",
        module,
        *arguments,
    ]


def torchrun_env() -> dict[str, str]:
    # torchrun sets OMP_NUM_THREADS=1 with a warning; each rank sets its threads itself anyway.
    return dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))


def run_torchrun(cmd: list[str]) -> int:
    """torchrun's exit code. docker stop / a scheduler's SIGTERM reaches only this launcher: it is passed on,
    so torchrun stops the workers gracefully (each closes its run) rather than losing them with us."""
    torchrun = subprocess.Popen(cmd, env=torchrun_env())
    previous = signal.signal(signal.SIGTERM, lambda *_: torchrun.send_signal(signal.SIGTERM))
    try:
        return torchrun.wait()
    except KeyboardInterrupt:  # Ctrl-C reached torchrun too (same process group): let it finish
        return torchrun.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
