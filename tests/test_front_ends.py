"""A server of front-end processes (`--front-ends 2`): the process started is the engine, two
processes take HTTP and gRPC in on the same ports and write tensors into the engine's batch rows
(serving/front_ends.py, serving/front_end_process.py, serving/arena.py). Everything a client does
with one process, through either front end; a version swapped under load; front ends and engines
killed at any moment."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import requests

from serving import arena
from tests.serving_fixtures import (
    ServerProcess,
    free_port,
    heavy_model,
    metric,
    run_onnx,
    tiny_model,
)

pytestmark = pytest.mark.skipif(bool(arena.WHY_NOT), reason=arena.WHY_NOT or "built")
INFER = "/v2/models/tiny/infer"


def front_ends(engine: int, port: int | None = None) -> list[int]:
    """The engine's front-end processes (its children running serving.front_end_process): those
    listening on `port` when given (not the spare, started and waiting to replace one)."""
    found = []
    for task in Path(f"/proc/{engine}/task").iterdir():
        for pid in (task / "children").read_text().split():
            # (a process gone since the listing: its /proc entry vanished, or is a reaped zombie's)
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if b"serving.front_end_process" in command:
                if port is None or listening(int(pid), port):
                    found.append(int(pid))
    return sorted(found)


def listening(pid: int, port: int) -> bool:
    """Whether process `pid` holds a socket listening on `port` (from /proc/net/tcp)."""
    inodes = set()
    try:
        table = Path(f"/proc/{pid}/net/tcp").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    for line in table.splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
            inodes.add(fields[9])
    try:
        links = [os.readlink(f) for f in Path(f"/proc/{pid}/fd").iterdir()]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return any(link.startswith("socket:[") and link[8:-1] in inodes for link in links)


def spare(server) -> float:
    """Whether a spare front end waits to replace one that dies (its /metrics)."""
    text = requests.get(server.url + "/metrics", timeout=10).text
    return metric(text, "trainserve_front_ends", state="spare")


def own_dev_shm(folder: Path) -> list[str]:
    """What starts a server with its own /dev/shm (`folder`, bound there in a mount namespace of its
    own): whatever it leaves there is its, not another test worker's (PostgreSQL's, say). The
    server no longer sees the rest of /dev/shm, where tmp_path may be: see model_off_dev_shm."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a mount namespace of the server's own needs root and unshare (util-linux)")
    folder.mkdir(exist_ok=True)
    script = 'mount --bind "$0" /dev/shm && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(folder)]


def two_front_ends_own_dev_shm(model: Path, shm: Path, log: Path) -> ServerProcess:
    """A server of `model` with 2 front ends and a /dev/shm of its own (`shm`, own_dev_shm)."""
    return ServerProcess(
        "--model", str(model), "--front-ends", "2", log_path=log, prefix=own_dev_shm(shm)
    )


@pytest.fixture
def model_off_dev_shm():
    """The tiny model where a server with its own /dev/shm still finds it."""
    with tempfile.TemporaryDirectory(dir="/var/tmp") as folder:
        yield tiny_model(Path(folder) / "tiny.onnx")


def wait_for(condition, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while True:
        found = condition()
        if found:
            return found
        assert time.monotonic() < deadline, f"{what} within {seconds} s"
        time.sleep(0.02)


def binary_request(x: np.ndarray) -> tuple[bytes, dict]:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "datatype": "FP32",
                    "shape": list(x.shape),
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "outputs": [{"name": "probabilities", "parameters": {"binary_data": True}}],
        }
    ).encode()
    return header + x.tobytes(), {
        "Inference-Header-Content-Length": str(len(header)),
        "Content-Type": "application/octet-stream",
    }


