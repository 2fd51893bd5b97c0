"""`pipeline ui`: the MLflow UI over the same store the stages write to.

With the embedded default (a SQLite file) it starts `mlflow server` on 127.0.0.1; with a remote
tracking server the UI is that server, so it only says where to look.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from pipeline.components import tracking


def command(tracking_uri: str, host: str, port: int) -> list[str]:
    return [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", tracking_uri,
            # New experiments created from the UI keep their artifacts beside the database too.
            "--default-artifact-root", tracking.default_artifact_root(tracking_uri),
            "--host", host, "--port", str(port), "--workers", "1"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tracking-uri", default="", help="default: $MLFLOW_TRACKING_URI, else ./mlflow.db")
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
    try:
        return subprocess.run(command(uri, args.host, args.port), env=dict(os.environ)).returncode
    except KeyboardInterrupt:
        return 0
