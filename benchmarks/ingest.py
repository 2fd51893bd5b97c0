r"""What it costs the server to take a large tensor in: its own CPU per request, every thread of it
counted.

A trivial ONNX model with, by default, a ResNet-50-shaped input (1x3x224x224 FP32, 602 KB a request;
`--image` sets another; the model reduces it to 10 logits, a small cost of onnxruntime per image: it
must read it) is served by `python -m serving` with its default settings (and --grpc-port); a closed
loop of C clients sends one image a request for S seconds, over each protocol:

    binary HTTP      V2 with Triton's binary tensor extension; h2load --h1 (nghttp2's C client)
                     where installed, else the Python generator of benchmarks/serve.py
    gRPC             ModelInfer, raw_input_contents; h2load where installed (C clients on one
                     connection), else grpc.aio
    binary HTTP,     the same over binary HTTP with the image as UINT8 pixel values (150 KB), to a
                     second model of the
    UINT8            server that casts and scales them (what `export.uint8_inputs` makes of a model)
    shm HTTP / gRPC  the V2 system shared-memory extension driven by an unmodified tritonclient (http, grpc): the
                     input in a region the client registered, the output in another, a region pair per request in
                     flight; clients in several processes of threads (tritonclient's clients are not thread-safe)

Reported per row: req/s, the server's mean rows per model run (from /metrics), the server's CPU ms
per request (utime + stime of every thread of every process of it, from /proc: with front ends, the
engine's and each front end's), errors; with front ends, each front end's share of the front ends'
CPU. With the model's cost near zero, the CPU per request is what the front end, the batcher and
the copies cost: what sets a GPU server's pace (docs/benchmarks.md#benchmarksingestpy).

C references, pinned as the server is, each only receiving requests and answering a fixed message:
what this machine's kernel and a server in C or C++ cost for those bytes, with no model, no checks
and no Python.
- nginx (where it and its echo module are installed: `apt-get install nginx-light
  libnginx-mod-http-echo`) gets the binary HTTP rows' request, and a 300-byte POST (a shared-memory
  request's size);
- grpc's own C++ server (benchmarks/grpc_floor.cc, compiled here where grpc++'s headers are, as
  scripts/setup installs them for serving/grpc/native.cc) gets the gRPC rows' request: the same
  callback server and threads the native gRPC engine runs on, with nothing after them.
The binary HTTP and gRPC rows then give their CPU as a multiple of the reference's for the same
bytes in the same run, a ratio that moves less from one run to the next on a shared VM than the
milliseconds do.

Cores: by default the server is pinned to one core and the load generator to the other (`taskset`),
so that neither's CPU is the other's; `--cores K` pins the server to K cores and the generator to
the rest, or, with K all of them, shares them; `--cores 1,2` adds the server on both cores (shared
with the generator), which shows whether it takes more requests in with more cores. This machine has 2:
compare rows of one run only. With 602 KB requests one h2load thread sends at most ~2,500 a second
here (nginx, which only receives them, gets no more): the generator, not the server, sets the pace
on 2 cores; `--image 3x32x32` (12 KB) leaves the server the pace.

    python benchmarks/ingest.py                          # every protocol, c=32, 3 rounds of 5 s,
                                                         medians
    python benchmarks/ingest.py --quick                  # one round of 3 s
    python benchmarks/ingest.py --protocols http,grpc --cores 1,2 --concurrency 32
    python benchmarks/ingest.py --protocols http,grpc --cores 1,2 --image 3x32x32   # scaling, small images
    python benchmarks/ingest.py --against ../base --protocols http --rounds 8 --seconds 3
    python benchmarks/ingest.py --protocols http,grpc --front-ends 1,2   # front-end processes
    python benchmarks/ingest.py --protocols http --front-ends 1,2,4,8 --cores 8 --generators 8 \
        --concurrency 256 --rounds 2 --seconds 4     # their scaling, on 16 cores (issue 50)

`--front-ends 1,2,...`: a server of each count of front-end processes (`--front-ends N`: the process
started is the engine, N processes take requests in, serving/front_ends.py), all started at once,
the rounds alternating between them as with --against; the load then comes from `--generators`
h2load processes at once (default 2), each with its share of the connections, so that one generator
is not the pace, and gRPC from `--grpc-connections` connections per generator (default 8: the
kernel spreads connections, not streams, over the front ends, by a hash of each: 8 connections in
all are split 2 to 6 or worse in over a quarter of rounds, and the front end of 6 sets the pace).
Below the table, the CPU per request of each count as a multiple of the first's, in the same run.

`--against DIR` compares this tree's server with another checkout's (e.g.
`git worktree add ../base main`, its extensions built with `python setup.py build_ext --inplace`):
both servers run at once, pinned alike, and the rounds alternate between them, so that what this
machine does meanwhile falls on both (one run of this 2-core VM and the next, an hour apart,
differed by 20-65% with the same code: docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
# benchmarks/serve.py: the load generators and the V2 requests
import serve as bench  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = "trivial"
# one image a request (--image sets it)
SHAPE = (1, 3, 224, 224)
MODEL_UINT8 = "trivial_uint8"
PROTOCOLS = {
    "http": "binary HTTP",
    "http-uint8": "binary HTTP, UINT8 image",
    "grpc": "gRPC",
    "shm-http": "shm HTTP (tritonclient)",
    "shm-grpc": "shm gRPC (tritonclient)",
}
# tritonclient load processes
SHM_PROCESSES = 4
# what a row gives of its rounds
MEDIANS = ("rps", "rows_per_run", "cpu_ms")


def trivial_model(path: Path, uint8: bool = False) -> None:
    """1xSHAPE FP32 -> ReduceMean over H, W -> MatMul -> 10 logits: a model that costs (almost)
    nothing. `uint8`: its input UINT8 pixel values, cast and scaled by 1/255 first (as
    export.uint8_inputs makes a model's)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(
        np.random.default_rng(0).random((SHAPE[1], 10), dtype=np.float32), "w"
    )
    nodes = [
        helper.make_node(
            "ReduceMean", ["scaled" if uint8 else "input"], ["m"], axes=[2, 3], keepdims=0
        ),
        helper.make_node("MatMul", ["m", "w"], ["logits"]),
    ]
    inits = [w]
    if uint8:
        nodes[:0] = [
            helper.make_node("Cast", ["input"], ["as_float"], to=TensorProto.FLOAT),
            helper.make_node("Div", ["as_float", "scale"], ["scaled"]),
        ]
        inits.append(helper.make_tensor("scale", TensorProto.FLOAT, [], [255.0]))
    kind = TensorProto.UINT8 if uint8 else TensorProto.FLOAT
    graph = helper.make_graph(
        nodes,
        MODEL,
        [helper.make_tensor_value_info("input", kind, ["batch", *SHAPE[1:]])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    # Row-wise by construction, said as export records it: the server batches only such a model.
    helper.set_model_props(model, {"trainserve.rows_independent": "by construction"})
    onnx.save(model, str(path))


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def processes_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of a server's processes: `pid` and its children (its front ends, and the spare
    that waits to replace one), each process's threads together."""
    found = {pid: cpu_seconds(pid)}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                with contextlib.suppress(OSError):
                    found[int(child)] = cpu_seconds(int(child))
    return found


def listening(pid: int, port: int) -> bool:
    """Whether process `pid` holds a socket listening on `port` (a front end; not the spare)."""
    inodes = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
            inodes.add(fields[9])
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                link = os.readlink(fd)
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return True
    return False


def pinned(cpus: str | None, cmd: list[str]) -> list[str]:
    return ["taskset", "-c", cpus, *cmd] if cpus and shutil.which("taskset") else cmd


@contextlib.contextmanager
def generator_on(cpus: str | None):
    """benchmarks/serve.py's h2load runs on `cpus` meanwhile (its subprocess calls pinned)."""
    original = bench.subprocess.run
    bench.subprocess.run = lambda cmd, *a, **k: original(pinned(cpus, cmd), *a, **k)
    try:
        yield
    finally:
        bench.subprocess.run = original


class Server:
    """`python -m serving` with HTTP and gRPC on free ports, ready when entered (its log in
    `work`)."""

    def __init__(
        self,
        model: Path | dict[str, Path],
        work: Path,
        cpus: str | None,
        extra: list[str],
        model_name: str = MODEL,
        root: Path = ROOT,
        front_ends: int | None = None,
    ):
        self.port, self.grpc_port = bench.two_free_ports()
        self.work, self.root, self.front_ends = work, root, front_ends
        if front_ends is not None:
            extra = [*extra, "--front-ends", str(front_ends)]
        self.log = work / (
            f"server-{root.name}-{cpus or 'all'}-"
            f"{'-'.join(a.strip('-') for a in extra) or 'defaults'}.log"
        )
        models = (
            [a for name, path in model.items() for a in ("--model", f"{name}={path}")]
            if isinstance(model, dict)
            else ["--model", str(model), "--model-name", model_name]
        )
        self.cmd = pinned(
            cpus,
            [
                sys.executable,
                "-m",
                "serving",
                *models,
                "--port",
                str(self.port),
                "--grpc-port",
                str(self.grpc_port),
                *extra,
            ],
        )

    def __enter__(self):
        self.proc = subprocess.Popen(
            self.cmd, cwd=self.root, stdout=open(self.log, "w"), stderr=subprocess.STDOUT
        )
        for _ in range(600):
            try:
                if (
                    requests.get(
                        f"http://127.0.0.1:{self.port}/v2/health/ready", timeout=1
                    ).status_code
                    == 200
                ):
                    return self
            except requests.RequestException:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"the server did not start:\n{self.log.read_text()[-3000:]}")

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(60)

    def batches(self) -> tuple[float, float]:
        text = requests.get(f"http://127.0.0.1:{self.port}/metrics", timeout=10).text
        return bench.series_total(text, "trainserve_batch_size_count"), bench.series_total(
            text, "trainserve_batch_size_sum"
        )

    def layout(self) -> str:
        found = re.search(r"laid out as: (.*)", self.log.read_text())
        return found.group(1) if found else "?"


