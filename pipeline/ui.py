"""`pipeline ui`: the MLflow UI over the same store the stages write to.

With the embedded default (a SQLite file) it starts `mlflow server` on 127.0.0.1; with a remote
tracking server the UI is that server, so it only says where to look.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from pipeline import tracking


def command(tracking_uri: str, host: str, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        tracking_uri,
        # New experiments created from the UI keep their artifacts beside the database too.
        "--default-artifact-root",
        tracking.default_artifact_root(tracking_uri),
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        "1",
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tracking-uri", default="", help="default: $MLFLOW_TRACKING_URI, else ./mlflow.db"
    )
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default: private)")
    parser.add_argument("--port", type=int, default=5000)


def cli(args) -> int:
    uri = tracking.resolve_tracking_uri(args.tracking_uri)
    if uri.startswith(("http://", "https://")):
        print(f"the tracking store is a server already: open {uri} in a browser")
        return 0
    try:
        tracking.check_reachable(uri)
    except tracking.TrackingError as exc:
        print(f"pipeline ui: error: {exc}", file=sys.stderr)
        return 2
    print(f"MLflow UI on http://{args.host}:{args.port} over {uri} (Ctrl-C to stop)", flush=True)
    return run_until_stopped(command(uri, args.host, args.port))


def run_until_stopped(cmd: list[str]) -> int:
    """`mlflow server` starts gunicorn or uvicorn, which start workers: stopping only the process we started
    left them serving the port. So it runs in a process group of its own, and SIGINT or SIGTERM to us stops
    the whole group (SIGKILL for what is still there after 10 s)."""
    proc = subprocess.Popen(cmd, env=dict(os.environ), start_new_session=True)
    # SIGINT too, explicitly: a process started in the background by a shell without job control (`cmd &` in a
    # script, nohup, a CI runner) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt for it:
    # Ctrl-C or `kill -INT` would leave the UI running (seen in a full test run; alone it passed).
    previous = {
        sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        return proc.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop_group(proc)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _stop_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM to the group, SIGKILL to whatever is left of it after `grace` seconds."""
    _signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        proc.poll()  # reap mlflow itself: a zombie leader still counts as a member of its group
        time.sleep(0.1)
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(
            pgid, sig
        )  # the group outlives its leader: signal it even when mlflow itself is gone
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
