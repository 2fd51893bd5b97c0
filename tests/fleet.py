"""A fleet of real server replicas following one registry alias, the load that runs against them
while the alias moves, and nginx in front of them: shared by tests/test_rollout.py and
benchmarks/rollout.py.

    registered_versions(directory, count)   a real MLflow store (SQLite + local artifacts, or a
                                            tracking server) with `count` versions of a tiny model
                                            'digits', each recording its file's sha256 as
                                            `pipeline export` does (replicas check it); @champion ->
                                            1
    tracking_server(directory, address)     `mlflow server` (SQLite, proxied artifacts) for replicas
                                            on hosts
    replicas(n, tracking_uri, directory)    n `python -m serving` processes following models:/digits@champion,
                                            each in its own working directory with its own download directory
                                            (TMPDIR), on loopback ports or on namespace hosts (tests/hosts.py,
                                            each its own address); started at once, killed by PID
    Load                                    client threads in a closed loop (HTTP, and gRPC for a
                                            target that is one): every answer's status, receipt
                                            version and latency
    ReadyWatch                              polls each replica's /v2/health/ready and its model's
                                            ready endpoint
    nginx(upstreams, directory)             nginx (Debian package) as the balancer: its own config,
                                            prefix, pid and log paths, in the foreground on a
                                            loopback port; killed by PID
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import requests
from serving_fixtures import ServerProcess, free_port, tiny_model

from serving import lineage

MODEL = "digits"
ALIAS = f"models:/{MODEL}@champion"
# what `pipeline export` records of model.onnx (serving/loader.py checks it): sha256_record
SHA_TAG = lineage.SHA256


def sha256_record(digest: str) -> str:
    """A version's SHA256 tag naming model.onnx's digest, as export writes it."""
    return json.dumps({"model.onnx": digest})


def registered_versions(directory: Path, count: int, tracking_uri: str | None = None) -> str:
    """`count` versions of 'digits' (different weights) in a real MLflow store: `tracking_uri` (a
    tracking server), else a SQLite file and local artifacts under `directory`; returns the tracking
    URI. Each version records the sha256 of its stored model.onnx, as the export does."""
    import mlflow
    import onnx

    uri = tracking_uri or f"sqlite:///{directory / 'mlflow.db'}"
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        client = mlflow.MlflowClient(uri)
        # A tracking server stores artifacts where it serves them from; a SQLite store beside its
        # file.
        artifacts = None if tracking_uri else (directory / "artifacts").as_uri()
        experiment = mlflow.create_experiment("rollout", artifact_location=artifacts)
        for i in range(1, count + 1):
            path = tiny_model(directory / f"v{i}.onnx", seed=i, name="tiny")
            with mlflow.start_run(experiment_id=experiment):
                info = mlflow.onnx.log_model(
                    onnx.load(str(path)),
                    name="model",
                    registered_model_name=MODEL,
                    pip_requirements=["onnxruntime"],
                )
            version = str(info.registered_model_version)
            stored = mlflow.artifacts.download_artifacts(
                f"models:/{MODEL}/{version}", dst_path=str(directory / f"stored-v{version}")
            )
            client.set_model_version_tag(
                MODEL, version, SHA_TAG, sha256_record(sha256(Path(stored) / "model.onnx"))
            )
        client.set_registered_model_alias(MODEL, "champion", "1")
    finally:
        mlflow.set_tracking_uri(previous)
    return uri


@contextlib.contextmanager
def tracking_server(directory: Path, address: str = "127.0.0.1"):
    """`mlflow server` on `address` (SQLite metadata and proxied artifacts under `directory`):
    replicas on other hosts reach the registry and the files over HTTP only. Yields its URL; stopped
    by PID."""
    port = free_port()
    url = f"http://{address}:{port}"
    directory.mkdir(parents=True, exist_ok=True)
    log = open(directory / "mlflow-server.log", "wb")
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "mlflow"),
            "server",
            "--host",
            address,
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{directory / 'mlflow.db'}",
            "--artifacts-destination",
            str(directory / "artifacts"),
            "--allowed-hosts",
            f"{address}:{port},{address}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"mlflow server exited with {proc.returncode}:\n"
                    f"{(directory / 'mlflow-server.log').read_text()[-3000:]}"
                )
            # refused, or slow while it creates its tables
            with contextlib.suppress(requests.RequestException):
                if requests.get(url + "/health", timeout=5).ok:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("mlflow server not up within 120 s")
            time.sleep(0.2)
        yield url
    finally:
        if proc.poll() is None:
            # its uvicorn workers too
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        log.close()


def stored_onnx(client, version: str) -> Path:
    """The model.onnx a registered version's files hold in the local artifact store."""
    model_id = client.get_model_version(MODEL, version).source.removeprefix("models:/")
    return (
        Path(client.get_logged_model(model_id).artifact_location.removeprefix("file://"))
        / "model.onnx"
    )


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def move_alias(tracking_uri: str, version: str) -> float:
    """Point @champion at `version`; returns the monotonic time the registry took the move."""
    import mlflow

    mlflow.MlflowClient(tracking_uri).set_registered_model_alias(MODEL, "champion", version)
    return time.monotonic()


