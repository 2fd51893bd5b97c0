"""The onnxruntime engine: one InferenceSession, its inputs and outputs, and `run(feeds)`.

Knows nothing of HTTP or batching. `run` is called from one worker thread at a time (the batcher's),
so the engine holds no lock.
"""

from __future__ import annotations

import glob
import logging
import os
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

log = logging.getLogger("serving.engine")

# ONNX tensor element types as onnxruntime names them -> (numpy dtype, KServe V2 datatype).
_ORT_TYPES: dict[str, tuple[np.dtype, str]] = {
    "tensor(float)": (np.dtype(np.float32), "FP32"),
    "tensor(double)": (np.dtype(np.float64), "FP64"),
    "tensor(float16)": (np.dtype(np.float16), "FP16"),
    "tensor(int8)": (np.dtype(np.int8), "INT8"),
    "tensor(int16)": (np.dtype(np.int16), "INT16"),
    "tensor(int32)": (np.dtype(np.int32), "INT32"),
    "tensor(int64)": (np.dtype(np.int64), "INT64"),
    "tensor(uint8)": (np.dtype(np.uint8), "UINT8"),
    "tensor(uint16)": (np.dtype(np.uint16), "UINT16"),
    "tensor(uint32)": (np.dtype(np.uint32), "UINT32"),
    "tensor(uint64)": (np.dtype(np.uint64), "UINT64"),
    "tensor(bool)": (np.dtype(np.bool_), "BOOL"),
}


class EngineError(Exception):
    """The model cannot be served as asked (unsupported types, no CUDA device, broken file)."""


class ModelInputError(EngineError):
    """onnxruntime could not compute the model on these input values (an index past an embedding's size,
    a value a Reshape can't take): the request's values, since inputs were validated against the model's
    names, types and shapes before, and warm-up ran it on zeros."""


@dataclass(frozen=True)
class TensorSpec:
    """One model input or output. `shape` uses -1 for a dynamic axis."""
    name: str
    dtype: np.dtype
    datatype: str  # KServe V2 name: FP32, INT64, ...
    shape: tuple[int, ...]

    def describe(self) -> str:
        return f"[{','.join(map(str, self.shape))}] {self.datatype}"


def cuda_device_present() -> bool:
    """True when a CUDA device really exists, not merely a CUDA build of onnxruntime.

    onnxruntime-gpu lists CUDAExecutionProvider on any machine; asking for it without a GPU fails
    with a page of errors. The driver exposes /proc/driver/nvidia/gpus/<bus id> and /dev/nvidiaN
    (also inside containers run with the NVIDIA runtime); CUDA_VISIBLE_DEVICES may hide them all.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    gpus = glob.glob("/proc/driver/nvidia/gpus/*") or glob.glob("/dev/nvidia[0-9]*")
    return bool(gpus)


def choose_provider(device: str) -> str:
    """The execution provider for `device` (auto|cpu|cuda), or EngineError if cuda can't be had."""
    if device not in ("auto", "cpu", "cuda"):
        raise EngineError(f"unknown device '{device}'; expected auto, cpu or cuda")
    if device == "cpu":
        return "CPUExecutionProvider"
    has_provider = "CUDAExecutionProvider" in ort.get_available_providers()
    has_device = cuda_device_present()
    if has_provider and has_device:
        return "CUDAExecutionProvider"
    if device == "cuda":
        why = "no CUDA device found" if has_provider else (
            "this onnxruntime build has no CUDAExecutionProvider (install onnxruntime-gpu)")
        raise EngineError(f"--device cuda asked for, but {why}; use --device auto or cpu")
    return "CPUExecutionProvider"


