"""serving/console.py, the one logging set-up of every stage and the server: progress as plain lines
off a terminal, libraries and Python warnings quiet unless --verbose. (The quick start's whole
console is held to it in test_pipeline_run.py; the server's in test_serving_messages.py.)"""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys

import pytest

from serving import console


def test_progress_off_a_terminal_is_a_plain_line_every_fifth_of_the_run(caplog):
    log = logging.getLogger("test.progress")
    with caplog.at_level(logging.INFO, logger="test.progress"):
        progress = console.Progress(66, desc="train", logger=log, stream=io.StringIO())
        for step in range(66):
            progress.update(1)
            progress.set_postfix(loss=f"{1 / (step + 1):.4f}")
        progress.close()
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(" (")[0] for line in lines] == [
        f"train: step {n}/66" for n in (14, 28, 42, 56, 66)
    ]
    assert progress.bar is None and not any("\r" in line for line in lines)


def test_progress_on_other_ranks_says_nothing(caplog):
    with caplog.at_level(logging.INFO):
        progress = console.Progress(10, enabled=False, stream=io.StringIO())
        for _ in range(10):
            progress.update(1)
    assert not caplog.records


@pytest.mark.parametrize("verbose", [False, True])
def test_libraries_and_warnings_are_quiet_unless_verbose(verbose):
    """In a fresh process, as a stage starts: onnxscript's "Evaluation failed" warnings, MLflow's
    INFO lines, Python warnings."""
    script = """
import logging, warnings, io, sys
from serving import console
console.configure()
import mlflow
said = {
    "onnxscript": logging.getLogger("onnxscript.optimizer._constant_folding").isEnabledFor(logging.WARNING),
    "mlflow": logging.getLogger("mlflow.system_metrics.system_metrics_monitor").isEnabledFor(logging.INFO),
    "mlflow_handler": bool(logging.getLogger("mlflow").handlers),
}
warnings.warn("from a library", UserWarning)
print(said)
"""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MLFLOW_CONFIGURE_LOGGING", console.VERBOSE_ENV, "PYTHONWARNINGS")
    }
    if verbose:
        env[console.VERBOSE_ENV] = "1"
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    # our own dict literal
    said = eval(out.stdout.strip().splitlines()[-1])  # noqa: S307
    assert said["onnxscript"] is verbose and said["mlflow"] is verbose, said
    # MLflow's own handler would print in its own format
    assert not said["mlflow_handler"], said
    # in our format when verbose
    assert ("UserWarning: from a library" in out.stderr) is verbose, out.stderr
    assert not out.stderr.strip() or verbose, out.stderr