@contextlib.contextmanager
def replicas(
    n: int,
    tracking_uri: str,
    directory: Path,
    *,
    reload_interval: float = 2.0,
    grpc_first: bool = False,
    extra: tuple[str, ...] = (),
    hosts: list | None = None,
):
    """`n` replicas following @champion, ready. On loopback each runs in directory/replica-<i>/ (its
    working directory, its download directory, its log); given `hosts` (tests/hosts.py, network
    namespaces), replica i runs on hosts[i], bound to its address, in its working directory. With
    `grpc_first` the first also listens for gRPC (`.grpc` is address:port)."""
    fleet = []
    for i in range(n):
        host = hosts[i] if hosts else None
        home = host.workdir if host else directory / f"replica-{i}"
        (home / "tmp").mkdir(parents=True, exist_ok=True)
        address = host.address if host else "127.0.0.1"
        # A private bridge: the address is not loopback, so the server asks for a token unless told
        # not to.
        args = [
            "--model",
            ALIAS,
            "--reload-interval",
            str(reload_interval),
            *extra,
            *(["--allow-unauthenticated"] if host else []),
        ]
        grpc = None
        if grpc_first and i == 0:
            grpc = f"{address}:{free_port()}"
            args += ["--grpc-port", grpc.rpartition(":")[2]]
        server = ServerProcess(
            *args,
            env={"MLFLOW_TRACKING_URI": tracking_uri, "TMPDIR": str(home / "tmp")},
            log_path=home / "server.log",
            cwd=home,
            address=address,
            prefix=host.command([]) if host else None,
        )
        server.grpc = grpc
        fleet.append(server)
    started: list[ServerProcess] = []
    try:

        def start(server: ServerProcess) -> None:
            server.__enter__()
            started.append(server)

        # at once: each takes seconds to import and load
        with ThreadPoolExecutor(n) as pool:
            for future in [pool.submit(start, s) for s in fleet]:
                future.result()
        yield fleet
    finally:
        for server in fleet:
            if server in started or server.proc is not None:
                with contextlib.suppress(Exception):
                    server.__exit__(None, None, None)


# ---- load ----------------------------------------------------------------------------------------


@dataclass
class Answer:
    # the replica (or balancer) asked
    target: str
    # the replica that answered (for a balancer: its X-Upstream header)
    replica: str
    # monotonic time the answer arrived
    done: float
    seconds: float
    # HTTP status; 0 for a connection error or a gRPC error
    status: int
    # the receipt's version ("" when none)
    version: str
    error: str = ""


@dataclass
class Load:
    """`clients` threads, each in a closed loop over `targets` in turn (round robin), sending one
    request of two rows to /v2/models/digits/infer; a target starting with "grpc:" is asked over
    gRPC (tritonclient). Every answer is kept; the receipt (X-Model-Version header) must match the
    body's model_version."""

    targets: list[str]
    clients: int = 3
    answers: list[Answer] = field(default_factory=list)

    def __post_init__(self):
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True)
            for i in range(self.clients)
        ]
        x = np.random.default_rng(0).random((2, 1, 8, 8), dtype=np.float32)
        self.x = x
        self.body = {
            "inputs": [
                {
                    "name": "input",
                    "shape": list(x.shape),
                    "datatype": "FP32",
                    "data": x.ravel().tolist(),
                }
            ]
        }

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _client(self, index: int) -> None:
        session = requests.Session()
        grpc_clients = {}
        turn = index
        while not self._stop.is_set():
            target = self.targets[turn % len(self.targets)]
            turn += 1
            started = time.monotonic()
            if target.startswith("grpc:"):
                answer = self._grpc(grpc_clients, target, started)
            else:
                answer = self._http(session, target, started)
            with self._lock:
                self.answers.append(answer)

    def _http(self, session: requests.Session, target: str, started: float) -> Answer:
        try:
            r = session.post(f"{target}/v2/models/{MODEL}/infer", json=self.body, timeout=30)
        except requests.RequestException as exc:
            return Answer(
                target, target, time.monotonic(), time.monotonic() - started, 0, "", repr(exc)[:300]
            )
        done = time.monotonic()
        replica = r.headers.get("X-Upstream", target)
        version = r.headers.get("X-Model-Version", "")
        error = "" if r.status_code == 200 else r.text[:300]
        if r.status_code == 200 and r.json().get("model_version") != version:
            error = f"receipt says version {version}, the body {r.json().get('model_version')}"
        return Answer(
            target, replica, done, done - started, r.status_code if not error else 0, version, error
        )

    def _grpc(self, clients: dict, target: str, started: float) -> Answer:
        import tritonclient.grpc as triton_grpc

        address = target.removeprefix("grpc:")
        client = clients.get(address) or clients.setdefault(
            address, triton_grpc.InferenceServerClient(address)
        )
        image = triton_grpc.InferInput("input", list(self.x.shape), "FP32")
        image.set_data_from_numpy(self.x)
        try:
            result = client.infer(MODEL, [image], client_timeout=30)
        except Exception as exc:  # noqa: BLE001
            # every failure is counted as one
            return Answer(
                target, target, time.monotonic(), time.monotonic() - started, 0, "", repr(exc)[:300]
            )
        done = time.monotonic()
        return Answer(
            target, target, done, done - started, 200, result.get_response().model_version
        )

    def snapshot(self) -> list[Answer]:
        with self._lock:
            return list(self.answers)


