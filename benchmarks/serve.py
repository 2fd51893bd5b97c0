"""Serving benchmarks: our server against others, its three protocols, one model under another's
flood.

Three measurements, chosen by flag: our server against in-process onnxruntime and
`mlflow models serve`; our server's three protocols against each other; what one model's flood does
to another model's latency.

--servers (the default when no other measurement is asked). Same models (the 28x28 small-image
ResNet-18 and a tiny MLP, random weights), same load generator (wrk, Debian package `wrk`), the same
JSON request of one image ({"inputs": [1x1x28x28]}) to every server's /invocations, at concurrency 1
and 32. Reports requests/s and p50/p99 latency of:
  (a) onnxruntime in-process, at batch 1 and at the server's max batch size (a call is one batch);
  (b) our server (python -m serving);
  (c) `mlflow models serve --env-manager local` of the same model saved with the PyTorch flavor and
      with the ONNX flavor.

--protocols. The ResNet (--protocol-models) on one server that also serves gRPC (--grpc-port), one
image a request, at concurrency 1 and 32, over (b) V2 JSON over HTTP, V2 binary over HTTP (Triton's
binary tensor extension, binary outputs too) and V2 over gRPC (ModelInfer, raw_input_contents); (a)
in-process onnxruntime at batch 1 and 32 is the reference. Every request asks for all outputs. All
three protocols are driven by ONE load generator, so that the client's cost is alike: a Python
asyncio closed loop of N workers for S seconds; over HTTP each worker is one raw keep-alive HTTP/1.1
connection (prebuilt request bytes; the status line and headers read up to the blank line, then
Content-Length bytes), over gRPC the N workers share one grpc.aio channel (HTTP/2 streams, as a gRPC
client does) and send prebuilt serialized ModelInferRequest bytes (no serializers). Each protocol's
first answer is checked against the torch model's output; the note gives the mean batch and the CPU
ms per request of the generator and of the server. The Python generator costs much more CPU per
request than wrk and runs on the same 2 cores as the server: its numbers are lower than wrk's, and
only rows of one run compare. The ResNet's run dwarfs what a protocol costs;
`--protocol-models resnet18,mlp` adds the tiny MLP, where the protocols' own costs show. Where
`h2load` is installed (Debian package nghttp2-client), binary HTTP and gRPC at c=32 are also driven
by it, a C client whose own cost is small: rows (b'), which tell whether the Python generator is
what limits a protocol (what they told: docs/benchmarks.md#benchmarksservepy).

--two-models. One server with `--model flooded=resnet18.onnx --model probed=mlp.onnx` (each model
its own batcher; the one engine thread takes the models' runs in turn). A probe of single-image
binary V2 HTTP requests (sequential: the Python generator at concurrency 1, --probes of them)
measures p50/p99 of
  (a) `probed` with no other load;
  (b) `probed` while wrk floods `flooded` at concurrency 32 (JSON V2 POSTs to
      /v2/models/flooded/infer);
  (c) the baseline, what per-model batchers and turn-taking buy: the probe sent to `flooded` itself
      during the same flood, where it waits in the flood's queue; (a') is that probe with no load.
The flood's own req/s (wrk's, over the probe's time) is printed with (b) and (c); after a flood the
server drains before the next scenario. From the server's histograms: the probed model's mean queue
time (until the engine thread began its run; in (a') and (c) those requests are mostly the flood's)
and the flooded model's mean run time and rows: in (b) a probe waits for at most the flooded model's
run in progress, and a sequential probe, sent just after its last answer, tends to arrive as one
begins.

    python benchmarks/serve.py                          # --servers: ~7 min on 2 cores, 3 rounds,
                                                        medians
    python benchmarks/serve.py --quick                  # ~1 min: one round of short runs, the ResNet only
    python benchmarks/serve.py --protocols              # ~2.5 min: 3 rounds of 5 s runs, medians
    python benchmarks/serve.py --two-models             # ~4.5 min: 3 rounds of 300 probes a scenario
    python benchmarks/serve.py --protocols --two-models --quick   # ~2-3 min: one round, 3 s runs, 200 probes
    python benchmarks/serve.py --servers --protocols --protocol-models resnet18,mlp   # any combination

All systems of a measurement run at once and are measured in turns, round after round, so that other
work on the machine hits every system alike; wrk and the Python generator take CPU too. Compare rows
within one run, never with numbers from another machine.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import requests

ROOT = Path(__file__).resolve().parents[1]
# name -> (the built-in model component, its args): 28x28 one-channel images, 10 classes
MODELS = {
    "resnet18": (
        "pipeline.models:resnet18",
        {"num_classes": 10, "in_channels": 1, "width": 1.0, "mean": [0.286], "std": [0.353]},
    ),
    "mlp": (
        "pipeline.models:mlp",
        {
            "num_classes": 10,
            "in_channels": 1,
            "image_size": 28,
            "hidden": [64],
            "mean": [0.286],
            "std": [0.353],
        },
    ),
}
MAX_BATCH = 32


# ---- models -----------------------------------------------------------------------------------


def build_and_export(name: str, out_dir: Path):
    """The torch module (eval) and its ONNX file, exported the way `pipeline export` does."""
    import onnx
    import torch

    from pipeline.components.build import ModelSpec, instantiate_model

    torch.manual_seed(0)
    model = instantiate_model(ModelSpec(*MODELS[name])).eval()
    sample = torch.rand(2, 1, 28, 28)
    path = out_dir / f"{name}.onnx"
    # A CNN in eval mode: its rows are its samples' own, said as export would record it (the server
    # batches only a model whose rows are known to be independent).
    metadata = {"trainserve.model_name": name, "trainserve.rows_independent": "by construction"}
    try:
        from pipeline.artifact.onnx_export import ExportHead, export
        from pipeline.tasks.classification import Classification

        head = ExportHead(model, Classification(None, 5, num_classes=10), ["input"], True)
        # saves it too
        export(head, {"input": sample}, {}, 18, metadata, path)
    except ImportError:
        # the exporter module is not there: the same graph by hand
        onnx.save(_export_locally(model, sample, metadata), str(path))
    return model, path


def _export_locally(model, sample, metadata):
    import onnx
    import torch

    class WithProbabilities(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            logits = self.m(x)
            return logits, torch.softmax(logits, dim=1)

    program = torch.onnx.export(
        WithProbabilities(model),
        (sample,),
        dynamo=True,
        input_names=["input"],
        output_names=["logits", "probabilities"],
        dynamic_shapes={"x": {0: torch.export.Dim("batch")}},
    )
    proto = program.model_proto
    onnx.helper.set_model_props(proto, metadata)
    return proto


# ---- (a) in-process ---------------------------------------------------------------------------


def bench_inprocess(path: Path, batch: int, seconds: float) -> dict:
    """Our Engine called directly: the same onnxruntime session and options the server uses."""
    from serving.engine import Engine

    engine = Engine(str(path), device="cpu")
    feeds = {"input": np.random.default_rng(0).random((batch, 1, 28, 28), dtype=np.float32)}
    for _ in range(5):
        engine.run(feeds)
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 10:
        t = time.perf_counter()
        engine.run(feeds)
        times.append(time.perf_counter() - t)
    times = np.asarray(times)
    return {
        "rps": batch * len(times) / times.sum(),
        "p50": np.percentile(times, 50) * 1e3,
        "p99": np.percentile(times, 99) * 1e3,
        "errors": 0,
    }


# ---- servers and load -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess in its own process group; stopped (group-wide, by PID) on exit."""

    def __init__(
        self, cmd: list[str], port: int, ready_path: str, log: Path, env: dict | None = None
    ):
        self.cmd, self.port, self.ready_path, self.log = cmd, port, ready_path, log
        # mlflow serve execs `uvicorn` from PATH: the venv's bin must be on it
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        self.env = {**os.environ, "PATH": path, **(env or {})}

    def __enter__(self):
        self.out = open(self.log, "wb")
        self.proc = subprocess.Popen(
            self.cmd,
            cwd=ROOT,
            env=self.env,
            stdout=self.out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.cmd[:3]} exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}"
                )
            try:
                if requests.get(f"http://127.0.0.1:{self.port}{self.ready_path}", timeout=1).ok:
                    return self
            except requests.ConnectionError:
                pass
            time.sleep(0.25)
        self.__exit__()
        raise RuntimeError(f"{self.cmd[:3]} not ready:\n{self.log.read_text()[-3000:]}")

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            # mlflow serve starts uvicorn workers: the group
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.out.close()