class Nginx:
    """nginx receiving requests and answering a fixed body: the rows' C reference (see the module's
    docstring)."""

    MODULE = Path("/usr/lib/nginx/modules/ngx_http_echo_module.so")

    def __init__(self, work: Path, cpus: str | None, kinds: list[str]):
        body_bytes = max(len(nginx_body(kind)) for kind in kinds)
        self.port = bench.free_port()
        self.dir = work / "nginx"
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        (self.dir / "nginx.conf").write_text(f"""
load_module {self.MODULE};
daemon off;
master_process off;
error_log {self.dir}/logs/error.log;
pid {self.dir}/nginx.pid;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_body_temp_path {self.dir}/body;
  server {{
    listen 127.0.0.1:{self.port};
    keepalive_requests 100000000;
    location / {{
      client_max_body_size {body_bytes + 4096};
      client_body_buffer_size {body_bytes + 4096};
      client_body_in_single_buffer on;
      echo_read_request_body;
      echo '{{"model_name":"trivial","outputs":[{{"name":"logits","datatype":"FP32","shape":[1,10]}}]}}';
    }}
  }}
}}
""")
        self.cmd = pinned(
            cpus,
            [
                shutil.which("nginx") or "nginx",
                "-c",
                str(self.dir / "nginx.conf"),
                "-p",
                str(self.dir),
            ],
        )

    @classmethod
    def missing(cls) -> str | None:
        """Why nginx can't be the reference here, or None."""
        if not shutil.which("nginx") or not shutil.which("h2load"):
            return "no nginx or h2load (apt-get install nginx-light libnginx-mod-http-echo nghttp2-client)"
        if not cls.MODULE.is_file():
            return f"no {cls.MODULE} (apt-get install libnginx-mod-http-echo)"
        return None

    def __enter__(self):
        # (what nginx says before its error_log is open)
        log = self.dir / "logs" / "stderr.log"
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
        for _ in range(100):
            try:
                if requests.post(f"http://127.0.0.1:{self.port}/", data=b"x", timeout=1).ok:
                    return self
            except requests.RequestException:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.1)
        self.proc.kill()
        said = "".join(p.read_text() for p in (log, self.dir / "logs" / "error.log") if p.is_file())
        raise RuntimeError(f"nginx did not start: {said[-2000:]}")

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(30)

    def measure(self, kind: str, c: int, seconds: float, work: Path, cpus: str | None) -> dict:
        """The `kind` of request's body (nginx_body) POSTed by h2load as the binary HTTP rows'
        requests are; nginx's CPU per request."""
        request = b"POST / HTTP/1.1\r\nInference-Header-Content-Length: 0\r\n\r\n" + nginx_body(
            kind
        )
        return reference_load(
            self.proc.pid, bench.BINARY_HTTP, request, self.port, c, seconds, work, cpus
        )