def images(n: int = 1, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((n, 1, 8, 8), dtype=np.float32)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("front_ends")
    model = tiny_model(tmp / "tiny.onnx", labels=["a", "b", "c"])
    grpc_port = free_port()
    with ServerProcess(
        "--model",
        str(model),
        "--front-ends",
        "2",
        "--grpc-port",
        str(grpc_port),
        log_path=tmp / "log",
    ) as server:
        server.grpc_port = grpc_port
        server.model = model
        yield server


def test_every_protocol_through_two_front_ends(served):
    """Binary and JSON V2, /invocations, gRPC unary and streamed, a system shared-memory region
    registered through one connection and used through others: each over new connections (the
    kernel spreads them over both front ends), each answer the model's, each with its receipt;
    /metrics counts every request of both front ends in one scrape; the front ends run no
    onnxruntime."""
    import tritonclient.grpc as tg
    import tritonclient.http as th
    import tritonclient.utils.shared_memory as shm

    engine = served.proc.pid
    assert len(front_ends(engine, served.port)) == 2
    pids = front_ends(engine)
    assert len(pids) == 3, pids
    for pid in pids:
        assert b"onnxruntime" not in Path(f"/proc/{pid}/maps").read_bytes()
    assert b"onnxruntime" in Path(f"/proc/{engine}/maps").read_bytes()
    url = served.url
    sent = 0
    for i in range(12):
        x = images(1 + i % 3, seed=i)
        want = run_onnx(served.model, x)["probabilities"]
        body, headers = binary_request(x)
        r = requests.post(url + INFER, data=body, headers={**headers, "X-Request-Id": f"r{i}"})
        assert r.status_code == 200, r.text[:300]
        assert r.headers["X-Request-Id"] == f"r{i}" and r.headers["X-Model-Name"] == "tiny"
        assert len(r.headers["X-Server-Request-Id"]) == 32
        got = json.loads(r.content[: int(r.headers["Inference-Header-Content-Length"])])
        assert got["outputs"][0]["shape"] == list(want.shape)
        raw = r.content[int(r.headers["Inference-Header-Content-Length"]) :]
        np.testing.assert_allclose(np.frombuffer(raw, np.float32).reshape(want.shape), want, 1e-5)
        r = requests.post(
            url + INFER,
            json={
                "inputs": [
                    {
                        "name": "input",
                        "datatype": "FP32",
                        "shape": list(x.shape),
                        "data": x.ravel().tolist(),
                    }
                ]
            },
        )
        assert r.status_code == 200, r.text[:300]
        out = {o["name"]: o for o in r.json()["outputs"]}["probabilities"]
        np.testing.assert_allclose(np.array(out["data"]).reshape(want.shape), want, 1e-5)
        r = requests.post(url + "/invocations", json={"inputs": x.tolist()})
        assert r.status_code == 200, r.text[:300]
        np.testing.assert_allclose(r.json()["predictions"]["probabilities"], want, 1e-5)
        client = tg.InferenceServerClient(f"127.0.0.1:{served.grpc_port}")
        tensor = tg.InferInput("input", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer("tiny", [tensor], request_id=f"g{i}")
        np.testing.assert_allclose(result.as_numpy("probabilities"), want, 1e-5)
        client.close()
        sent += 3
    answers = []
    client = tg.InferenceServerClient(f"127.0.0.1:{served.grpc_port}")
    client.start_stream(callback=lambda result, error: answers.append(error or result))
    for i in range(5):
        tensor = tg.InferInput("input", [1, 1, 8, 8], "FP32")
        tensor.set_data_from_numpy(images(seed=100 + i))
        client.async_stream_infer("tiny", [tensor], request_id=str(i))
    client.stop_stream()
    client.close()
    for i, result in enumerate(answers):
        want = run_onnx(served.model, images(seed=100 + i))["probabilities"]
        np.testing.assert_allclose(result.as_numpy("probabilities"), want, 1e-5)
    x = images(2, seed=7)
    region = shm.create_shared_memory_region("in", "/front-ends-in", x.nbytes)
    try:
        shm.set_shared_memory_region(region, [x])
        th.InferenceServerClient(url[7:]).register_system_shared_memory(
            "in", "/front-ends-in", x.nbytes
        )
        for _ in range(6):
            client = th.InferenceServerClient(url[7:])
            tensor = th.InferInput("input", list(x.shape), "FP32")
            tensor.set_shared_memory("in", x.nbytes)
            result = client.infer("tiny", [tensor])
            want = run_onnx(served.model, x)["probabilities"]
            np.testing.assert_allclose(result.as_numpy("probabilities"), want, 1e-5)
            client.close()
        th.InferenceServerClient(url[7:]).unregister_system_shared_memory("in")
    finally:
        shm.destroy_shared_memory_region(region)
    metadata = requests.get(url + "/v2/models/tiny").json()
    assert metadata["inputs"][0]["shape"] == [-1, 1, 8, 8]
    assert requests.get(url + "/v2/health/ready").status_code == 200
    stats = requests.get(url + "/v2/models/tiny/stats").json()
    assert stats["model_stats"][0]["inference_count"] >= 12 * 3 * 2
    text = requests.get(url + "/metrics").text
    counted = metric(
        text, "trainserve_requests_total", route="/v2/models/{name}/infer", status="200"
    )
    assert counted == 24 + 6, text[:2000]
    assert metric(text, "trainserve_requests_total", route="grpc ModelInfer", status="OK") == 12


def test_a_request_past_its_timeout_is_a_504_through_a_front_end(tmp_path):
    """--request-timeout holds a request whichever process took it in: the engine's 504 comes back
    through the front end, naming the flag."""
    path = heavy_model(tmp_path / "heavy.onnx", channels=128, layers=6)
    with ServerProcess(
        "--model",
        str(path),
        "--front-ends",
        "2",
        "--max-batch-size",
        "64",
        "--max-rows-per-request",
        "64",
        "--request-timeout",
        "0.1",
        log_path=tmp_path / "log",
    ) as server:
        big = np.random.default_rng(0).random((64, 1, 28, 28), dtype=np.float32).tolist()
        r = requests.post(server.url + "/invocations", json={"inputs": big}, timeout=60)
        assert r.status_code == 504 and "--request-timeout" in r.json()["error"], r.text[:200]


class Load:
    """Clients on threads of their own, each on a connection of its own (reopened after a failure),
    sending binary V2 requests until stopped: answers, failures and versions seen counted."""

    def __init__(self, url: str, clients: int = 6):
        self.url, self.stopping = url, threading.Event()
        self.ok = self.failed = 0
        self.statuses: list[int] = []
        self.versions: set[str] = set()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(i,)) for i in range(clients)]

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        for thread in self.threads:
            thread.join(60)

    def _client(self, i: int) -> None:
        body, headers = binary_request(images(1, seed=i))
        session = requests.Session()
        while not self.stopping.is_set():
            try:
                r = session.post(self.url + INFER, data=body, headers=headers, timeout=30)
            except requests.RequestException:
                with self.lock:
                    self.failed += 1
                session = requests.Session()
                continue
            with self.lock:
                if r.status_code == 200:
                    self.ok += 1
                    self.versions.add(r.headers["X-Model-Version"])
                else:
                    self.statuses.append(r.status_code)

    def count(self) -> int:
        with self.lock:
            return self.ok


