"""An S3-compatible object store for tests: moto's standalone server (`moto_server`) as a real
process.

    with moto_s3(host="127.0.0.1") as store:      # or the `object_store` fixture
        env = {**os.environ, **store.env}           # AWS_ENDPOINT_URL, keys, region, MLFLOW_S3_ENDPOINT_URL
        ... train.output_dir=f"{store.url}/run" ...  # s3://<bucket>/run

The server binds to `host` (loopback by default; a network-namespace bridge address works the same,
so processes in other namespaces reach it at `store.endpoint`), on a free port of that address. The
bucket is created before the store is handed out. Credentials are moto's dummies, passed only
through the standard variables the code under test reads (nothing of our own). The process is
stopped by its PID on exit, whatever happened in between.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

MOTO_SERVER = Path(sys.executable).with_name("moto_server")


@dataclass(frozen=True)
class ObjectStore:
    # http://host:port, what AWS_ENDPOINT_URL is set to
    endpoint: str
    bucket: str
    # the standard variables a client process needs to reach the store
    env: dict[str, str]

    @property
    def url(self) -> str:
        """The bucket as an fsspec/s3fs URL: s3://<bucket>."""
        return f"s3://{self.bucket}"

    def client(self):
        """A boto3 S3 client on this store (to look at what the code under test wrote)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=self.env["AWS_DEFAULT_REGION"],
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
        )

    def keys(self, prefix: str = "") -> list[str]:
        """Every object key under `prefix`, sorted."""
        pages = (
            self.client()
            .get_paginator("list_objects_v2")
            .paginate(Bucket=self.bucket, Prefix=prefix)
        )
        return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def store_env(endpoint: str) -> dict[str, str]:
    """The standard variables for boto3/s3fs/MLflow to reach `endpoint` with moto's dummy keys."""
    host = endpoint.split("//", 1)[1].rsplit(":", 1)[0]
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "MLFLOW_S3_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        # A proxy set in the environment must not swallow requests to a loopback/bridge address.
        "NO_PROXY": ",".join(filter(None, [os.environ.get("NO_PROXY", ""), host])),
        "no_proxy": ",".join(filter(None, [os.environ.get("no_proxy", ""), host])),
    }


def _wait_until_answering(
    proc: subprocess.Popen, host: str, port: int, timeout: float, log: Path
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"moto_server exited with {proc.returncode} before answering:\n{log.read_text()}"
            )
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(
        f"moto_server not answering on {host}:{port} after {timeout} s:\n{log.read_text()}"
    )


@contextlib.contextmanager
def moto_s3(
    host: str = "127.0.0.1",
    bucket: str = "trainserve",
    log_dir: Path | None = None,
    start_timeout: float = 60.0,
):
    """Start `moto_server` bound to `host` on a free port, create `bucket`, yield an ObjectStore;
    stop it."""
    if not MOTO_SERVER.exists() and shutil.which("moto_server") is None:
        raise RuntimeError(
            "moto_server not found: install the dev extra (pip install -e '.[dev]', it brings moto[server])"
        )
    executable = str(MOTO_SERVER) if MOTO_SERVER.exists() else shutil.which("moto_server")
    port = free_port(host)
    endpoint = f"http://{host}:{port}"
    owned_log_dir = None
    if log_dir is None:
        import tempfile

        owned_log_dir = tempfile.mkdtemp(prefix="moto-")
        log_dir = Path(owned_log_dir)
    log = Path(log_dir) / f"moto_server-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [executable, "-H", host, "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_until_answering(proc, host, port, start_timeout, log)
        store = ObjectStore(endpoint=endpoint, bucket=bucket, env=store_env(endpoint))
        store.client().create_bucket(Bucket=bucket)
        yield store
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if owned_log_dir:
            shutil.rmtree(owned_log_dir, ignore_errors=True)


@pytest.fixture
def object_store(tmp_path):
    """A fresh moto_server on loopback with one bucket, for one test (import this name into a test
    module)."""
    with moto_s3(host="127.0.0.1", log_dir=tmp_path) as store:
        yield store


class FaultProxy:
    """A forwarding HTTP proxy in front of a store that, once armed, lets the next PUT of an object
    whose key ends in `suffix` reach the store and then answers the client 500 InternalError, as S3
    may after a write it did apply (botocore then retries it). With `deny`, it answers 403
    AccessDenied to every request for a key ending in `deny` and passes the rest through (a policy
    that lets a reader list a prefix but not read its objects). A thread of this process; `endpoint`
    is where clients point instead.

        with FaultProxy(store.endpoint) as proxy: ... proxy.arm() ... proxy.faults"""

    def __init__(self, upstream: str, suffix: str = ".owner", deny: str | None = None):
        import http.client
        import http.server
        import socketserver
        import threading
        from urllib.parse import urlsplit

        target = urlsplit(upstream)
        proxy = self
        self.armed, self.faults, self.suffix, self.deny = False, 0, suffix, deny

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def answer(self, status: int, code: str, message: str) -> None:
                error = f"<Error><Code>{code}</Code><Message>{message}</Message></Error>".encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(error)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(error)

            def forward(self):
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                if proxy.deny and self.path.split("?")[0].endswith(proxy.deny):
                    self.answer(403, "AccessDenied", "Access Denied")
                    return
                upstream_conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
                upstream_conn.request(
                    self.command, self.path, body=body, headers=dict(self.headers.items())
                )
                answer = upstream_conn.getresponse()
                data = answer.read()
                if (
                    self.command == "PUT"
                    and self.path.split("?")[0].endswith(proxy.suffix)
                    and proxy.armed
                ):
                    proxy.armed, proxy.faults = False, proxy.faults + 1
                    self.answer(500, "InternalError", "injected")
                    return
                self.send_response(answer.status)
                # a HEAD's Content-Length is the object's size: kept
                for (
                    key,
                    value,
                ) in answer.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header(
                    "Content-Length",
                    answer.getheader("content-length", "0")
                    if self.command == "HEAD"
                    else str(len(data)),
                )
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = forward

        class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def arm(self) -> None:
        self.armed = True

    def __enter__(self) -> "FaultProxy":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
