"""Helpers for the serving tests: small real ONNX models and a real server process on a free
port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import requests
from onnx import TensorProto, helper, numpy_helper

from serving import lineage

ROOT = Path(__file__).resolve().parents[1]


def tiny_model(
    path: Path,
    *,
    seed: int = 0,
    name: str | None = "tiny",
    labels: list[str] | None = None,
    size: int = 8,
    classes: int = 3,
) -> Path:
    """Flatten -> Gemm -> Softmax over [batch, 1, size, size] FP32, with the exporter's names and
    metadata."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(size * size, classes)).astype(np.float32)
    b = rng.normal(size=classes).astype(np.float32)
    nodes = [
        helper.make_node("Flatten", ["input"], ["flat"], axis=1),
        helper.make_node("Gemm", ["flat", "W", "b"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1),
    ]
    return _save(
        path,
        nodes,
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b")],
        size,
        classes,
        name,
        labels,
    )


def heavy_model(
    path: Path, *, size: int = 28, channels: int = 48, layers: int = 3, classes: int = 10
) -> Path:
    """A few 3x3 convolutions: milliseconds per sample, so concurrent requests really queue up."""
    rng = np.random.default_rng(1)
    inits, nodes, x, cin = [], [], "input", 1
    for i in range(layers):
        w = (rng.normal(size=(channels, cin, 3, 3)) / np.sqrt(9 * cin)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"conv{i}"))
        nodes += [
            helper.make_node("Conv", [x, f"conv{i}"], [f"c{i}"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", [f"c{i}"], [f"r{i}"]),
        ]
        x, cin = f"r{i}", channels
    fc = (rng.normal(size=(channels, classes)) / np.sqrt(channels)).astype(np.float32)
    inits.append(numpy_helper.from_array(fc, "fc"))
    nodes += [
        helper.make_node("GlobalAveragePool", [x], ["pool"]),
        helper.make_node("Flatten", ["pool"], ["flat"], axis=1),
        helper.make_node("MatMul", ["flat", "fc"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1),
    ]
    return _save(path, nodes, inits, size, classes, "heavy", None)


def gather_model(path):
    """`ids` INT64 [batch] -> `vectors` [batch, 3]: an embedding of 5 rows. An id past 4 makes
    onnxruntime raise at run time, as a token id past a vocabulary does."""
    table = np.arange(15, dtype=np.float32).reshape(5, 3)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["vectors"], axis=0)],
        "gather",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch"])],
        [helper.make_tensor_value_info("vectors", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(table, "table")],
    )
    return _save_graph(path, graph, 17)


def two_axes_model(path):
    """`x` FP32 [batch, n] -> `total` [batch]: two dynamic axes, as the review's dyn.onnx."""
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0, axes=[1])],
        "dyn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n"])],
        [helper.make_tensor_value_info("total", TensorProto.FLOAT, ["batch"])],
    )
    return _save_graph(path, graph, 12)


def two_input_model(path):
    """`features` FP32 [batch, 4] and `code` INT64 [batch] -> `output` [batch, 4]: mixed dtypes."""
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["code"], ["code_f"], to=TensorProto.FLOAT),
            helper.make_node("Unsqueeze", ["code_f", "axis"], ["code_col"]),
            helper.make_node("Add", ["features", "code_col"], ["output"]),
        ],
        "two",
        [
            helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info("code", TensorProto.INT64, ["batch"]),
        ],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor("axis", TensorProto.INT64, [1], [1])],
    )
    return _save_graph(path, graph, 17)


def sum_model(path, *, rank: int = 1) -> Path:
    """INPUT0, INPUT1, INPUT2 FP32 [-1] (`rank` 2: [-1, -1]) -> OUTPUT FP32 [1], the sum of every
    value sent: each request's answer is its own three inputs' total, and no row of it is a row of
    any input. A model whose every input has a dynamic first axis and whose rows are not independent
    (Triton serves it with max_batch_size 0)."""
    dims = [["n", "m"][:rank] for _ in range(3)]
    graph = helper.make_graph(
        [
            *[helper.make_node("Reshape", [f"INPUT{i}", "flat"], [f"f{i}"]) for i in range(3)],
            helper.make_node("Concat", ["f0", "f1", "f2"], ["all"], axis=0),
            helper.make_node("ReduceSum", ["all"], ["OUTPUT"], keepdims=1),
        ],
        "sum",
        [
            helper.make_tensor_value_info(
                f"INPUT{i}", TensorProto.FLOAT, [f"{d}{i}" for d in dims[i]]
            )
            for i in range(3)
        ],
        [helper.make_tensor_value_info("OUTPUT", TensorProto.FLOAT, [1])],
        [helper.make_tensor("flat", TensorProto.INT64, [1], [-1])],
    )
    return _save_graph(path, graph, 17)


def text_model(path, *, number: bool = False, batch: bool = True) -> Path:
    """`TEXT` STRING [batch, 2] -> `ECHO`, the same strings (an Identity); `number`: -> `NUMBER`
    INT32 [batch, 2], the strings read as integers (a Cast, as Triton's string models do). Its rows
    are independent, and its file says so unless `batch` is False."""
    out = ("NUMBER", TensorProto.INT32) if number else ("ECHO", TensorProto.STRING)
    node = (
        helper.make_node("Cast", ["TEXT"], ["NUMBER"], to=TensorProto.INT32)
        if number
        else helper.make_node("Identity", ["TEXT"], ["ECHO"])
    )
    graph = helper.make_graph(
        [node],
        "text",
        [helper.make_tensor_value_info("TEXT", TensorProto.STRING, ["batch", 2])],
        [helper.make_tensor_value_info(out[0], out[1], ["batch", 2])],
    )
    return _save_graph(
        path, graph, 17, {lineage.ROWS_INDEPENDENT: "by construction"} if batch else {}
    )


