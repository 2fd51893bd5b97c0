"""`pipeline ui` stops what it started: a signal to its own pid leaves no mlflow, gunicorn or uvicorn
process behind (they used to keep serving the port after the command was gone)."""

from __future__ import annotations

import os
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
    # A session of our own, so that a failing test can still clean up by group; the signal goes to the pid only.
    # Started as a shell without job control starts a background command (`pipeline ui &` in a script, nohup, a
    # CI runner): SIGINT ignored from the start, which Python keeps unless told otherwise.
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