def wrk(url: str, body_path: Path, concurrency: int, seconds: float) -> dict:
    out = subprocess.run(
        wrk_command(url, body_path, concurrency, seconds),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return parse_wrk(out)


@contextlib.contextmanager
def flood(url: str, body_path: Path, concurrency: int, limit_s: float = 600):
    """wrk in the background for as long as the block runs (at most limit_s): SIGINT stops it and it
    prints its summary, parsed into the yielded dict once the block ends."""
    proc = subprocess.Popen(
        wrk_command(url, body_path, concurrency, limit_s),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    result: dict = {}
    try:
        yield result
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
    if proc.returncode != 0 and "Requests/sec" not in out:
        raise RuntimeError(f"wrk exited {proc.returncode}: {err[-2000:]}")
    result.update(parse_wrk(out))


def wrk_command(url: str, body_path: Path, concurrency: int, seconds: float) -> list[str]:
    """wrk POSTing the JSON file body_path to url (a lua script beside it says so)."""
    script = body_path.with_suffix(".lua")
    script.write_text(
        f'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.body = io.open("{body_path}", "rb"):read("*a")\n'
    )
    threads = min(concurrency, 2)
    return [
        "wrk",
        f"-t{threads}",
        f"-c{concurrency}",
        f"-d{max(1, round(seconds))}s",
        "--timeout",
        "10s",
        "--latency",
        "-s",
        str(script),
        url,
    ]


def parse_wrk(out: str) -> dict:
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    errors = int(m.group(1)) if (m := re.search(r"Non-2xx or 3xx responses: (\d+)", out)) else 0
    if m := re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out):
        errors += sum(int(g) for g in m.groups())
    return {"rps": rps, "p50": _latency(out, "50%"), "p99": _latency(out, "99%"), "errors": errors}


def _latency(out: str, pct: str) -> float:
    value, unit = re.search(rf"^\s+{re.escape(pct)}\s+([\d.]+)(us|ms|s)\s*$", out, re.M).groups()
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]


def batch_stats(port: int, model: str | None = None) -> tuple[float, float]:
    """(rows, model runs) so far, from the server's batch-size histogram: summed over every model
    and version, or over one model's versions."""
    return histogram(port, "trainserve_batch_size", model)


def histogram(port: int, name: str, model: str | None = None) -> tuple[float, float]:
    """(sum, count) of one of the server's histograms, over all its label sets
    ({model="...",version="...", ...}) or those of one model."""
    text = requests.get(f"http://127.0.0.1:{port}/metrics").text
    return series_total(text, f"{name}_sum", model), series_total(text, f"{name}_count", model)


def series_total(text: str, series: str, model: str | None = None) -> float:
    """One series of a /metrics text summed over its label sets, or over those of one model."""
    found = re.findall(rf"^{series}(\{{.*\}})? ([\d.e+-]+)$", text, re.M)
    return sum(
        float(value) for labels, value in found if model is None or f'model="{model}"' in labels
    )


def wait_until_idle(port: int, quiet: float = 0.5, timeout: float = 60) -> None:
    """Until nothing is queued and no model ran for `quiet` seconds: the requests a stopped flood
    left in the server are answered before the next measurement begins."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        text = requests.get(f"http://127.0.0.1:{port}/metrics").text
        now = (
            series_total(text, "trainserve_batch_size_count"),
            series_total(text, "trainserve_queue_rows"),
        )
        if now == last and now[1] == 0:
            return
        last = now
        time.sleep(quiet)
    raise RuntimeError(f"the server is still busy {timeout:g} s after the load stopped")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads."""
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def check_prediction(port: int, body: bytes, want: np.ndarray) -> None:
    """The server answers what the torch model does; the first requests also warm it up (a pt2
    model compiles on its first call)."""
    for _ in range(5):
        r = requests.post(
            f"http://127.0.0.1:{port}/invocations",
            data=body,
            headers={"Content-Type": "application/json"},
            timeout=120,
        )
        r.raise_for_status()
    got = r.json()["predictions"]
    got = got["logits"] if isinstance(got, dict) else got
    np.testing.assert_allclose(
        np.asarray(got, np.float32).reshape(want.shape), want, rtol=1e-3, atol=1e-4
    )