def test_a_version_swapped_under_load_fails_no_request(tmp_path):
    """Version 2 of a repository model is loaded while six clients send requests through both front
    ends: no request fails, the answers move from version 1 to version 2, and version 1's rows
    (mapped by each front end) stay until every request in them was answered."""
    repository = tmp_path / "repository"
    (repository / "tiny" / "1").mkdir(parents=True)
    tiny_model(repository / "tiny" / "1" / "model.onnx", seed=1)
    with ServerProcess(
        "--repository", str(repository), "--front-ends", "2", log_path=tmp_path / "log"
    ) as server:
        with Load(server.url) as load:
            wait_for(lambda: load.count() > 50, 30, "answers")
            (repository / "tiny" / "2").mkdir()
            tiny_model(repository / "tiny" / "2" / "model.onnx", seed=2)
            r = requests.post(server.url + "/v2/repository/models/tiny/load", timeout=60)
            assert r.status_code == 200, r.text
            before = load.count()
            wait_for(lambda: load.count() > before + 50, 30, "answers after the swap")
        assert load.failed == 0 and not load.statuses, (load.failed, load.statuses[:5])
        assert load.versions == {"1", "2"}
        x = images(seed=3)
        body, headers = binary_request(x)
        r = requests.post(server.url + INFER, data=body, headers=headers)
        assert r.headers["X-Model-Version"] == "2"
        want = run_onnx(repository / "tiny" / "2" / "model.onnx", x)["probabilities"]
        raw = r.content[int(r.headers["Inference-Header-Content-Length"]) :]
        np.testing.assert_allclose(np.frombuffer(raw, np.float32).reshape(want.shape), want, 1e-5)