def usable_cpus() -> int:
    """CPUs this process may run on (affinity, cgroup cpusets), not the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _spec(arg) -> TensorSpec:
    if arg.type not in _ORT_TYPES:
        raise EngineError(f"tensor '{arg.name}' has type {arg.type}, which this server does not serve; "
                          f"supported: {', '.join(_ORT_TYPES)}")
    dtype, datatype = _ORT_TYPES[arg.type]
    shape = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in (arg.shape or []))
    return TensorSpec(arg.name, dtype, datatype, shape)


class Engine:
    """An onnxruntime session over one model file, with its tensor specs.

    `batchable` is True when every input has a dynamic first axis: then rows of different requests
    can be concatenated into one run. Otherwise each request runs alone.

    `device_id` is the CUDA device among those the process sees: CUDA_VISIBLE_DEVICES=2 makes
    the host's third GPU device 0, which is the usual way to pick one. Ignored on CPU.
    """

    def __init__(self, path: str, device: str = "auto", threads: int | None = None, device_id: int = 0):
        self.provider = choose_provider(device)
        self.threads = threads or usable_cpus()
        self.device_id = device_id

        options = ort.SessionOptions()
        # onnxruntime sizes its pool to the host, and pinning does not confine its threads; the
        # count is the one thing we control.
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Idle pool threads spin by default, burning the cores the event loop needs to parse the
        # next request: with it on, the ResNet served at half the rate on 2 busy cores.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.log_severity_level = 3  # errors only: the placement warnings are noise here
        providers: list = ["CPUExecutionProvider"]
        if self.provider == "CUDAExecutionProvider":
            providers = [("CUDAExecutionProvider", {"device_id": device_id}), "CPUExecutionProvider"]
        try:
            self.session = ort.InferenceSession(path, sess_options=options, providers=providers)
        except Exception as exc:  # onnxruntime raises its own exception types for bad files
            raise EngineError(f"onnxruntime cannot load {path}: {exc}") from exc
        # Report what actually runs: onnxruntime falls back to CPU when CUDA fails to initialize.
        self.provider = self.session.get_providers()[0]
        self.inputs = [_spec(a) for a in self.session.get_inputs()]
        self.outputs = [_spec(a) for a in self.session.get_outputs()]
        self.output_names = [o.name for o in self.outputs]
        self.metadata: dict[str, str] = dict(self.session.get_modelmeta().custom_metadata_map)
        self.batchable = all(len(s.shape) >= 1 and s.shape[0] == -1 for s in self.inputs)
        self._io_binding = self.provider == "CUDAExecutionProvider"

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One session run. feeds: input name -> array, already validated against `inputs`."""
        try:
            return self._run(feeds)
        except Exception as exc:
            # onnxruntime's InvalidArgument and RuntimeException are what bad values give; out of memory
            # and everything else is the server's problem.
            text = str(exc).strip()
            if type(exc).__name__ in ("InvalidArgument", "RuntimeException") and "memory" not in text.lower():
                first = text.splitlines()[0] if text else type(exc).__name__
                raise ModelInputError(f"the model cannot compute on these input values: {first[:400]}") from exc
            raise

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._io_binding:
            # CUDA: inputs are copied host -> device once; outputs are allocated by onnxruntime on
            # the device (no device -> host copy inside the run) and copied back once, here.
            # Not executed by the test suite (no GPU there).
            binding = self.session.io_binding()
            for name, array in feeds.items():
                binding.bind_cpu_input(name, np.ascontiguousarray(array))
            for name in self.output_names:
                binding.bind_output(name, "cuda", self.device_id)
            self.session.run_with_iobinding(binding)
            return dict(zip(self.output_names, binding.copy_outputs_to_cpu()))
        return dict(zip(self.output_names, self.session.run(self.output_names, feeds)))

    def warm_up(self, batch_sizes: tuple[int, ...] = (1,)) -> bool:
        """Run zeros through the model so that the first real request does not pay for allocation.

        Returns False (and runs nothing) when an input has a dynamic axis other than the batch one:
        no size can be guessed for it safely.
        """
        if any(-1 in s.shape[1:] for s in self.inputs):
            return False
        sizes = batch_sizes if self.batchable else (1,)
        for n in sizes:
            feeds = {}
            for s in self.inputs:
                shape = s.shape if not self.batchable else (n, *s.shape[1:])
                feeds[s.name] = np.zeros(shape, dtype=s.dtype)
            self.run(feeds)
        return True

    def describe(self) -> str:
        ins = ", ".join(f"{s.name} {list(s.shape)} {s.datatype}" for s in self.inputs)
        return (f"{self.provider}"
                f"{f' device {self.device_id} with IO binding' if self._io_binding else ''}, "
                f"{self.threads} intra-op threads "
                f"(onnxruntime {ort.__version__}); inputs: {ins}")
