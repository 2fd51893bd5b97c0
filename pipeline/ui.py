"""`pipeline ui`: the MLflow UI over the same store the stages write to.

With the embedded default (a SQLite file) it starts `mlflow server` on 127.0.0.1 and, once the
server answers, prints the address to open: the runs of the experiment trained last, in MLflow's
model-training mode, with each run's primary validation metric as a column (`#/experiments/ID/runs`;
MLflow 3 opens an experiment on its GenAI traces page otherwise). With a remote tracking server the
UI is that server, so it only says where to look. MLflow's start-up chatter (its log lines, Python
warnings, the security-middleware note) is left out unless `--verbose`; its warnings and errors
pass.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

from pipeline import tracking

# MLflow keeps a page's columns in a "shared view" the UI reads from this experiment tag, named
# after the address's viewStateShareKey (its share button writes the same).
VIEW_TAG = "mlflow.sharedViewState."
# What `mlflow server` prints at every start that says nothing to act on; --verbose shows it.
CHATTER = re.compile(r"^\[MLflow\] Security middleware enabled with default settings")


def command(tracking_uri: str, host: str, port: int, verbose: bool = False) -> list[str]:
    return [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        tracking_uri,
        # The registry is the same store; said explicitly, MLflow does not say that it assumed so.
        "--registry-store-uri",
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
        *([] if verbose else ["--uvicorn-opts", "--log-level warning"]),
    ]


def server_env(verbose: bool) -> dict[str, str]:
    # MLflow's job runner serves its GenAI jobs (scorers, prompt optimisation), which nothing here
    # starts, with a pool of huey consumer processes (what it costs: docs/cli.md, `pipeline ui`).
    # A user who wants it sets the variable.
    env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **os.environ}
    if verbose:
        return env
    return dict(env, PYTHONWARNINGS="ignore", MLFLOW_LOGGING_LEVEL="WARNING")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tracking-uri", default="", help="default: $MLFLOW_TRACKING_URI, else ./mlflow.db"
    )
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default: private)")
    parser.add_argument("--port", type=int, default=5000)


def cli(args) -> int:
    uri = tracking.resolve_tracking_uri(args.tracking_uri)
    if uri.startswith(("http://", "https://")):
        print(f"the tracking store is a server already: open {remote_address(uri)} in a browser")
        return 0
    try:
        tracking.check_reachable(uri)
    except tracking.TrackingError as exc:
        print(f"pipeline ui: error: {exc}", file=sys.stderr)
        return 2
    # 0.0.0.0 binds every interface; this machine's browser reaches it on the loopback address.
    base = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
    address = runs_address(uri, base)
    print(f"pipeline ui: starting MLflow's server over {uri} (it answers in under a minute)")
    return run_until_stopped(
        command(uri, args.host, args.port, args.verbose),
        f"{base}/health",
        f"MLflow UI: open {address} (Ctrl-C to stop)",
        args.verbose,
    )


def remote_address(uri: str) -> str:
    """The runs address on a tracking server (runs_address), or the server's own where it can't be
    read."""
    import mlflow

    # Retries on a dead server would hide it for minutes, as in tracking.setup.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    try:
        return runs_address(uri, uri.rstrip("/"))
    except (mlflow.exceptions.MlflowException, OSError):
        return uri


def runs_address(tracking_uri: str, base: str) -> str:
    """The address of the runs list of the experiment with the newest run, showing the runs' primary
    validation metrics (`val/<m>` for each `best/val_<m>` the monitor logged) as columns; the UI's
    home when the store has no run. The columns are a shared view, an experiment tag, written here;
    where the store refuses the tag, the runs list has MLflow's default columns."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    newest = client.search_runs(experiments, max_results=1, order_by=["attributes.start_time DESC"])
    if not newest:
        return f"{base}/"
    experiment = newest[0].info.experiment_id
    # MLflow 3 opens in its GenAI mode (traces, judges, prompts) unless the address asks for model
    # training.
    address = f"{base}/#/experiments/{experiment}/runs?workflowType=machine_learning"
    metrics = primary_metrics(client.search_runs([experiment], max_results=100))
    if not metrics:
        return address
    state = json.dumps(
        {
            "selectedColumns": [
                "attributes.`Models`",
                "attributes.`Dataset`",
                *(f"metrics.`{m}`" for m in metrics),
            ]
        }
    )
    key = hashlib.sha256(state.encode()).hexdigest()[:32]
    try:
        client.set_experiment_tag(experiment, VIEW_TAG + key, state)
    except mlflow.exceptions.MlflowException:
        return address
    return f"{address}&viewStateShareKey={key}"


def primary_metrics(runs) -> list[str]:
    """`val/<m>` for every `best/val_<m>` the runs logged (the metric their best checkpoint was
    chosen by), the newest run's first."""
    found: list[str] = []
    for run in runs:
        for key in sorted(run.data.metrics):
            metric = re.fullmatch(r"best/val_(.+)", key)
            if metric and f"val/{metric[1]}" not in found:
                found.append(f"val/{metric[1]}")
    return found


def run_until_stopped(cmd: list[str], health: str, ready: str, verbose: bool = False) -> int:
    """Runs `mlflow server` and prints `ready` once `health` answers. `mlflow server` starts
    gunicorn or uvicorn, which start workers: stopping only the process we started left them serving
    the port. So it runs in a process group of its own, and SIGINT or SIGTERM to us stops the whole
    group (SIGKILL for what is still there after 10 s)."""
    proc = subprocess.Popen(
        cmd,
        env=server_env(verbose),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    threading.Thread(target=_pass_on, args=(proc.stdout, verbose), daemon=True).start()
    # SIGINT too, explicitly: a process started in the background by a shell without job control
    # (`cmd &` in a script, nohup, a CI runner) inherits SIGINT ignored, and Python then installs no
    # KeyboardInterrupt for it: Ctrl-C or `kill -INT` would leave the UI running (seen in a full
    # test run; alone it passed).
    previous = {
        sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        if _answers(health, proc):
            print(ready, flush=True)
        return proc.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop_group(proc)


def _pass_on(output, verbose: bool) -> None:
    """The server's output on our stderr, line by line, without its start-up chatter unless
    verbose."""
    for line in output:
        if verbose or not CHATTER.match(line):
            sys.stderr.write(line)
            sys.stderr.flush()


def _answers(health: str, proc: subprocess.Popen) -> bool:
    """Waits until `health` answers 200 (True), or the server exits first (False)."""
    import requests

    while proc.poll() is None:
        try:
            if requests.get(health, timeout=2).status_code == 200:
                return True
        except requests.RequestException:
            pass
        time.sleep(0.5)
    return False


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _stop_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM to the group, SIGKILL to whatever is left of it after `grace` seconds."""
    _signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        # reap mlflow itself: a zombie leader still counts as a member of its group
        proc.poll()
        time.sleep(0.1)
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        # the group outlives its leader: signal it even when mlflow itself is gone
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
