"""scripts/gpu-check on a machine without a GPU: it says so and exits 0 (the proofs themselves need
a GPU; `scripts/gpu-check --dry-run-on-cpu` runs their harness on the CPU, about 2 minutes, outside
the suite)."""

from __future__ import annotations

import subprocess

import pytest
import torch
from conftest import REPO


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="this machine has a GPU: run scripts/gpu-check itself"
)
def test_gpu_check_says_it_skipped_everything_and_exits_0_without_a_gpu():
    proc = subprocess.run(
        [str(REPO / "scripts" / "gpu-check")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "no GPU here" in proc.stdout and "every GPU proof skipped" in proc.stdout