@pytest.mark.slow
def test_front_ends_killed_under_load_are_replaced_and_fail_only_their_own_requests(
    tmp_path, model_off_dev_shm
):
    """20 times, one of two front ends is SIGKILLed while six clients send requests: only
    connections to it fail (a connection error, never a status from the server), another process
    listens in its place within 2 s, the engine lets go of its rows (no buffer is left taken, no
    arrival waited for), and nothing is left in /dev/shm."""
    shm = tmp_path / "shm"
    with two_front_ends_own_dev_shm(model_off_dev_shm, shm, tmp_path / "log") as server:
        engine = server.proc.pid
        replaced = []
        with Load(server.url) as load:
            for i in range(20):
                # (a spare ready: its imports took a second or two after the last kill)
                wait_for(lambda: spare(server) == 1, 30, "a spare front end waiting")
                wait_for(lambda: len(front_ends(engine, server.port)) == 2, 10, "two front ends")
                pids = front_ends(engine, server.port)
                victim = pids[i % 2]
                answered = load.count()
                wait_for(lambda: load.count() > answered + 10, 30, "answers before the kill")
                os.kill(victim, signal.SIGKILL)
                killed = time.monotonic()
                wait_for(
                    lambda: [p for p in front_ends(engine, server.port) if p not in pids],
                    10,
                    "another front end listening",
                )
                replaced.append(time.monotonic() - killed)
        assert max(replaced) < 2.0, replaced
        assert not load.statuses, load.statuses[:5]
        assert load.ok > 20 * 10
        text = requests.get(server.url + "/metrics").text
        assert metric(text, "trainserve_batch_buffers_in_use") == 0, text
        assert metric(text, "trainserve_requests_arriving") == 0, text
    assert os.listdir(shm) == []


@pytest.mark.slow
def test_the_engine_killed_takes_its_front_ends_down(tmp_path, model_off_dev_shm):
    """20 times, the engine of two front ends is SIGKILLed: its exit is not 0, both front ends are
    gone within 2 s (none is left holding the port), and nothing is left in /dev/shm."""
    shm = tmp_path / "shm"
    for _ in range(20):
        with two_front_ends_own_dev_shm(model_off_dev_shm, shm, tmp_path / "log") as server:
            pids = front_ends(server.proc.pid)
            assert len(pids) == 3
            server.proc.send_signal(signal.SIGKILL)
            assert server.proc.wait(10) != 0
            wait_for(
                lambda: not any(Path(f"/proc/{p}").exists() for p in pids), 2, "front ends gone"
            )
    assert os.listdir(shm) == []


def test_sigterm_drains_every_process(tmp_path):
    """SIGTERM to the engine while requests are in flight: each is answered, every front end exits,
    and the engine exits 0."""
    path = heavy_model(tmp_path / "heavy.onnx", channels=96, layers=4)
    with ServerProcess(
        "--model", str(path), "--front-ends", "2", log_path=tmp_path / "log"
    ) as server:
        pids = front_ends(server.proc.pid)
        x = np.random.default_rng(0).random((16, 1, 28, 28), dtype=np.float32).tolist()
        answers = []

        def ask():
            answers.append(
                requests.post(server.url + "/invocations", json={"inputs": x}, timeout=60)
            )

        threads = [threading.Thread(target=ask) for _ in range(4)]
        for thread in threads:
            thread.start()
        time.sleep(0.3)
        assert server.terminate(60) == 0, server.log()[-3000:]
        for thread in threads:
            thread.join(60)
        assert [r.status_code for r in answers] == [200] * 4
        assert not any(Path(f"/proc/{p}").exists() for p in pids)