def failures(answers: list[Answer]) -> list[Answer]:
    return [a for a in answers if a.status != 200]


def per_version(answers: list[Answer]) -> dict[str, dict[str, int]]:
    """{replica: {version: answers}} from the receipts."""
    tally: dict[str, dict[str, int]] = {}
    for a in answers:
        if a.status == 200:
            versions = tally.setdefault(a.replica, {})
            versions[a.version] = versions.get(a.version, 0) + 1
    return tally


def converged(answers: list[Answer], moved: float, version: str) -> dict[str, float]:
    """{replica: seconds from the alias move to its first answer from `version`} (replicas that gave
    one)."""
    first: dict[str, float] = {}
    for a in sorted(answers, key=lambda a: a.done):
        if a.status == 200 and a.version == version and a.replica not in first:
            first[a.replica] = a.done - moved
    return first


def wait_converged(
    load: Load,
    moved: float,
    version: str,
    replicas_expected: set[str],
    limit: float,
    fail_fast: bool = False,
) -> dict[str, float]:
    """Waits until every expected replica answered from `version` (at most `limit` s after the
    move); with `fail_fast`, an AssertionError at the first failed request."""
    while True:
        answers = load.snapshot()
        if fail_fast and failures(answers):
            raise AssertionError(f"a request failed: {failures(answers)[0]}")
        seen = converged(answers, moved, version)
        if replicas_expected <= set(seen):
            return seen
        if time.monotonic() - moved > limit:
            raise AssertionError(
                f"after {limit:.0f} s only {sorted(seen)} of {sorted(replicas_expected)} answer from "
                f"version {version}"
            )
        time.sleep(0.1)


class ReadyWatch:
    """A thread asking each replica's /v2/health/ready and /v2/models/digits/ready every `every` s;
    `not_ready` holds (url, status) of every answer that was not 200."""

    def __init__(self, urls: list[str], every: float = 0.05):
        self.paths = [
            f"{u}{p}" for u in urls for p in ("/v2/health/ready", f"/v2/models/{MODEL}/ready")
        ]
        self.every = every
        self.checks = 0
        self.not_ready: list[tuple[str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> "ReadyWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def _watch(self) -> None:
        session = requests.Session()
        while not self._stop.wait(self.every):
            for url in self.paths:
                try:
                    status = session.get(url, timeout=10).status_code
                except requests.RequestException:
                    status = 0
                self.checks += 1
                if status != 200:
                    self.not_ready.append((url, status))


# ---- nginx ---------------------------------------------------------------------------------------

NGINX_CONF = """\
{user}worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 512; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    upstream replicas {{
{servers}
        keepalive 16;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://replicas;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $http_host;  # the client's: the server checks it (--allowed-hosts)
            # No retry on another replica: a replica's failure must reach the client, where it is counted.
            proxy_next_upstream off;
            add_header X-Upstream $upstream_addr always;
        }}
    }}
}}
"""


def nginx_missing() -> str | None:
    """Why nginx cannot run here (None when it can)."""
    if shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists():
        return "nginx is not installed (scripts/setup installs the Debian package when run as root)"
    return None


@contextlib.contextmanager
def nginx(upstreams: list[str], directory: Path):
    """nginx balancing round robin over `upstreams` (http://host:port), in the foreground on a
    loopback port, with its config, pid, logs and temp files under `directory`; yields its URL.
    Killed by PID."""
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    prefix = directory / "nginx"
    prefix.mkdir(parents=True, exist_ok=True)
    port = free_port()
    servers = "\n".join(f"        server {u.removeprefix('http://')};" for u in upstreams)
    # As root nginx runs its worker as `nobody`, which cannot enter a private temp directory: keep
    # it root.
    user = "user root;\n" if os.geteuid() == 0 else ""
    conf = prefix / "nginx.conf"
    conf.write_text(NGINX_CONF.format(user=user, prefix=prefix, servers=servers, port=port))
    proc = subprocess.Popen(
        [
            binary,
            "-p",
            str(prefix),
            "-c",
            str(conf),
            "-e",
            str(prefix / "error.log"),
            "-g",
            "daemon off;",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"nginx exited with {proc.returncode}:\n{(prefix / 'error.log').read_text()}"
                )
            try:
                requests.get(url + "/v2/health/live", timeout=1)
                break
            except requests.ConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError("nginx did not listen within 20 s") from None
                time.sleep(0.05)
        yield url
    finally:
        if proc.poll() is None:
            # graceful: the master stops its workers
            proc.send_signal(signal.SIGQUIT)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