# ---- the Python load generator (--protocols, --two-models) -------------------------------------

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
MODEL_STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"


class CallFailed(Exception):
    """An answer that is an error: an HTTP status other than 200, a gRPC status other than OK."""


class HttpConnection:
    """A minimal keep-alive HTTP/1.1 client on asyncio streams that sends one prebuilt request over
    and over: the status line and headers are read up to the blank line, then Content-Length bytes
    of body. The connection is opened on the first call, and again after a failure or a
    `Connection: close`."""

    def __init__(self, port: int, request: bytes):
        self.port, self.request = port, request
        self.reader = self.writer = None

    async def call(self) -> tuple[bytes, bytes]:
        """(status line and headers, body) of one answer."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            self.writer.write(self.request)
            head = await self.reader.readuntil(b"\r\n\r\n")
            length = re.search(rb"\r\ncontent-length:[ \t]*(\d+)", head, re.I)
            body = await self.reader.readexactly(int(length.group(1)) if length else 0)
        except BaseException:
            self.close()
            raise
        if re.search(rb"\r\nconnection:[ \t]*close", head, re.I):
            self.close()
        if not head.startswith((b"HTTP/1.1 200 ", b"HTTP/1.0 200 ")):
            status = head.split(b"\r\n", 1)[0].decode("latin-1")
            raise CallFailed(f"{status}: {body[:300].decode('latin-1')}")
        return head, body

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.reader = self.writer = None


class GrpcCall:
    """ModelInfer with one prebuilt serialized request, on a shared grpc.aio channel (no
    serializers: bytes in and out)."""

    def __init__(self, channel, request: bytes):
        self.infer = channel.unary_unary(
            MODEL_INFER, request_serializer=None, response_deserializer=None
        )
        self.request = request

    async def call(self) -> tuple[bytes, bytes]:
        """(b"", the serialized ModelInferResponse) of one answer."""
        import grpc

        try:
            return b"", await self.infer(self.request, timeout=60)
        except grpc.aio.AioRpcError as exc:
            raise CallFailed(f"gRPC {exc.code().name}: {exc.details()}") from None


class GrpcStream:
    """ModelStreamInfer: the workers share one stream (as tritonclient's
    start_stream/async_stream_infer); each call writes the prebuilt request and waits for its
    answer, the server answering in the order of requests."""

    def __init__(self, channel, request: bytes):
        self.stream = channel.stream_stream(
            MODEL_STREAM_INFER, request_serializer=None, response_deserializer=None
        )()
        self.request = request
        self.waiting: collections.deque = collections.deque()
        # one write at a time on a stream
        self.writing = asyncio.Lock()
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        error = CallFailed("the stream ended")
        try:
            async for data in self.stream:
                self.waiting.popleft().set_result(data)
        except Exception as exc:  # noqa: BLE001
            # every waiting call learns it
            error = CallFailed(f"the stream failed: {exc}")
        while self.waiting:
            self.waiting.popleft().set_exception(error)

    async def call(self) -> tuple[bytes, bytes]:
        """(b"", the serialized ModelStreamInferResponse) of one answer."""
        answer = asyncio.get_running_loop().create_future()
        async with self.writing:
            self.waiting.append(answer)
            await self.stream.write(self.request)
        data = await answer
        # field 1, error_message, comes first when set
        if data[:1] == b"\x0a":
            raise CallFailed(f"gRPC stream: {data[2:300].decode(errors='replace')}")
        return b"", data

    async def close(self) -> None:
        await self.stream.done_writing()
        await self.reader


async def closed_loop(
    clients: list, seconds: float | None = None, count: int | None = None, keep_times: bool = False
) -> dict:
    """Each client is one worker that sends its next request as soon as its last answer came, for
    `seconds` or until `count` answers in all: answers/s, p50/p99 ms of the good answers, errors
    (and the first), and this process's CPU ms per request (the generator's cost, gRPC's own threads
    included); with `keep_times`, every good answer's ms too (times_ms: to merge several processes'
    percentiles)."""
    times: list[float] = []
    errors: list[str] = []
    cpu = time.process_time()
    start = time.perf_counter()
    deadline = start + (seconds if seconds is not None else float("inf"))
    budget = count if count is not None else float("inf")

    async def worker(client) -> None:
        while time.perf_counter() < deadline and len(times) + len(errors) < budget:
            t = time.perf_counter()
            try:
                await client.call()
            except (
                CallFailed,
                OSError,
                asyncio.IncompleteReadError,
                asyncio.LimitOverrunError,
            ) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            times.append(time.perf_counter() - t)

    await asyncio.gather(*(worker(c) for c in clients))
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu
    ms = np.asarray(times or [float("nan")]) * 1e3
    return {
        "rps": len(times) / elapsed,
        "p50": float(np.percentile(ms, 50)),
        "p99": float(np.percentile(ms, 99)),
        "errors": len(errors),
        "n": len(times),
        "first_error": errors[0] if errors else None,
        "client_cpu_ms": cpu * 1e3 / max(len(times) + len(errors), 1),
        **({"times_ms": np.asarray(times) * 1e3} if keep_times else {}),
    }


@contextlib.asynccontextmanager
async def open_clients(protocol: str, request: bytes, port: int, grpc_port: int | None, n: int):
    """n workers' clients for one protocol: n HTTP connections, or n calls on one gRPC channel."""
    if protocol == GRPC:
        import grpc

        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            yield [GrpcCall(channel, request) for _ in range(n)]
        return
    if protocol == GRPC_STREAM:
        import grpc

        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stream = GrpcStream(channel, request)
            yield [stream] * n
            await stream.close()
        return
    connections = [HttpConnection(port, request) for _ in range(n)]
    try:
        yield connections
    finally:
        for connection in connections:
            connection.close()


# ---- requests and answers of the three protocols ----------------------------------------------

JSON_HTTP, BINARY_HTTP, GRPC = "V2 JSON over HTTP", "V2 binary over HTTP", "V2 over gRPC"
GRPC_STREAM = "V2 over gRPC, one stream"
PROTOCOLS = (JSON_HTTP, BINARY_HTTP, GRPC, GRPC_STREAM)
GRPCS = (GRPC, GRPC_STREAM)
# requests in one ModelStreamInfer stream sent by h2load
STREAM_REQUESTS = 100


