"""`pipeline ui` stops what it started: a signal to its own pid leaves no mlflow, gunicorn or
uvicorn process behind (they used to keep serving the port after the command was gone)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
import requests
from conftest import cli_env
from serving_fixtures import free_port


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_pipeline_ui_stops_every_process_it_started(sig, tmp_path):
    port = free_port()
    # A session of our own, so that a failing test can still clean up by group; the signal goes to
    # the pid only. Started as a shell without job control starts a background command
    # (`pipeline ui &` in a script, nohup, a CI runner): SIGINT ignored from the start, which Python
    # keeps unless told otherwise.
    ui = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "ui", "--port", str(port)],
        cwd=tmp_path,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    started: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert ui.poll() is None, f"pipeline ui exited {ui.returncode}"
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                time.sleep(0.5)
        else:
            raise AssertionError("the MLflow UI did not answer")
        started = psutil.Process(ui.pid).children(recursive=True)
        assert started, "pipeline ui started no process"
        # The server and its web worker, without MLflow's job runner (its huey consumers).
        assert not [p.cmdline() for p in started if "huey" in " ".join(p.cmdline())]
        os.kill(ui.pid, sig)
        assert ui.wait(timeout=30) == 0
        gone, alive = psutil.wait_procs(started, timeout=5)
        assert not alive, [(p.pid, p.name()) for p in alive]
        with pytest.raises(requests.ConnectionError):
            requests.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        for process in [*started, psutil.Process(ui.pid)] if ui.poll() is None else started:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass


TRAINED = """
import mlflow
from pipeline import tracking
from pipeline.config import TrackingConfig

tracking.setup(TrackingConfig(experiment="photos"))
with mlflow.start_run(run_name="photos-resnet18-run"):
    for step, accuracy in ((10, 0.61), (20, 0.934)):
        mlflow.log_metrics({"val/accuracy": accuracy, "train/loss": 1 - accuracy}, step=step)
    mlflow.log_metrics({"best/val_accuracy": 0.934, "best/step": 20}, step=20)
"""


@pytest.mark.slow
def test_pipeline_ui_prints_once_it_answers_an_address_that_lists_the_training_runs(tmp_path):
    """The address `pipeline ui` prints opens the training runs of the experiment trained last, with
    the metric its best checkpoint was chosen by as a column, in MLflow's model-training mode: not
    MLflow 3's GenAI traces page, and not its home page. MLflow's start-up chatter stays out of the
    terminal."""
    import browser

    # (skips here, not half-way, where it can't be installed)
    browser.chromium()
    subprocess.run(
        [sys.executable, "-c", TRAINED], cwd=tmp_path, env=cli_env(), check=True, timeout=120
    )
    with browser.mlflow_ui(tmp_path):
        address = browser.printed_address(tmp_path)
        text, _ = browser.page(address, "mlflow-ui-address")
    assert "/#/experiments/1/runs?" in address and "workflowType=machine_learning" in address
    assert "photos-resnet18-run" in text and re.search(r"\bval/accuracy\b.*\b0\.934\b", text), text
    assert "Model training" in text and not re.search(
        r"No data available|Detect Issues|Training runs", text
    ), text[:3000]
    said = (tmp_path / "ui.log").read_text()
    assert not re.search(r"Registry store URI|Security middleware|Warning|INFO", said), said
    # starting, then the address
    assert len(said.splitlines()) == 2, said