def word_model(path) -> Path:
    """`WORD` STRING [1] -> `SAME` STRING [1]: one string in, the same one out (no batch axis)."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["WORD"], ["SAME"])],
        "word",
        [helper.make_tensor_value_info("WORD", TensorProto.STRING, [1])],
        [helper.make_tensor_value_info("SAME", TensorProto.STRING, [1])],
    )
    return _save_graph(path, graph, 17)


def double_model(path) -> Path:
    """`VALUES` FP32 [-1] -> `TWICE` FP32 [-1]: one input, no batch axis recorded (runs as sent)."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["VALUES", "VALUES"], ["TWICE"])],
        "double",
        [helper.make_tensor_value_info("VALUES", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("TWICE", TensorProto.FLOAT, ["n"])],
    )
    return _save_graph(path, graph, 17)


def any_rank_model(path) -> Path:
    """`ANY` FP32 of no declared shape at all (not even a rank) -> `SAME`, the same tensor."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["ANY"], ["SAME"])],
        "any_rank",
        [helper.make_tensor_value_info("ANY", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("SAME", TensorProto.FLOAT, None)],
    )
    # (onnx's checker wants a shape on every graph input; onnxruntime, and the ONNX spec, do not)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, str(path))
    return Path(path)


def triton_config(model_dir: Path, text: str, labels: dict[str, list[str]] | None = None) -> Path:
    """A Triton config.pbtxt (and label files) in a repository model's directory."""
    model_dir.mkdir(parents=True, exist_ok=True)
    for name, lines in (labels or {}).items():
        (model_dir / name).write_text("".join(f"{line}\n" for line in lines))
    (model_dir / "config.pbtxt").write_text(text)
    return model_dir / "config.pbtxt"


def _save_graph(path, graph, opset: int, props: dict[str, str] | None = None) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    if props:
        helper.set_model_props(model, props)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return Path(path)


def _save(path, nodes, inits, size, classes, name, labels) -> Path:
    graph = helper.make_graph(
        nodes,
        "test",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 1, size, size])],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes]),
            helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", classes]),
        ],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    # As `pipeline export` records it: the rows of a Flatten-Gemm-Softmax are the samples' own.
    props = {lineage.ROWS_INDEPENDENT: "1,7,64"}
    if name:
        props[lineage.MODEL_NAME] = name
    if labels is not None:
        import json

        props[lineage.LABELS] = json.dumps(labels)
    helper.set_model_props(model, props)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return Path(path)


def run_onnx(path: Path, x: np.ndarray) -> dict[str, np.ndarray]:
    """The reference: the same file run directly with onnxruntime."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, {"input": x})))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m serving` in a subprocess; `with` waits until ready and always kills it by PID."""

    def __init__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
        ready_timeout: float = 90.0,
        wait_ready: bool = True,
        cwd: Path | None = None,
        address: str = "127.0.0.1",
        prefix: list[str] | None = None,
    ):
        self.port = free_port()
        # a replica of a fleet runs in its own directory
        self.cwd = cwd or ROOT
        self.url = f"http://{address}:{self.port}"
        self.args = ["--port", str(self.port), "--threads", "1", *args]
        if address != "127.0.0.1":
            self.args += ["--host", address]
        # what runs the server elsewhere: `ip netns exec HOST` for a namespace host
        self.prefix = prefix or []
        # mlflow.set_tracking_uri() in an earlier in-process test leaves its store in
        # os.environ; a server finds the store its own test names, or its cwd's
        inherited = {
            k: v
            for k, v in os.environ.items()
            if k not in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")
        }
        self.env = {**inherited, **(env or {})}
        self.log_path = log_path
        self.ready_timeout = ready_timeout
        # False: until it answers at all (live), for a server not ready by design
        self.wait_ready = wait_ready
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "ServerProcess":
        self._log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [*self.prefix, sys.executable, "-m", "serving", *self.args],
            cwd=self.cwd,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode} before ready:\n{self.log()}"
                )
            try:
                path = "/v2/health/ready" if self.wait_ready else "/v2/health/live"
                if requests.get(self.url + path, timeout=1).status_code == 200:
                    return self
            except requests.ConnectionError:
                pass
            time.sleep(0.1)
        self.__exit__(None, None, None)
        raise RuntimeError(f"server not ready after {self.ready_timeout} s:\n{self.log()}")

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait; returns the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self._log is not subprocess.DEVNULL:
            self._log.close()

    def log(self) -> str:
        return (
            self.log_path.read_text(errors="replace")
            if self.log_path and self.log_path.exists()
            else ""
        )


def metric(text: str, sample_name: str, /, **labels: str) -> float:
    """The value of one Prometheus sample in an exposition text (0 if absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(sample_name):
            continue
        head, _, value = line.rpartition(" ")
        sample, _, rest = head.partition("{")
        if sample != sample_name:
            continue
        found = dict(p.split("=", 1) for p in rest.rstrip("}").split(",") if p) if rest else {}
        found = {k: v.strip('"') for k, v in found.items()}
        if all(found.get(k) == v for k, v in labels.items()):
            return float(value)
    return 0.0