def http_request(port: int, path: str, body: bytes, headers: dict[str, str]) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        f"Content-Length: {len(body)}",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return "\r\n".join(lines).encode() + b"\r\n\r\n" + body


def v2_json_body(x: np.ndarray) -> bytes:
    return json.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "shape": list(x.shape),
                    "datatype": "FP32",
                    "data": x.reshape(-1).tolist(),
                }
            ]
        }
    ).encode()


def v2_request(protocol: str, model: str, x: np.ndarray, port: int) -> bytes:
    """The bytes of one request for `model` of one image x: an HTTP request, or a serialized
    ModelInferRequest (serving/grpc/schema.py's message; the wire format is KServe's)."""
    if protocol == JSON_HTTP:
        return http_request(
            port, f"/v2/models/{model}/infer", v2_json_body(x), {"Content-Type": "application/json"}
        )
    # (an image as pixel values: a uint8 variant's input)
    datatype = "UINT8" if x.dtype == np.uint8 else "FP32"
    raw = (
        np.ascontiguousarray(x) if datatype == "UINT8" else np.ascontiguousarray(x, "<f4")
    ).tobytes()
    if protocol == BINARY_HTTP:
        header = json.dumps(
            {
                "inputs": [
                    {
                        "name": "input",
                        "shape": list(x.shape),
                        "datatype": datatype,
                        "parameters": {"binary_data_size": len(raw)},
                    }
                ],
                "parameters": {"binary_data_output": True},
            }
        ).encode()
        return http_request(
            port,
            f"/v2/models/{model}/infer",
            header + raw,
            {
                "Content-Type": "application/octet-stream",
                "Inference-Header-Content-Length": str(len(header)),
            },
        )
    from serving.grpc import schema

    request = schema.ModelInferRequest(model_name=model)
    request.inputs.add(name="input", datatype=datatype, shape=list(x.shape))
    request.raw_input_contents.append(raw)
    return request.SerializeToString()


def answer_logits(protocol: str, head: bytes, body: bytes) -> np.ndarray:
    """The `logits` output of one answer of the protocol."""
    if protocol == JSON_HTTP:
        out = next(o for o in json.loads(body)["outputs"] if o["name"] == "logits")
        return np.asarray(out["data"], np.float32).reshape(out["shape"])
    if protocol == BINARY_HTTP:
        length = int(
            re.search(rb"\r\ninference-header-content-length:[ \t]*(\d+)", head, re.I).group(1)
        )
        offset = length
        for out in json.loads(body[:length])["outputs"]:
            size = out["parameters"]["binary_data_size"]
            if out["name"] == "logits":
                return np.frombuffer(body[offset : offset + size], "<f4").reshape(out["shape"])
            offset += size
        raise KeyError("no logits output")
    from serving.grpc import schema

    response = (
        schema.ModelStreamInferResponse.FromString(body).infer_response
        if protocol == GRPC_STREAM
        else schema.ModelInferResponse.FromString(body)
    )
    for i, out in enumerate(response.outputs):
        if out.name == "logits":
            data = (
                np.frombuffer(response.raw_output_contents[i], "<f4")
                if response.raw_output_contents
                else np.asarray(out.contents.fp32_contents, np.float32)
            )
            return data.reshape(list(out.shape))
    raise KeyError("no logits output")


async def check_answer(protocol: str, client, want: np.ndarray, warm: int = 5) -> str:
    """The first answer against the torch model's output (as check_prediction), then `warm` more
    requests to warm the path up; what was found, in words (a failure is reported, not raised)."""
    try:
        head, body = await client.call()
        got = answer_logits(protocol, head, body)
        np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-3, atol=1e-4)
    except AssertionError:
        return f"answer != torch (max abs diff {np.abs(got.reshape(want.shape) - want).max():.2g})"
    except Exception as exc:  # noqa: BLE001
        # reported in the table; the run goes on
        return f"first request failed: {type(exc).__name__}: {exc}"[:300]
    for _ in range(warm):
        with contextlib.suppress(CallFailed):
            await client.call()
    return "answer == torch"


# ---- main -------------------------------------------------------------------------------------


def run_model(name: str, work: Path, seconds: float, rounds: int, mlflow_servers: bool) -> list:
    """All servers up at once, then `rounds` rounds that measure every system in turn; the median
    of each is reported. On a machine shared with other work, noise then hits every system alike."""
    import mlflow
    import onnx
    import torch

    model, onnx_path = build_and_export(name, work)
    x = np.random.default_rng(1).random((1, 1, 28, 28), dtype=np.float32)
    body = work / f"{name}.json"
    body.write_bytes(json.dumps({"inputs": x.tolist()}).encode())
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()

    # system -> (Server, port)
    servers = {}
    port = free_port()
    servers["(b) trainserve (python -m serving)"] = (
        Server(
            [
                sys.executable,
                "-m",
                "serving",
                "--model",
                str(onnx_path),
                "--port",
                str(port),
                "--max-batch-size",
                str(MAX_BATCH),
                "--log-level",
                "warning",
            ],
            port,
            "/v2/health/ready",
            work / f"ours-{name}.log",
        ),
        port,
    )
    if mlflow_servers:
        flavors = {
            "(c) mlflow models serve, pytorch flavor": lambda p: mlflow.pytorch.save_model(
                model, p, input_example=x, pip_requirements=["torch"]
            ),
            "(c) mlflow models serve, onnx flavor": lambda p: mlflow.onnx.save_model(
                onnx.load(str(onnx_path)), p, input_example=x, pip_requirements=["onnxruntime"]
            ),
        }
        for system, save in flavors.items():
            path = work / f"mlflow-{name}-{system.split(',')[1].split()[0]}"
            save(str(path))
            port = free_port()
            servers[system] = (
                Server(
                    [
                        sys.executable,
                        "-m",
                        "mlflow",
                        "models",
                        "serve",
                        "-m",
                        str(path),
                        "--env-manager",
                        "local",
                        "-h",
                        "127.0.0.1",
                        "-p",
                        str(port),
                    ],
                    port,
                    "/ping",
                    work / f"{path.name}.log",
                ),
                port,
            )

    samples: dict[tuple[str, object], list[dict]] = {}
    notes: dict[tuple[str, object], list[float]] = {}
    with contextlib.ExitStack() as stack:
        for system, (server, port) in servers.items():
            stack.enter_context(server)
            check_prediction(port, body.read_bytes(), want)
        for round_ in range(rounds):
            for batch in (1, MAX_BATCH):
                key = (f"(a) onnxruntime in-process, batch {batch}", "-")
                samples.setdefault(key, []).append(bench_inprocess(onnx_path, batch, seconds))
            for system, (_, port) in servers.items():
                ours = system.startswith("(b)")
                for c in (1, 32):
                    before = batch_stats(port) if ours else None
                    r = wrk(f"http://127.0.0.1:{port}/invocations", body, c, seconds)
                    samples.setdefault((system, c), []).append(r)
                    if ours:
                        after = batch_stats(port)
                        notes.setdefault((system, c), []).append(
                            (after[0] - before[0]) / max(after[1] - before[1], 1)
                        )
                    print(
                        f"  round {round_ + 1}/{rounds} {name:8s} {system:40s} c={c:<3d} {r['rps']:8.1f} req/s  "
                        f"p50 {r['p50']:7.2f} ms  p99 {r['p99']:7.2f} ms",
                        file=sys.stderr,
                        flush=True,
                    )
    rows = []
    for (system, c), runs in samples.items():
        median = {k: float(np.median([r[k] for r in runs])) for k in ("rps", "p50", "p99")}
        median["errors"] = sum(r["errors"] for r in runs)
        note = "images/s; latency per run" if c == "-" else ""
        if (system, c) in notes:
            note = f"mean batch {np.mean(notes[(system, c)]):.1f}"
        rows.append((name, system, c, median, note))
    return rows