def test_a_front_end_killed_while_receiving_a_grpc_message_leaves_no_batch_waiting(tmp_path):
    """A ModelInfer message half-sent to a front end holds the engine's batches for it, at most
    --arrival-wait-ms (serving/receiving.py); the front ends killed (both: whichever held it), no
    batch waits for it any more."""
    from test_grpc_engines import METHOD, _half_sent_call, infer_request

    from serving.grpc import native

    if not native.available():
        pytest.skip(native.WHY_NOT)
    port = free_port()

    def lone_call() -> float:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            begun = time.monotonic()
            channel.unary_unary(METHOD + "ModelInfer")(infer_request(), timeout=30)
            return time.monotonic() - begun

    model = tiny_model(tmp_path / "tiny.onnx")
    with ServerProcess(
        "--model",
        f"tiny={model}",
        "--front-ends",
        "2",
        "--grpc-port",
        str(port),
        "--arrival-wait-ms",
        "1000",
        log_path=tmp_path / "log",
    ) as server:
        engine = server.proc.pid
        half = _half_sent_call(port, infer_request())
        # its first half in: the call has begun
        time.sleep(0.3)
        held = lone_call()
        # (those listening on the HTTP port: each front end takes both protocols in)
        pids = front_ends(engine, server.port)
        assert len(pids) == 2
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        wait_for(
            lambda: len([p for p in front_ends(engine, server.port) if p not in pids]) == 2,
            30,
            "two new front ends listening",
        )
        half.abandon()
        alone = lone_call()
    assert held > 0.9 and alone < 0.6, (held, alone)


def test_the_auth_token_and_cuda_regions_hold_in_front_ends(tmp_path):
    """A token is checked by the front end that takes a request (401 without it), and region
    names are the token's in every front end (as in one process)."""
    model = tiny_model(tmp_path / "tiny.onnx")
    token = "front-ends-token"
    with ServerProcess(
        "--model",
        str(model),
        "--front-ends",
        "2",
        env={"TRAINSERVE_AUTH_TOKEN": token},
        log_path=tmp_path / "log",
    ) as server:
        body, headers = binary_request(images())
        assert requests.post(server.url + INFER, data=body, headers=headers).status_code == 401
        auth = {"Authorization": f"Bearer {token}"}
        r = requests.post(server.url + INFER, data=body, headers={**headers, **auth})
        assert r.status_code == 200, r.text[:200]
        r = requests.post(
            server.url + "/v2/cudasharedmemory/region/gpu/register",
            json={
                "raw_handle": {"b64": base64.b64encode(bytes(64)).decode()},
                "device_id": 0,
                "byte_size": 16,
            },
            headers=auth,
        )
        assert r.status_code in (400, 403, 503), r.text[:200]


def test_front_ends_by_default_only_for_batch_rows_of_512_kib_on_8_cpus_or_more(monkeypatch):
    """A front end costs more CPU a request than one process: the default starts them only where
    one interpreter would be the limit, large rows and cores to spare, and says why not otherwise."""
    import serving.cpus
    from serving.config import LARGE_ROW_BYTES, Settings

    large, small = LARGE_ROW_BYTES, LARGE_ROW_BYTES - 1
    for cpus, row_bytes, count in (
        (16, large, 4),
        (8, large, 2),
        (64, large, 8),
        (7, large, 0),
        (2, large, 0),
        (64, small, 0),
        (64, 0, 0),
    ):
        monkeypatch.setattr(serving.cpus, "usable_cpus", lambda: cpus)
        assert Settings().front_end_processes(row_bytes)[0] == count, (cpus, row_bytes)
    monkeypatch.setattr(serving.cpus, "usable_cpus", lambda: 16)
    assert Settings().front_end_processes(large)[1].startswith("16 CPUs usable and model rows of")
    assert Settings(front_ends=2).front_end_processes(0) == (2, "--front-ends")
    assert Settings(front_ends=0).front_end_processes(large) == (0, "--front-ends")
    assert Settings(http_threads=2).front_end_processes(large)[0] == 0
    # an install that can't run them: one process, and why
    count, why = Settings().front_end_processes(large, "serving._ingest is not built")
    assert count == 0 and why.startswith("serving._ingest is not built")
    monkeypatch.setattr(serving.cpus, "usable_cpus", lambda: 2)
    assert "2 CPUs usable: front ends pay from 8" in Settings().front_end_processes(large)[1]
    assert (
        "no model loaded at start has batch rows of 512 KiB"
        in (Settings().front_end_processes(small)[1])
    )


