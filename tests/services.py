"""The services a remote setup runs, each a real process started by a test: PostgreSQL (Debian's
postgresql-15), an S3-compatible store (moto_server, from tests/object_store.py) and `mlflow server` with
its metadata in PostgreSQL and its artifacts in S3.

    with postgres() as backend, moto_s3(host=address) as store, \\
            mlflow_server(backend, f"{store.url}/mlflow", host=address, env=store.env) as uri:
        ...  # MLFLOW_TRACKING_URI=uri from any host that reaches `address`

The fixture `postgres` (import the name into a test module) is the database alone, on loopback.
Each service is stopped by its PID when its block ends, whatever happened in between.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from object_store import free_port

POSTGRES_BIN = Path("/usr/lib/postgresql/15/bin")


def as_postgres(cmd: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root; CI runs as root, developers usually don't."""
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


@contextlib.contextmanager
def postgres():
    """A throwaway PostgreSQL server on 127.0.0.1 with a database `mlflow`; yields its SQLAlchemy
    URI. Skips the test where the server binaries are missing."""
    if not (POSTGRES_BIN / "initdb").exists():
        pytest.skip(
            f"PostgreSQL server binaries not found in {POSTGRES_BIN} (apt-get install postgresql-15)"
        )
    # Not under tmp_path: pytest's base directory is private to its user, and the server runs as
    # postgres.
    data = Path(tempfile.mkdtemp(prefix="trainserve-pg-"))
    if os.geteuid() == 0:
        shutil.chown(data, "postgres")
    port = free_port("127.0.0.1")
    subprocess.run(
        as_postgres(
            [str(POSTGRES_BIN / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust"]
        ),
        check=True,
        capture_output=True,
        timeout=120,
    )
    subprocess.run(
        as_postgres(
            [
                str(POSTGRES_BIN / "pg_ctl"),
                "-D",
                str(data),
                "-w",
                "-l",
                str(data / "log"),
                "-o",
                f"-p {port} -k {data} -h 127.0.0.1",
                "start",
            ]
        ),
        check=True,
        capture_output=True,
        timeout=120,
    )
    try:
        subprocess.run(
            as_postgres(
                [
                    str(POSTGRES_BIN / "createdb"),
                    "-h",
                    "127.0.0.1",
                    "-p",
                    str(port),
                    "-U",
                    "postgres",
                    "mlflow",
                ]
            ),
            check=True,
            capture_output=True,
            timeout=60,
        )
        yield f"postgresql://postgres@127.0.0.1:{port}/mlflow"
    finally:
        subprocess.run(
            as_postgres([str(POSTGRES_BIN / "pg_ctl"), "-D", str(data), "-m", "fast", "stop"]),
            capture_output=True,
            timeout=120,
        )
        shutil.rmtree(data, ignore_errors=True)


@contextlib.contextmanager
def mlflow_server(
    backend_store: str,
    artifacts_destination: str,
    host: str = "127.0.0.1",
    env: dict[str, str] | None = None,
    workdir: Path | None = None,
    start_timeout: float = 120,
):
    """`mlflow server` on `host` (a free port), metadata in `backend_store`, artifacts proxied to
    `artifacts_destination` (a folder or s3://bucket/prefix; for S3 `env` carries
    MLFLOW_S3_ENDPOINT_URL and the AWS_* keys, read by the server only: clients go through the
    server). Yields the tracking URI."""
    import requests

    port = free_port(host)
    workdir = Path(workdir or tempfile.mkdtemp(prefix="trainserve-mlflow-"))
    log = workdir / f"mlflow-server-{port}.log"
    # No server-side job runner: it starts a handful of huey consumers that nothing here uses, on 2
    # shared cores.
    server_env = {
        **os.environ,
        **(env or {}),
        "PYTHONUNBUFFERED": "1",
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    }
    server_env.pop("MLFLOW_TRACKING_URI", None)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlflow",
                "server",
                "--backend-store-uri",
                backend_store,
                "--artifacts-destination",
                artifacts_destination,
                "--host",
                host,
                "--port",
                str(port),
                "--workers",
                "1",
            ],
            cwd=workdir,
            env=server_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    uri = f"http://{host}:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            try:
                if requests.get(f"{uri}/health", timeout=1, proxies={"http": None}).ok:
                    break
            except requests.RequestException:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"mlflow server on {uri} did not start (exit {proc.poll()}):\n"
                    f"{log.read_text()[-4000:]}"
                )
            time.sleep(0.5)
        yield uri
    finally:
        # The server's workers (uvicorn/gunicorn) are in its session: stop them all.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(name="postgres")
def postgres_fixture():
    with postgres() as uri:
        yield uri