async def measure(
    protocol: str,
    request: bytes,
    port: int,
    grpc_port: int | None,
    concurrency: int,
    seconds: float | None = None,
    count: int | None = None,
) -> dict:
    """The closed loop over fresh clients of one protocol."""
    async with open_clients(protocol, request, port, grpc_port, concurrency) as clients:
        return await closed_loop(clients, seconds, count)


async def first_answer(
    protocol: str, request: bytes, port: int, grpc_port: int | None, want: np.ndarray
) -> str:
    async with open_clients(protocol, request, port, grpc_port, 1) as (client,):
        return await check_answer(protocol, client, want)


def two_free_ports() -> tuple[int, int]:
    while (ports := (free_port(), free_port()))[0] == ports[1]:
        pass
    return ports


def medians(runs: list[dict], keys: tuple[str, ...] = ("rps", "p50", "p99")) -> dict:
    median = {k: float(np.median([r[k] for r in runs])) for k in keys}
    median["errors"] = sum(r["errors"] for r in runs)
    return median


def tell_errors(r: dict, log: Path) -> None:
    """A run's first error and the server's log tail, on stderr."""
    if r.get("first_error"):
        print(
            f"    {r['errors']} errors; the first: {r['first_error'][:500]}\n    server log tail:\n"
            f"{log.read_text(errors='replace')[-2000:]}",
            file=sys.stderr,
            flush=True,
        )


def run_protocols(name: str, work: Path, seconds: float, rounds: int) -> list:
    """One model over V2 JSON/HTTP, V2 binary/HTTP and V2/gRPC of one server, all driven by the
    Python generator, and in-process onnxruntime; `rounds` rounds over all of them, medians
    reported. Where the native gRPC engine is built, a second server on grpc.aio
    (`--grpc-engine aio`) is measured over gRPC in the same rounds: the baseline that engine
    replaces."""
    import torch

    from serving.grpc import native

    model, onnx_path = build_and_export(name, work)
    x = np.random.default_rng(1).random((1, 1, 28, 28), dtype=np.float32)
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    # (label suffix, --grpc-engine, the protocols measured on that server)
    engines = [("", "auto", PROTOCOLS)] + (
        [(", grpc.aio", "aio", GRPCS)] if native.available() else []
    )
    servers = []
    for suffix, engine, protocols in engines:
        port, grpc_port = two_free_ports()
        log = work / f"ours-protocols-{name}-{engine}.log"
        servers.append(
            (
                suffix,
                protocols,
                port,
                grpc_port,
                log,
                Server(
                    [
                        sys.executable,
                        "-m",
                        "serving",
                        "--model",
                        f"{name}={onnx_path}",
                        "--port",
                        str(port),
                        "--grpc-port",
                        str(grpc_port),
                        "--grpc-engine",
                        engine,
                        "--max-batch-size",
                        str(MAX_BATCH),
                        "--log-level",
                        "warning",
                    ],
                    port,
                    "/v2/health/ready",
                    log,
                ),
            )
        )
    samples: dict[tuple[str, object], list[dict]] = {}
    checks: dict[str, str] = {}
    loop = asyncio.new_event_loop()
    with contextlib.ExitStack() as stack:
        stack.enter_context(contextlib.closing(loop))
        # each server's prebuilt requests, one per protocol
        wires = []
        for suffix, protocols, port, grpc_port, log, server in servers:
            stack.enter_context(server)
            wires.append(
                wire := {protocol: v2_request(protocol, name, x, port) for protocol in protocols}
            )
            for protocol in protocols:
                checks[protocol + suffix] = loop.run_until_complete(
                    first_answer(protocol, wire[protocol], port, grpc_port, want)
                )
                print(
                    f"  {name:8s} {protocol + suffix:32s} first answer: {checks[protocol + suffix]}",
                    file=sys.stderr,
                    flush=True,
                )
        for round_ in range(rounds):
            for batch in (1, MAX_BATCH):
                key = (f"(a) onnxruntime in-process, batch {batch}", "-")
                samples.setdefault(key, []).append(bench_inprocess(onnx_path, batch, seconds))
            for (suffix, protocols, port, grpc_port, log, server), wire in zip(servers, wires):
                for protocol in protocols:
                    for c in (1, 32):
                        before, server_cpu = batch_stats(port), cpu_seconds(server.proc.pid)
                        r = loop.run_until_complete(
                            measure(protocol, wire[protocol], port, grpc_port, c, seconds)
                        )
                        after, server_cpu = (
                            batch_stats(port),
                            cpu_seconds(server.proc.pid) - server_cpu,
                        )
                        r.update(
                            batch=(after[0] - before[0]) / max(after[1] - before[1], 1),
                            server_cpu_ms=server_cpu * 1e3 / max(r["n"] + r["errors"], 1),
                        )
                        samples.setdefault((f"(b) {protocol}{suffix}", c), []).append(r)
                        print(
                            f"  round {round_ + 1}/{rounds} {name:8s} {protocol + suffix:32s} c={c:<3d} "
                            f"{r['rps']:8.1f} req/s  p50 {r['p50']:7.2f} ms  p99 {r['p99']:7.2f} ms  "
                            f"errors {r['errors']}",
                            file=sys.stderr,
                            flush=True,
                        )
                        tell_errors(r, log)
                # the same load from a C client: is the Python generator the limit?
                if shutil.which("h2load"):
                    for protocol in [p for p in (BINARY_HTTP, *GRPCS) if p in protocols]:
                        before, server_cpu = batch_stats(port), cpu_seconds(server.proc.pid)
                        r = h2load(
                            protocol, wire[protocol], port, grpc_port, name, 32, seconds, work
                        )
                        after, server_cpu = (
                            batch_stats(port),
                            cpu_seconds(server.proc.pid) - server_cpu,
                        )
                        r.update(
                            batch=(after[0] - before[0]) / max(after[1] - before[1], 1),
                            server_cpu_ms=server_cpu * 1e3 / max(r["n"], 1),
                        )
                        samples.setdefault((f"(b') {protocol}{suffix}, h2load", 32), []).append(r)
                        print(
                            f"  round {round_ + 1}/{rounds} {name:8s} {protocol + suffix:32s} c=32  "
                            f"{r['rps']:8.1f} req/s  (h2load) errors {r['errors']}",
                            file=sys.stderr,
                            flush=True,
                        )
    rows = []
    for (system, c), runs in samples.items():
        note = "images/s; latency per run"
        if system.startswith("(b')"):
            m = medians(runs, ("batch", "server_cpu_ms", "mean_ms"))
            latency = (
                f"mean time of a stream of {STREAM_REQUESTS} requests"
                if GRPC_STREAM in system
                else "mean latency"
            )
            note = (
                f"h2load (C) client, {latency} {m['mean_ms']:.2f} ms; mean batch {m['batch']:.1f}; "
                f"server CPU ms/request {m['server_cpu_ms']:.2f}"
            )
        elif c != "-":
            m = medians(runs, ("batch", "client_cpu_ms", "server_cpu_ms"))
            note = (
                f"{checks[system[4:]]}; mean batch {m['batch']:.1f}; CPU ms/request: generator "
                f"{m['client_cpu_ms']:.2f}, server {m['server_cpu_ms']:.2f}"
            )
        rows.append((name, system, c, medians(runs), note))
    return rows


