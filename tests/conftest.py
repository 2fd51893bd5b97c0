"""Shared test helpers: a throwaway MLflow store, and running the real CLI in a subprocess.

Every subprocess a test starts runs in its own temporary directory, so the embedded default
store (./mlflow.db, ./mlartifacts) and ./outputs land there and are removed with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "tests" / "configs" / "tiny.yaml"


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("MLFLOW_TRACKING_URI", None)
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    env.update(extra or {})
    return env


def run_cli(args: list[str], cwd: Path, timeout: float = 300, env: dict[str, str] | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
    """`pipeline <args>` as a user types it, in `cwd`."""
    proc = run_killing_group([sys.executable, "-m", "pipeline", *args], cwd=cwd, env=cli_env(env), timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"pipeline {' '.join(args)} exited {proc.returncode}\n"
                             f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}")
    return proc


def run_killing_group(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run, but a timeout kills torchrun's workers too, not only the launcher."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} timed out after {timeout}s\n--- stderr\n{err[-6000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """An empty directory to run the CLI in; its mlflow.db is the embedded default store."""
    return tmp_path


def mlflow_client(workdir: Path):
    import mlflow

    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    return mlflow.MlflowClient(uri)


def only_run(workdir: Path, experiment: str):
    client = mlflow_client(workdir)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return client, runs[0]