class GrpcFloor:
    """grpc's C++ callback server (benchmarks/grpc_floor.cc, compiled into `work`) receiving the
    gRPC rows' requests and answering a fixed ModelInferResponse: their C++ reference (see the
    module's docstring)."""

    SOURCE = Path(__file__).with_name("grpc_floor.cc")

    def __init__(self, work: Path, cpus: str | None, kinds: list[str]):
        self.port = bench.free_port()
        self.work, self.cpus = work, cpus
        self.binary = work / "grpc_floor"

    @classmethod
    def missing(cls) -> str | None:
        """Why grpc's C++ server can't be the reference here, or None."""
        if not shutil.which("h2load"):
            return "no h2load (apt-get install nghttp2-client)"
        if (
            not shutil.which("g++")
            or subprocess.run(["pkg-config", "--exists", "grpc++"]).returncode != 0
        ):
            return "no g++ or grpc++'s headers (apt-get install g++ libgrpc++-dev pkg-config)"
        return None

    def __enter__(self):
        flags = subprocess.run(
            ["pkg-config", "--cflags", "--libs", "grpc++"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        built = subprocess.run(
            ["g++", "-std=c++17", "-O2", str(self.SOURCE), "-o", str(self.binary), *flags],
            capture_output=True,
            text=True,
        )
        if built.returncode != 0:
            raise RuntimeError(f"{self.SOURCE} did not compile:\n{built.stderr[-2000:]}")
        from serving.grpc import schema

        answer = schema.ModelInferResponse(model_name=MODEL, raw_output_contents=[bytes(40)])
        answer.outputs.add(name="logits", datatype="FP32", shape=[1, 10])
        (self.work / "grpc_floor_answer.bin").write_bytes(answer.SerializeToString())
        self.proc = subprocess.Popen(
            pinned(
                self.cpus,
                [str(self.binary), str(self.port), str(self.work / "grpc_floor_answer.bin")],
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        # "ready" once it listens, else why not (and its exit)
        said = self.proc.stdout.readline()
        if said.strip() != "ready":
            self.proc.kill()
            raise RuntimeError(
                f"{self.binary} did not start: {said}{self.proc.stdout.read()[-2000:]}"
            )
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(30)

    def measure(self, kind: str, c: int, seconds: float, work: Path, cpus: str | None) -> dict:
        """The gRPC rows' request, sent by h2load as theirs is; grpc's CPU per request."""
        request = bench.v2_request(bench.GRPC, MODEL, image(), self.port)
        return reference_load(self.proc.pid, bench.GRPC, request, self.port, c, seconds, work, cpus)


def reference_load(
    pid: int,
    which: str,
    request: bytes,
    port: int,
    c: int,
    seconds: float,
    work: Path,
    cpus: str | None,
) -> dict:
    """`request` sent by h2load (on `cpus`) to a C reference's `port`, after a warm-up: its CPU per
    request."""
    grpc_port = port if which == bench.GRPC else 0
    with generator_on(cpus):
        # warm
        bench.h2load(which, request, port, grpc_port, MODEL, c, min(2.0, seconds), work)
        cpu0 = cpu_seconds(pid)
        result = bench.h2load(which, request, port, grpc_port, MODEL, c, seconds, work)
        cpu = cpu_seconds(pid) - cpu0
    return {
        "rps": result["rps"],
        "rows_per_run": float("nan"),
        "cpu_ms": 1e3 * cpu / max(result["n"], 1),
        "errors": result["errors"],
        "first_error": None,
        "generator": "h2load",
    }


# The C references' rows, by the kind of request: (the row, what serves it); the reference row
# measured beside a protocol's; and the protocols whose CPU is given as a multiple of it (a shm
# request's also has the model read 602 KB that nginx's POST has not).
REFERENCE_ROWS = {
    "image": ("binary HTTP request, nginx only receiving it (C)", Nginx),
    "small": ("a 300-byte POST (a shm request's size), nginx only receiving it (C)", Nginx),
    "grpc": ("gRPC request, grpc's C++ server only receiving it (C++)", GrpcFloor),
}
REFERENCE_OF = {"http": "image", "shm-http": "small", "grpc": "grpc"}
SAME_BYTES = {"http": "image", "grpc": "grpc"}


def nginx_body(kind: str) -> bytes:
    """The bytes an nginx row receives: the binary HTTP rows' body (its JSON header and the image),
    or 300 bytes."""
    if kind == "small":
        return b"{" + b" " * 298 + b"}"
    request = bench.v2_request(bench.BINARY_HTTP, MODEL, image(), 0)
    return request.split(b"\r\n\r\n", 1)[1]


# ---- load generators -----------------------------------------------------------------------------


# h2load processes at once, and gRPC connections each (main: --generators, --grpc-connections)
GENERATORS, GRPC_CONNECTIONS = 1, 1


def h2load_load(
    protocol: str, server: Server, c: int, seconds: float, work: Path, cpus: str | None
) -> dict:
    """GENERATORS h2load processes at once, each with its share of the `c` requests in flight (and
    over gRPC GRPC_CONNECTIONS connections each); their counts added up."""
    which = bench.GRPC if protocol == "grpc" else bench.BINARY_HTTP
    model, x = (MODEL_UINT8, pixels()) if protocol == "http-uint8" else (MODEL, image())
    request = bench.v2_request(which, model, x, server.port)
    shares = [c // GENERATORS + (1 if i < c % GENERATORS else 0) for i in range(GENERATORS)]
    results: list[dict] = [{} for _ in shares]

    def generate(i: int) -> None:
        own = work / f"generator-{i}"
        own.mkdir(exist_ok=True)
        connections = min(GRPC_CONNECTIONS, shares[i])
        results[i] = bench.h2load(
            which,
            request,
            server.port,
            server.grpc_port,
            model,
            shares[i],
            seconds,
            own,
            connections,
        )

    with generator_on(cpus):
        threads = [threading.Thread(target=generate, args=(i,)) for i in range(len(shares))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return {
        "rps": sum(r["rps"] for r in results),
        "n": sum(r["n"] for r in results),
        "errors": sum(r["errors"] for r in results),
    }


def python_load(
    protocol: str, server: Server, c: int, seconds: float, work: Path, cpus: str | None
) -> dict:
    import asyncio

    which = bench.GRPC if protocol == "grpc" else bench.BINARY_HTTP
    model, x = (MODEL_UINT8, pixels()) if protocol == "http-uint8" else (MODEL, image())
    request = bench.v2_request(which, model, x, server.port)

    async def run():
        async with bench.open_clients(which, request, server.port, server.grpc_port, c) as clients:
            return await bench.closed_loop(clients, seconds)

    return asyncio.run(run())


def shm_load(
    protocol: str,
    server: Server,
    c: int,
    seconds: float,
    work: Path,
    cpus: str | None,
    model: str = MODEL,
    x: np.ndarray | None = None,
    out_bytes: int = 40,
) -> dict:
    """c requests in flight from SHM_PROCESSES processes of threads, each thread a tritonclient of
    its own with a region pair of its own: `x` (default the 224x224 image) into `model`'s input
    "input", its "logits" (`out_bytes`) into the other region."""
    x = image() if x is None else x
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    # all set up by then (clients made, regions registered, a first request answered)
    start = time.time() + 4.0
    per = [c // SHM_PROCESSES + (1 if i < c % SHM_PROCESSES else 0) for i in range(SHM_PROCESSES)]
    workers = [
        ctx.Process(
            target=_shm_worker,
            args=(
                protocol,
                server.port,
                server.grpc_port,
                n,
                i,
                start,
                seconds,
                results,
                cpus,
                model,
                x,
                out_bytes,
            ),
        )
        for i, n in enumerate(per)
        if n
    ]
    for w in workers:
        w.start()
    got = [results.get(timeout=seconds + 120) for _ in workers]
    for w in workers:
        w.join(30)
    n, errors = sum(g["n"] for g in got), sum(g["errors"] for g in got)
    first = next((g["first_error"] for g in got if g["first_error"]), None)
    return {"rps": n / seconds, "n": n, "errors": errors, "first_error": first, "started": start}


def _shm_worker(
    protocol: str,
    port: int,
    grpc_port: int,
    threads: int,
    index: int,
    start: float,
    seconds: float,
    results,
    cpus: str | None,
    model: str,
    x: np.ndarray,
    out_bytes: int,
) -> None:
    import threading

    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    import tritonclient.grpc as tg
    import tritonclient.http as th
    import tritonclient.utils.shared_memory as shm

    mod, url = (
        (th, f"127.0.0.1:{port}") if protocol == "shm-http" else (tg, f"127.0.0.1:{grpc_port}")
    )
    counts = {"n": 0, "errors": 0, "first_error": None}
    lock = threading.Lock()
    regions = []

    def client_loop(t: int, ready: threading.Barrier) -> None:
        tag = f"{os.getpid()}-{t}"
        inp = shm.create_shared_memory_region(f"in-{tag}", f"/ingest-in-{tag}", x.nbytes)
        out = shm.create_shared_memory_region(f"out-{tag}", f"/ingest-out-{tag}", out_bytes)
        regions.extend([inp, out])
        shm.set_shared_memory_region(inp, [x])
        client = mod.InferenceServerClient(url)
        client.register_system_shared_memory(f"in-{tag}", f"/ingest-in-{tag}", x.nbytes)
        client.register_system_shared_memory(f"out-{tag}", f"/ingest-out-{tag}", out_bytes)
        request = mod.InferInput("input", list(x.shape), "FP32")
        request.set_shared_memory(f"in-{tag}", x.nbytes)
        wanted = mod.InferRequestedOutput("logits", **({"binary_data": True} if mod is th else {}))
        wanted.set_shared_memory(f"out-{tag}", out_bytes)
        # warm, and a check that it works
        client.infer(model, [request], outputs=[wanted])
        ready.wait()
        time.sleep(max(0.0, start - time.time()))
        n = errors = 0
        first = None
        while time.time() < start + seconds:
            try:
                client.infer(model, [request], outputs=[wanted])
                n += 1
            except Exception as exc:  # noqa: BLE001
                # counted
                errors += 1
                first = first or f"{type(exc).__name__}: {exc}"
        with lock:
            counts["n"] += n
            counts["errors"] += errors
            counts["first_error"] = counts["first_error"] or first
        client.unregister_system_shared_memory(f"in-{tag}")
        client.unregister_system_shared_memory(f"out-{tag}")

    ready = threading.Barrier(threads)
    pool = [threading.Thread(target=client_loop, args=(t, ready)) for t in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    for region in regions:
        shm.destroy_shared_memory_region(region)
    results.put(counts)


def image() -> np.ndarray:
    return np.random.default_rng(1).random(SHAPE, dtype=np.float32)


def pixels() -> np.ndarray:
    """The same image as UINT8 pixel values (150 KB)."""
    return np.rint(image() * 255).astype(np.uint8)


# ---- measuring -----------------------------------------------------------------------------------


def measure(
    protocol: str, server: Server, c: int, seconds: float, work: Path, cpus: str | None
) -> dict:
    if protocol.startswith("shm"):
        load = shm_load
    else:
        load = h2load_load if shutil.which("h2load") else python_load
    # warm (h2load: its first seconds)
    load(protocol, server, c, min(2.0, seconds), work, cpus)
    bench.wait_until_idle(server.port)
    runs0, rows0 = server.batches()
    pid = server.proc.pid
    cpu0 = processes_cpu(pid)
    result = load(protocol, server, c, seconds, work, cpus)
    # the shm load began at a set time: the server's CPU is counted from its start
    if "started" in result:
        cpu0 = processes_cpu(pid) if time.time() < result["started"] else cpu0
    cpu1 = processes_cpu(pid)
    # (each process that lived through the round: a front end replaced meanwhile would be left out)
    spent = {p: cpu1[p] - cpu0[p] for p in cpu1 if p in cpu0}
    cpu = sum(spent.values())
    front_ends = [spent[p] for p in sorted(spent) if p != pid and listening(p, server.port)]
    runs1, rows1 = server.batches()
    n = max(result["n"], 1)
    return {
        "rps": result["rps"],
        "rows_per_run": (rows1 - rows0) / max(runs1 - runs0, 1),
        "cpu_ms": 1e3 * cpu / n,
        "engine_share": spent[pid] / cpu if cpu else float("nan"),
        "shares": [f / sum(front_ends) for f in front_ends] if sum(front_ends) else [],
        "errors": result["errors"],
        "first_error": result.get("first_error"),
        "generator": "h2load"
        if load is h2load_load
        else ("tritonclient" if load is shm_load else "python"),
    }


def measure_references(
    kinds: list[str], work: Path, cpus: str | None, load_cpus: str | None, args
) -> dict:
    """{kind: medians (and errors)} of the C references receiving each kind of request
    (REFERENCE_ROWS), pinned as the server was; a reference that can't be run here is left out (said
    why)."""
    found = {}
    for reference in dict.fromkeys(REFERENCE_ROWS[kind][1] for kind in kinds):
        theirs = [kind for kind in kinds if REFERENCE_ROWS[kind][1] is reference]
        why_not = reference.missing()
        if why_not:
            print(f"  (no {reference.__name__} rows: {why_not})")
            continue
        with reference(work, cpus, theirs) as server:
            for kind in theirs:
                runs = [
                    server.measure(kind, args.concurrency, args.seconds, work, load_cpus)
                    for _ in range(args.rounds)
                ]
                found[kind] = med = bench.medians(runs, MEDIANS)
                each = ", ".join(f"{1e3 * r['cpu_ms']:.0f}" for r in runs)
                print(
                    f"  {REFERENCE_ROWS[kind][0]:<26} {med['rps']:7.0f} req/s  {med['cpu_ms']:.3f} ms CPU/request  "
                    f"(rounds: {each} us)",
                    flush=True,
                )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--protocols", default=",".join(PROTOCOLS), help=f"of {', '.join(PROTOCOLS)}"
    )
    parser.add_argument(
        "--cores",
        default="1",
        help="the server on this many cores and the generator on the others, or on all of them "
        "(shared with the generator): one count or several, e.g. 1,2 on 2 cores, or 8 of 16 "
        "for the front ends' scaling",
    )
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--image",
        default="3x224x224",
        metavar="CxHxW",
        help="the image a request sends (default ResNet-50's 3x224x224, 602 KB)",
    )
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one round of 3 s")
    parser.add_argument(
        "--server-args", default="", help="more flags for the server (its defaults otherwise)"
    )
    parser.add_argument(
        "--front-ends",
        metavar="N,N,...",
        help="a server of each of these counts of front-end processes (--front-ends N), started "
        "together, the rounds alternating between them",
    )
    parser.add_argument(
        "--generators",
        type=int,
        help="h2load processes sending at once (default 2 with --front-ends, else 1)",
    )
    parser.add_argument(
        "--grpc-connections",
        type=int,
        help="gRPC connections of each h2load process (default 8 with --front-ends, else 1)",
    )
    parser.add_argument(
        "--against",
        type=Path,
        metavar="DIR",
        help="another checkout whose server runs beside this "
        "tree's, the rounds alternating between them (see the module's docstring)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds = 1, 3.0
    global GENERATORS, GRPC_CONNECTIONS
    counts: list[int | None] = [None]
    if args.front_ends:
        if args.against is not None:
            parser.error("--front-ends compares counts of this tree's front ends: no --against")
        try:
            counts = [int(n) for n in args.front_ends.split(",")]
        except ValueError:
            parser.error(f"--front-ends {args.front_ends}: give counts like 1,2")
    GENERATORS = args.generators or (2 if args.front_ends else 1)
    GRPC_CONNECTIONS = args.grpc_connections or (8 if args.front_ends else 1)
    protocols = [p.strip() for p in args.protocols.split(",") if p.strip()]
    unknown = [p for p in protocols if p not in PROTOCOLS]
    if unknown:
        parser.error(f"unknown protocol(s) {unknown}; choose among {', '.join(PROTOCOLS)}")
    global SHAPE
    try:
        SHAPE = (1, *(int(n) for n in args.image.lower().split("x")))
        if len(SHAPE) != 4 or min(SHAPE) < 1:
            raise ValueError
    except ValueError:
        parser.error(f"--image {args.image}: give channels x height x width, e.g. 3x224x224")
    ncpu = len(os.sched_getaffinity(0))
    cores_counts = [c.strip() for c in args.cores.split(",")]
    if not all(c.isdigit() and 1 <= int(c) <= ncpu for c in cores_counts):
        parser.error(f"--cores {args.cores}: give counts of cores from 1 to {ncpu}, like 1,2")
    work = Path(tempfile.mkdtemp(prefix="ingest-"))
    models = {MODEL: work / "trivial.onnx", MODEL_UINT8: work / "trivial_uint8.onnx"}
    trivial_model(models[MODEL])
    trivial_model(models[MODEL_UINT8], uint8=True)
    if args.against is not None and not (args.against / "serving" / "__main__.py").is_file():
        parser.error(
            f"--against {args.against}: not a checkout of this project (no serving/__main__.py there)"
        )
    roots = [ROOT] if args.against is None else [ROOT, args.against.resolve()]
    # a C reference's CPU ms per request, by the kind of request (REFERENCE_ROWS)
    rows, reference_ms = (
        [],
        {},
    )
    layout = "?"
    for cores in cores_counts:
        # the server on the last `cores` CPUs and the generator on the others; or, with them all,
        # everything shared
        if int(cores) < ncpu:
            server_cpus = ",".join(map(str, range(ncpu - int(cores), ncpu)))
            load_cpus = ",".join(map(str, range(ncpu - int(cores))))
            cores_text = f"{cores} core{'s' if int(cores) > 1 else ''}"
        else:
            server_cpus = load_cpus = None
            cores_text = f"{ncpu} cores (shared)"
        for protocol in protocols:
            # A server of the one model the row sends to, as a server of one model is run: with
            # several, a gRPC message still on its way (which names its model inside) makes no
            # model's batch wait for it (Server.incoming).
            model = MODEL_UINT8 if protocol == "http-uint8" else MODEL
            with contextlib.ExitStack() as servers:
                started = [
                    servers.enter_context(
                        Server(
                            {model: models[model]},
                            work,
                            server_cpus,
                            args.server_args.split(),
                            root=root,
                            front_ends=count,
                        )
                    )
                    for root in roots
                    for count in counts
                ]
                runs: dict[int, list[dict]] = {i: [] for i in range(len(started))}
                # alternating, each server first every other round
                for round_ in range(args.rounds):
                    for i in (
                        range(len(started)) if round_ % 2 == 0 else reversed(range(len(started)))
                    ):
                        runs[i].append(
                            measure(
                                protocol,
                                started[i],
                                args.concurrency,
                                args.seconds,
                                work,
                                load_cpus,
                            )
                        )
                for i, server in enumerate(started):
                    med = bench.medians(runs[i], MEDIANS)
                    errors = med["errors"]
                    code = (
                        ""
                        if args.against is None
                        else ("this tree, " if server.root == ROOT else f"{server.root}, ")
                    )
                    if server.front_ends is not None:
                        code += f"{server.front_ends} front end{'s' * (server.front_ends != 1)}, "
                        med["shares"] = [
                            float(np.median([r["shares"][j] for r in runs[i]]))
                            for j in range(min(len(r["shares"]) for r in runs[i]))
                        ]
                        med["engine_share"] = float(np.median([r["engine_share"] for r in runs[i]]))
                    rows.append(
                        (
                            PROTOCOLS[protocol],
                            code + cores_text,
                            runs[i][0]["generator"],
                            med,
                            errors,
                            next((r["first_error"] for r in runs[i] if r["first_error"]), None),
                            (SAME_BYTES.get(protocol), cores_text) if server_cpus else None,
                        )
                    )
                    each = ", ".join(f"{1e3 * r['cpu_ms']:.0f}" for r in runs[i])
                    print(
                        f"  {rows[-1][0]:<26} {rows[-1][1]:<18} {med['rps']:7.0f} req/s  "
                        f"{med['rows_per_run']:5.1f} rows/run  {med['cpu_ms']:.3f} ms CPU/request  errors {errors}  "
                        f"(rounds: {each} us){shares_text(med)}",
                        flush=True,
                    )
                if model == MODEL:
                    layout = started[0].layout()
        kinds = (
            list(dict.fromkeys(REFERENCE_OF[p] for p in protocols if p in REFERENCE_OF))
            if server_cpus
            else []
        )
        for kind, med in measure_references(kinds, work, server_cpus, load_cpus, args).items():
            reference_ms[kind, cores_text] = med["cpu_ms"]
            rows.append(
                (REFERENCE_ROWS[kind][0], cores_text, "h2load", med, med["errors"], None, None)
            )
    print(f"\nServer (default settings, the FP32 model's): {layout}")
    print(
        f"Model: {'x'.join(map(str, SHAPE))} FP32 ({4 * int(np.prod(SHAPE)) / 1e3:.0f} KB; UINT8 "
        f"{int(np.prod(SHAPE)) / 1e3:.0f} KB, "
        "cast and scaled) -> ReduceMean -> MatMul -> 10 logits; "
        f"c={args.concurrency}, {args.rounds} round(s) of {args.seconds:g} s, medians\n"
    )
    generator_text = (f"{GENERATORS} h2load processes" if GENERATORS > 1 else "h2load") + (
        f", gRPC on {GRPC_CONNECTIONS} connections each" if GRPC_CONNECTIONS > 1 else ""
    )
    print(
        "| protocol | server on | load generator | req/s | rows per run | server CPU ms per "
        "request | x the C reference's CPU, same bytes | engine's share of the CPU | each front "
        "end's share of the front ends' CPU | errors |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, where, generator, med, errors, first, kind in rows:
        times = f"{med['cpu_ms'] / reference_ms[kind]:.2f}" if kind in reference_ms else ""
        batches = "" if np.isnan(med["rows_per_run"]) else f"{med['rows_per_run']:.1f}"
        engine = f"{100 * med['engine_share']:.0f}%" if "engine_share" in med else ""
        shares = " / ".join(f"{100 * share:.0f}%" for share in med.get("shares", []))
        if generator == "h2load":
            generator = generator_text
        print(
            f"| {name} | {where} | {generator} | {med['rps']:.0f} | {batches} | {med['cpu_ms']:.3f} | "
            f"{times} | {engine} | {shares} | {errors}{' (' + first[:80] + ')' if first else ''} |"
        )
    if len(counts) > 1:
        print()
        # each protocol on each count of cores: its front-end counts against the first
        for name, cores_text in dict.fromkeys((row[0], row[1].split(", ")[-1]) for row in rows):
            mine = [
                row
                for row in rows
                if row[0] == name and row[1].endswith(", " + cores_text) and "front end" in row[1]
            ]
            if len(mine) < 2:
                continue
            first = mine[0][3]
            for what, key in (("CPU per request", "cpu_ms"), ("req/s", "rps")):
                said = ", ".join(
                    f"{row[1].split(',')[0]} {row[3][key] / first[key]:.2f}x" for row in mine[1:]
                )
                print(f"{name}, {cores_text}: {what} against {mine[0][1].split(',')[0]}'s: {said}")
    return 0


def shares_text(med: dict) -> str:
    """With front ends: the engine's share of the server's CPU and each front end's of theirs."""
    if "engine_share" not in med:
        return ""
    shares = "/".join(f"{100 * share:.0f}%" for share in med.get("shares", []))
    return f"  engine {100 * med['engine_share']:.0f}% of the CPU, front ends {shares} of theirs"


if __name__ == "__main__":
    sys.exit(main())