def h2load(
    protocol: str,
    request: bytes,
    port: int,
    grpc_port: int,
    model: str,
    concurrency: int,
    seconds: float,
    work: Path,
    connections: int = 1,
) -> dict:
    """The protocol's prebuilt request sent by h2load (nghttp2's C load generator, Debian package
    nghttp2-client), closed loop for `seconds`: over HTTP/1.1 `concurrency` keep-alive connections,
    over gRPC `connections` connections (default one, as the Python generator's one channel) with
    `concurrency` streams in all. h2load gives the mean latency, not percentiles (p50/p99 are NaN),
    and sees HTTP statuses only: a gRPC error (a 200 with a non-zero grpc-status trailer) is not
    counted, which is why the Python generator checks each protocol's answer first.
    ModelStreamInfer: h2load sends a stream's whole body at once, so a "request" of its is a stream
    of STREAM_REQUESTS requests, `concurrency // STREAM_REQUESTS + 1` streams at once (32 -> 100
    requests in flight on 1 stream... 132 on 2: a client that keeps its stream full); rates and
    counts are per request."""
    body_path = work / f"h2load-{model}-{protocol.replace(' ', '-').replace(',', '')}.bin"
    per_call = STREAM_REQUESTS if protocol == GRPC_STREAM else 1
    # the gRPC frame: not compressed (0), the length (4 bytes, big-endian), the message
    if protocol in GRPCS:
        body_path.write_bytes((b"\0" + len(request).to_bytes(4, "big") + request) * per_call)
        streams = concurrency // STREAM_REQUESTS + 1 if protocol == GRPC_STREAM else concurrency
        method = MODEL_STREAM_INFER if protocol == GRPC_STREAM else MODEL_INFER
        cmd = [
            "h2load",
            "-c",
            str(connections),
            "-m",
            str(max(1, streams // connections)),
            "-H",
            "content-type: application/grpc",
            "-H",
            "te: trailers",
            f"http://127.0.0.1:{grpc_port}{method}",
        ]
    else:
        head, body = request.split(b"\r\n\r\n", 1)
        header_length = (
            re.search(rb"\r\ninference-header-content-length: *(\d+)", head, re.I).group(1).decode()
        )
        body_path.write_bytes(body)
        cmd = [
            "h2load",
            "--h1",
            "-c",
            str(concurrency),
            "-H",
            "content-type: application/octet-stream",
            "-H",
            f"inference-header-content-length: {header_length}",
            f"http://127.0.0.1:{port}/v2/models/{model}/infer",
        ]
    out = subprocess.run(
        [*cmd[:1], "-D", str(max(1, round(seconds))), "-d", str(body_path), *cmd[1:]],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rps = float(re.search(r"finished in [\d.]+s, ([\d.]+) req/s", out).group(1))
    done = re.search(
        r"requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded, (\d+) failed, (\d+) errored",
        out,
    )
    ok2xx = int(re.search(r"status codes: (\d+) 2xx", out).group(1))
    mean = re.search(r"time for request:\s+\S+\s+\S+\s+([\d.]+)(us|ms|s)", out)
    mean_ms = float(mean.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[mean.group(2)]
    return {
        "rps": rps * per_call,
        "p50": float("nan"),
        "p99": float("nan"),
        "mean_ms": mean_ms,
        "n": int(done.group(1)) * per_call,
        # A call cut at the end of the run may have its 2xx headers and not be done: not an error.
        "errors": (max(0, int(done.group(1)) - ok2xx) + int(done.group(3)) + int(done.group(4)))
        * per_call,
    }


# (scenario, the model probed, whether wrk floods `flooded` meanwhile)
TWO_MODEL_SCENARIOS = (
    ("(a) probe `probed` (mlp), no other load", "probed", False),
    ("(b) probe `probed` (mlp) while wrk floods `flooded` (resnet18) at c=32", "probed", True),
    ("(a') probe `flooded` (resnet18), no other load", "flooded", False),
    ("(c) baseline: probe `flooded` itself during the same flood", "flooded", True),
)


def probe(
    loop,
    request: bytes,
    port: int,
    probes: int,
    flood_url: str | None = None,
    flood_body: Path | None = None,
) -> dict:
    """`probes` sequential requests (the Python generator, concurrency 1), alone or while wrk floods
    flood_url at concurrency 32 (from a second before the first probe to the last; then the server
    drains)."""
    if flood_url is None:
        return {
            **loop.run_until_complete(measure(BINARY_HTTP, request, port, None, 1, count=probes)),
            "flood_rps": float("nan"),
            "flood_errors": 0,
        }
    with flood(flood_url, flood_body, 32) as flooding:
        # wrk's connections are open and the flood's queue is full
        time.sleep(1)
        r = loop.run_until_complete(measure(BINARY_HTTP, request, port, None, 1, count=probes))
    # the flood's last requests are not the next scenario's load
    wait_until_idle(port)
    return {**r, "flood_rps": flooding["rps"], "flood_errors": flooding["errors"]}


def scenario_histograms(port: int, probed: str) -> dict[str, tuple[float, float]]:
    """The server's own view of a two-model scenario so far, (sum, count) each: the probed model's
    queue time (until the engine thread began its run), the flooded model's run time and batch
    size."""
    return {
        "probe_queue_ms": histogram(port, "trainserve_queue_duration_seconds", probed),
        "flood_run_ms": histogram(port, "trainserve_inference_duration_seconds", "flooded"),
        "flood_batch": histogram(port, "trainserve_batch_size", "flooded"),
    }


def histogram_means(before: dict, after: dict) -> dict[str, float]:
    """Each histogram's mean between two readings (*_ms in milliseconds); NaN where nothing was
    observed."""
    means = {}
    for key, (total, count) in before.items():
        mean = (
            (after[key][0] - total) / (after[key][1] - count)
            if after[key][1] > count
            else float("nan")
        )
        means[key] = mean * 1e3 if key.endswith("_ms") else mean
    return means


def run_two_models(work: Path, probes: int, rounds: int) -> list:
    """One server of two models; the probe's latency to one while wrk floods the other, against no
    flood and against probing the flooded model itself; `rounds` rounds over the scenarios, medians
    reported."""
    import torch

    nets = {"flooded": build_and_export("resnet18", work), "probed": build_and_export("mlp", work)}
    x = np.random.default_rng(1).random((1, 1, 28, 28), dtype=np.float32)
    with torch.no_grad():
        want = {name: net(torch.from_numpy(x)).numpy() for name, (net, _) in nets.items()}
    port = free_port()
    log = work / "ours-two-models.log"
    server = Server(
        [
            sys.executable,
            "-m",
            "serving",
            *(f for name, (_, path) in nets.items() for f in ("--model", f"{name}={path}")),
            "--port",
            str(port),
            "--max-batch-size",
            str(MAX_BATCH),
            "--log-level",
            "warning",
        ],
        port,
        "/v2/health/ready",
        log,
    )
    flood_url = f"http://127.0.0.1:{port}/v2/models/flooded/infer"
    flood_body = work / "flooded-v2.json"
    flood_body.write_bytes(v2_json_body(x))
    wire = {name: v2_request(BINARY_HTTP, name, x, port) for name in nets}
    samples: dict[str, list[dict]] = {}
    loop = asyncio.new_event_loop()
    with server, contextlib.closing(loop):
        for name in nets:
            check = loop.run_until_complete(
                first_answer(BINARY_HTTP, wire[name], port, None, want[name])
            )
            print(f"  probe of {name:8s} first answer: {check}", file=sys.stderr, flush=True)
        for round_ in range(rounds):
            for scenario, name, flooding in TWO_MODEL_SCENARIOS:
                before = scenario_histograms(port, name)
                r = probe(
                    loop, wire[name], port, probes, *((flood_url, flood_body) if flooding else ())
                )
                r.update(histogram_means(before, scenario_histograms(port, name)))
                samples.setdefault(scenario, []).append(r)
                print(
                    f"  round {round_ + 1}/{rounds} {scenario[:4]:4s} probe of {name:8s} {r['n']:5d} answers  "
                    f"p50 {r['p50']:7.2f} ms  p99 {r['p99']:7.2f} ms  errors {r['errors']}  server: queue "
                    f"{r['probe_queue_ms']:.1f} ms, `flooded` runs {r['flood_run_ms']:.1f} ms of "
                    f"{r['flood_batch']:.1f} rows"
                    + (
                        f"   flood {r['flood_rps']:7.1f} req/s, errors {r['flood_errors']}"
                        if flooding
                        else ""
                    ),
                    file=sys.stderr,
                    flush=True,
                )
                tell_errors(r, log)
    rows = []
    for scenario, runs in samples.items():
        median = medians(
            runs, ("p50", "p99", "flood_rps", "probe_queue_ms", "flood_run_ms", "flood_batch")
        )
        median.update(
            n=sum(r["n"] for r in runs), flood_errors=sum(r["flood_errors"] for r in runs)
        )
        rows.append((scenario, median))
    return rows


def print_table(rows: list) -> None:
    print("\n| model | system | concurrency | req/s | p50 ms | p99 ms | errors | note |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for model, system, c, r, note in rows:
        print(
            f"| {model} | {system} | {c} | {r['rps']:.1f} | {r['p50']:.2f} | {r['p99']:.2f} | {r['errors']} | {note} |"
        )


def print_probe_table(rows: list) -> None:
    def number(value: float, digits: int = 1) -> str:
        return "-" if np.isnan(value) else f"{value:.{digits}f}"

    print(
        "\n| scenario | probe p50 ms | probe p99 ms | flood req/s | server: probed model's queue ms | "
        "server: `flooded` run ms (rows) | probes | errors (probe/flood) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for scenario, r in rows:
        run = (
            "-"
            if np.isnan(r["flood_run_ms"])
            else f"{r['flood_run_ms']:.1f} ({r['flood_batch']:.1f})"
        )
        print(
            f"| {scenario} | {r['p50']:.2f} | {r['p99']:.2f} | {number(r['flood_rps'])} | "
            f"{number(r['probe_queue_ms'], 2)} | {run} | {r['n']} | {r['errors']}/{r['flood_errors']} |"
        )


def print_targets(rows: list) -> None:
    def find(model, prefix, c="-"):
        for m, system, conc, r, _ in rows:
            if m == model and system.startswith(prefix) and conc == c:
                return r
        return None

    print("\nTargets (issue 6):")
    for model in dict.fromkeys(r[0] for r in rows):
        ours32, ours1 = find(model, "(b)", 32), find(model, "(b)", 1)
        base32, base1 = (
            find(model, f"(a) onnxruntime in-process, batch {MAX_BATCH}"),
            find(model, "(a) onnxruntime in-process, batch 1"),
        )
        pt32, ox32 = (
            find(model, "(c) mlflow models serve, pytorch", 32),
            find(model, "(c) mlflow models serve, onnx", 32),
        )
        checks = []
        if ours32 and base32:
            checks.append(
                (
                    f"c32 throughput / in-process batch {MAX_BATCH}",
                    ours32["rps"] / base32["rps"],
                    ">= 0.8",
                )
            )
        if ours32 and pt32:
            checks.append(
                ("c32 throughput / mlflow pytorch flavor", ours32["rps"] / pt32["rps"], ">= 3")
            )
        if ours32 and ox32:
            checks.append(
                ("c32 throughput / mlflow onnx flavor", ours32["rps"] / ox32["rps"], ">= 1.5")
            )
        if ours1 and base1:
            checks.append(
                ("c1 p50 - in-process batch-1 p50 (ms)", ours1["p50"] - base1["p50"], "<= 1.5")
            )
        for what, value, target in checks:
            print(f"  {model:8s} {what:45s} {value:7.2f}  (target {target})")


def print_protocol_targets(rows: list) -> None:
    """Issue 22's targets: every protocol at c=32 against in-process batch 32, and gRPC against
    binary HTTP (the goal for small models: >= 1), from the Python generator and from h2load, for
    each gRPC engine measured."""

    def find(model, system, c=32):
        return next(
            (r for m, name, conc, r, _ in rows if m == model and name == system and conc == c), None
        )

    print(
        "\nTargets (issue 22): c=32 req/s against in-process batch 32, and gRPC against binary HTTP (goal >= 1 for "
        "small models)"
    )
    for model in dict.fromkeys(r[0] for r in rows):
        base = find(model, f"(a) onnxruntime in-process, batch {MAX_BATCH}", "-")
        for m, system, c, r, _ in rows:
            if m == model and c == 32 and base and base["rps"] > 0:
                print(
                    f"  {model:8s} {system[:48]:48s} / in-process b{MAX_BATCH}  {r['rps'] / base['rps']:8.3f}"
                )
        for prefix, client in (("(b) ", "Python generator"), ("(b') ", "h2load")):
            binary = find(
                model, f"{prefix}{BINARY_HTTP}" + (", h2load" if client == "h2load" else "")
            )
            for m, system, c, r, _ in rows:
                if (
                    m == model
                    and c == 32
                    and system.startswith(prefix)
                    and GRPC in system
                    and binary
                    and binary["rps"]
                ):
                    print(
                        f"  {model:8s} {system[:48]:48s} / binary HTTP ({client})  {r['rps'] / binary['rps']:6.2f}"
                    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--servers",
        action="store_true",
        help="ours against in-process and mlflow serve (what a "
        "run without --protocols or --two-models does)",
    )
    parser.add_argument(
        "--protocols", action="store_true", help="V2 JSON/HTTP, binary/HTTP and gRPC of one server"
    )
    parser.add_argument(
        "--two-models", action="store_true", help="one model's latency while another is flooded"
    )
    parser.add_argument(
        "--quick", action="store_true", help="one round of 3 s runs (200 probes), the ResNet only"
    )
    parser.add_argument(
        "--seconds", type=float, default=None, help="seconds per measurement (default 5, quick 3)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds over all systems; medians reported (default 3, quick 1)",
    )
    parser.add_argument(
        "--probes",
        type=int,
        default=None,
        help="--two-models: probe requests per scenario (default 300, quick 200)",
    )
    parser.add_argument(
        "--models",
        default=None,
        help="--servers: comma-separated: resnet18,mlp (default both; quick: resnet18)",
    )
    parser.add_argument(
        "--no-mlflow", action="store_true", help="--servers: skip (c), the mlflow servers"
    )
    parser.add_argument(
        "--protocol-models",
        default="resnet18",
        help="--protocols: comma-separated: resnet18,mlp "
        "(default resnet18; the MLP's run is so short "
        "that the protocols' own costs show)",
    )
    args = parser.parse_args(argv)
    servers = args.servers or not (args.protocols or args.two_models)
    if (servers or args.two_models) and shutil.which("wrk") is None:
        print("wrk not found: apt-get install -y wrk", file=sys.stderr)
        return 2
    seconds = args.seconds or (3.0 if args.quick else 5.0)
    rounds = args.rounds or (1 if args.quick else 3)
    probes = args.probes or (200 if args.quick else 300)
    models = (args.models or ("resnet18" if args.quick else "resnet18,mlp")).split(",")
    work = Path(tempfile.mkdtemp(prefix="trainserve-bench-"))
    rows, protocol_rows, probe_rows = [], [], []
    try:
        if servers:
            for name in models:
                rows += run_model(name, work, seconds, rounds, not args.no_mlflow)
        if args.protocols:
            for name in args.protocol_models.split(","):
                protocol_rows += run_protocols(name, work, seconds, rounds)
        if args.two_models:
            probe_rows = run_two_models(work, probes, rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if servers:
        print_table(rows)
        print_targets(rows)
    if protocol_rows:
        print(
            f"\nProtocols: one server, one image a request, the Python generator "
            f"({rounds} round(s) of {seconds:g} s, medians)"
        )
        print_table(protocol_rows)
        print_protocol_targets(protocol_rows)
    if probe_rows:
        print(
            f"\nTwo models: `flooded` (resnet18) and `probed` (mlp) on one server; probes are sequential "
            f"single-image binary V2 HTTP requests ({probes} a scenario, {rounds} round(s), medians)"
        )
        print_probe_table(probe_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