def test_a_cpu_quota_caps_the_cpus_the_default_counts():
    """A container limited to half a CPU on a host of several: the server counts 1 CPU (the quota,
    rounded up), not the host's, for its front ends, event loops and onnxruntime threads. A real
    cgroup of this machine (v1's cpu controller, or v2's cpu.max)."""
    import subprocess
    import sys

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: a quota of half of one counts 1 with or without the cap")
    v1, v2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
    try:
        if (v1 / "cpu.cfs_quota_us").exists():
            group, limit = v1 / f"trainserve-test-{os.getpid()}", ("cpu.cfs_quota_us", "50000")
        elif "cpu" in (v2 / "cgroup.subtree_control").read_text().split():
            group, limit = v2 / f"trainserve-test-{os.getpid()}", ("cpu.max", "50000 100000")
        else:
            raise OSError("no cpu controller in the subtree")
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"no cgroup with a CPU quota can be made here (needs root): {exc}")
    try:
        (group / limit[0]).write_text(limit[1])
        code = (
            "from serving.config import LARGE_ROW_BYTES, Settings; "
            "from serving.cpus import usable_cpus; "
            "print(usable_cpus()); print(Settings().front_end_processes(LARGE_ROW_BYTES)[1])"
        )
        out = subprocess.run(
            [
                "sh",
                "-c",
                f'echo $$ > {group}/cgroup.procs && exec "$0" -c "$1"',
                sys.executable,
                code,
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
            cwd=Path(__file__).parent.parent,
        ).stdout.splitlines()
    finally:
        # (the process exec'd in it was reaped: the group is empty)
        with contextlib.suppress(OSError):
            group.rmdir()
    assert out[0] == "1", out
    assert out[1].startswith("1 CPU usable: front ends pay from 8"), out


def test_cgroup_quotas_are_read_from_the_process_cgroups_and_their_parents(tmp_path, monkeypatch):
    """cpu.max on a parent is a limit too: the tightest counts; "max" is none (v2). v1's quota and
    period files likewise. A quota of 1.5 CPUs counts 2; lines that say nothing are passed over."""
    import serving.cpus
    from serving.cpus import cpu_quota

    own = tmp_path / "cgroup"
    own.write_text("0::/pod/app\n")
    (tmp_path / "pod" / "app").mkdir(parents=True)
    (tmp_path / "pod" / "app" / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(str(tmp_path), str(own)) is None
    (tmp_path / "pod" / "cpu.max").write_text("250000 100000\n")
    assert cpu_quota(str(tmp_path), str(own)) == (250000, 100000)
    (tmp_path / "pod" / "app" / "cpu.max").write_text("150000 100000\n")
    assert cpu_quota(str(tmp_path), str(own)) == (150000, 100000)
    # v1: a cpu,cpuacct mount, the quota on the process's own group; junk around it
    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct" / "job").mkdir(parents=True)
    (v1 / "cpu,cpuacct" / "job" / "cpu.cfs_quota_us").write_text("150000\n")
    (v1 / "cpu,cpuacct" / "job" / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
    own.write_text("garbage\n4:memory:/x\n2:cpu,cpuacct:/job\n")
    assert cpu_quota(str(v1), str(own)) == (150000, 100000)
    monkeypatch.setattr(serving.cpus, "cpu_quota", lambda: (150000, 100000))
    assert serving.cpus.usable_cpus() == min(2, len(os.sched_getaffinity(0)))
    assert cpu_quota(str(v1), str(tmp_path / "no-such-file")) is None
