"""The onnxruntime engine: an InferenceSession (one per batch bucket, where asked), its inputs and
outputs, and `run(feeds)`.

Knows nothing of HTTP or of how batches are formed. `run` is called from one worker thread at a time
(the batcher's), so the engine holds no lock.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import importlib.util
import io
import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from serving.batcher import NotRowWise
from serving.console import clip, ort_severity
from serving.cpus import usable_cpus
from serving.cuda_graphs import GraphError, open_graphs
from serving.lineage import ROWS_INDEPENDENT
from serving.staging import BatchBuffers, NonFinite, check_finite, concat, nbytes, rows_of

# onnxruntime is imported where it is used: the front-end processes import this module's
# names (serving/front_end_process.py) and never run a model.
if TYPE_CHECKING:
    import onnxruntime as ort

log = logging.getLogger("serving.engine")

CPU, CUDA, TENSORRT = "CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider"
GPU_PROVIDERS = (CUDA, TENSORRT)
DEVICES = ("auto", "cpu", "cuda", "tensorrt")
CONV_ALGO_SEARCH = ("HEURISTIC", "EXHAUSTIVE", "DEFAULT")
# What the TensorRT provider of onnxruntime-gpu 1.31 links against (readelf -d): TensorRT 10.
TENSORRT_LIBRARIES = ("libnvinfer.so.10", "libnvonnxparser.so.10")

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
    # KServe V2's BYTES: each element a byte string of its own length (numpy objects: bytes in, str
    # out of onnxruntime). Never in a batch buffer, whose rows are of one fixed size (see
    # Engine.fixed_rows).
    "tensor(string)": (np.dtype(object), "BYTES"),
}


def sent_shapes(parts: list[dict[str, np.ndarray]]) -> dict[str, list[int]]:
    """Each input's shape in the requests' feeds `parts` as they are run together (their rows added
    up)."""
    first = parts[0]
    return {
        name: list(x.shape)
        if len(parts) == 1 or not x.ndim
        else [sum(p[name].shape[0] for p in parts), *x.shape[1:]]
        for name, x in first.items()
    }


class EngineError(Exception):
    """The model cannot be served as asked (unsupported types, no CUDA device, broken file)."""


class ModelInputError(EngineError):
    """onnxruntime could not compute the model on these input values (an index past an embedding's
    size, a value a Reshape can't take): the request's values, since inputs were validated against
    the model's names, types and shapes before, and warm-up ran it on zeros."""


@dataclass(frozen=True)
class TensorSpec:
    """One model input or output. `shape` uses -1 for a dynamic axis; (-1,) for a tensor the graph
    gives no rank (`ranked` False: it takes whatever shape onnxruntime accepts). `batched`: its
    first axis is the batch axis of a version whose requests share runs (Engine.set_batching)."""

    name: str
    dtype: np.dtype
    # KServe V2 name: FP32, INT64, ...
    datatype: str
    shape: tuple[int, ...]
    batched: bool = False
    ranked: bool = True
    # The model input this request input is another form of (an image version's encoded image file,
    # for the tensor it is decoded into: serving/image_inputs.py); a request gives one of the two.
    # "" for the model's own inputs.
    stands_for: str = ""

    def describe(self) -> str:
        if not self.ranked:
            return f"[any shape] {self.datatype}"
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
    """The execution provider for `device` (auto|cpu|cuda|tensorrt), or EngineError if a GPU one
    can't be had.

    This is what the build and the machine offer; whether the provider really loads is only known
    once a session exists (see Engine)."""
    import onnxruntime as ort

    if device not in DEVICES:
        raise EngineError(f"unknown device '{device}'; expected {', '.join(DEVICES)}")
    if device == "cpu":
        return CPU
    wanted = TENSORRT if device == "tensorrt" else CUDA
    has_provider = wanted in ort.get_available_providers()
    has_device = cuda_device_present()
    if has_provider and has_device:
        return wanted
    if device == "cuda":
        why = (
            "no CUDA device found"
            if has_provider
            else ("this onnxruntime build has no CUDAExecutionProvider (install onnxruntime-gpu)")
        )
        raise EngineError(f"--device cuda asked for, but {why}; use --device auto or cpu")
    if device == "tensorrt":
        why = (
            "no CUDA device found"
            if has_provider
            else (
                "this onnxruntime build has no TensorrtExecutionProvider (install onnxruntime-gpu)"
            )
        )
        raise EngineError(f"--device tensorrt asked for, but {why}; use --device cuda, auto or cpu")
    return CPU


@dataclass(frozen=True)
class GpuOptions:
    """How the CUDA provider (and TensorRT) runs, chosen here rather than left to onnxruntime's
    defaults.

    `conv_algo_search`: onnxruntime's default, EXHAUSTIVE, benchmarks every cuDNN algorithm the
    first time each input shape is seen, and the batcher forms up to --max-batch-size shapes: that
    search would land on the request path. HEURISTIC asks cuDNN's heuristics instead (no benchmark,
    maybe a slower algorithm). `tf32`: onnxruntime turns TF32 on by default for fp32 GEMM and
    convolutions on Ampere and newer (10-bit mantissa). Off serves the fp32 numbers the export gates
    certify (they run the CUDA provider with these defaults); on is faster and was not gated.
    `gpu_mem_limit_mb`: cap on the CUDA memory arena (None: none), for a GPU shared with training.
    The arena grows by what is asked (kSameAsRequested), not in powers of two, for the same reason.
    `trt_cache_dir`: where the TensorRT provider keeps built engines and timing caches (building one
    takes minutes); None: ~/.cache/trainserve/tensorrt. Engines are per GPU model and TensorRT
    version.
    """

    conv_algo_search: str = "HEURISTIC"
    tf32: bool = False
    gpu_mem_limit_mb: float | None = None
    trt_cache_dir: str | None = None
    # each batch bucket's session run as a captured CUDA graph (serving/cuda_graphs.py)
    cuda_graphs: bool = False

    def cuda(self, device_id: int = 0) -> dict[str, str]:
        """The CUDAExecutionProvider options (onnxruntime takes strings)."""
        if self.conv_algo_search not in CONV_ALGO_SEARCH:
            raise EngineError(
                f"cudnn_conv_algo_search must be one of {', '.join(CONV_ALGO_SEARCH)}, "
                f"got {self.conv_algo_search!r}"
            )
        options = {
            "device_id": str(device_id),
            "cudnn_conv_algo_search": self.conv_algo_search,
            "use_tf32": "1" if self.tf32 else "0",
            "arena_extend_strategy": "kSameAsRequested",
        }
        if self.gpu_mem_limit_mb:
            options["gpu_mem_limit"] = str(int(self.gpu_mem_limit_mb * (1 << 20)))
        return options

    def tensorrt(self, device_id: int = 0) -> dict[str, str]:
        """The TensorrtExecutionProvider options: engines and timings cached on disk, so that a
        restart does not build them again."""
        cache = self.trt_cache_dir or str(Path.home() / ".cache" / "trainserve" / "tensorrt")
        return {
            "device_id": str(device_id),
            "trt_engine_cache_enable": "1",
            "trt_engine_cache_path": cache,
            "trt_timing_cache_enable": "1",
            "trt_timing_cache_path": cache,
        }


@dataclass(frozen=True)
class BatchBuckets:
    """Batch sizes a run is padded up to, an onnxruntime session each (see Engine and
    serving/README.md).

    `cuda_only`: `--batch-buckets auto`: only when the session really runs on the CUDA provider, the
    one that pays for a change of input shape (decided by the Engine once it knows, so that
    `--device auto` falling back to the CPU opens no more sessions)."""

    sizes: tuple[int, ...] = ()
    cuda_only: bool = False


def preload_cuda_libraries() -> str:
    """Loads the CUDA and cuDNN libraries onnxruntime's CUDA provider links against, from the
    nvidia-* pip packages when they are installed, else from the system loader path; returns what
    onnxruntime reported (its failures), "" when all loaded. Once per process.

    The CUDA provider library has no RPATH: without this, a pip-only setup (no system CUDA) makes
    onnxruntime fall back to the CPU provider. Not needed after `import torch` with a torch of the
    same CUDA major, but the server never imports torch. onnxruntime prints its findings to stdout;
    they are captured here.
    """
    import onnxruntime as ort

    global _preload_report
    if _preload_report is None:
        # onnxruntime >= 1.21
        preload = getattr(ort, "preload_dlls", None)
        if preload is None:
            _preload_report = (
                f"onnxruntime {ort.__version__} has no preload_dlls(): the CUDA libraries must be "
                "on the system loader path"
            )
        else:
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                try:
                    # directory=None: the nvidia-* site packages, then the default loader paths
                    preload()
                except Exception as exc:  # noqa: BLE001
                    # a bad install must not stop a fallback to CPU
                    print(f"onnxruntime.preload_dlls() failed: {exc}")
            _preload_report = " ".join(printed.getvalue().split())
        if _preload_report:
            log.debug("loading the CUDA libraries: %s", _preload_report)
    return _preload_report


_preload_report: str | None = None


def tensorrt_libraries_missing() -> list[str]:
    """The TensorRT libraries the TensorRT provider needs that cannot be loaded (from the loader
    path, or from the tensorrt_libs pip package)."""
    spec = importlib.util.find_spec("tensorrt_libs")
    package_dir = Path(spec.origin).parent if spec and spec.origin else None
    missing = []
    for name in TENSORRT_LIBRARIES:
        for candidate in [name] + ([str(package_dir / name)] if package_dir else []):
            try:
                ctypes.CDLL(candidate)
                break
            except OSError:
                continue
        else:
            missing.append(name)
    return missing


def system_cuda_libraries_missing() -> list[str]:
    """The libraries onnxruntime's CUDA provider needs that the system loader cannot find: what an
    image that serves on CUDA without pip's nvidia-* packages must carry (the Dockerfile checks it
    at build time, where get_available_providers() would list CUDA whatever is installed)."""
    import onnxruntime as ort

    library = Path(ort.__file__).parent / "capi" / "libonnxruntime_providers_cuda.so"
    if not library.is_file():
        return [f"{library.name} (this onnxruntime has no CUDA provider: install onnxruntime-gpu)"]
    ldd = subprocess.run(["ldd", str(library)], capture_output=True, text=True, check=False).stdout
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    cache = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, check=False).stdout
    return missing_libraries(ldd, cache)


def missing_libraries(ldd_output: str, ldconfig_cache: str) -> list[str]:
    """From `ldd <CUDA provider library>` and `ldconfig -p`: the linked libraries "not found",
    except the driver's libcuda.so.1 (the NVIDIA container runtime mounts it when the container
    starts, so a build never has it), then cuDNN 9 if the loader cache lacks it (the provider
    dlopen()s it: ldd does not list it)."""
    missing = [
        line.split("=>")[0].strip() for line in ldd_output.splitlines() if "not found" in line
    ]
    missing = [name for name in missing if not name.startswith("libcuda.so")]
    if not re.search(r"^\s*libcudnn\.so\.9\s", ldconfig_cache, re.MULTILINE):
        missing.append("libcudnn.so.9")
    return missing


def _cuda_major() -> str:
    try:
        from onnxruntime.capi import build_and_package_info

        return str(getattr(build_and_package_info, "cuda_version", "") or "13").split(".")[0]
    except ImportError:
        return "13"


def _not_on_gpu(device: str, wanted: str, ran: str, preload_report: str, printed: str) -> str:
    """Why a session asked for on `wanted` ended up on `ran`, and how to fix it."""
    import onnxruntime as ort

    major = _cuda_major()
    if wanted == TENSORRT:
        cause = (
            f"the TensorRT provider could not initialize (TensorRT 10 with CUDA {major}); fix the TensorRT "
            "install or use --device cuda"
        )
    else:
        cause = (
            f"its CUDA provider could not load. Likely cause: the CUDA {major} and cuDNN 9 libraries "
            f"onnxruntime-gpu {ort.__version__} is built for were not found, neither in nvidia-* pip packages "
            "nor on the system loader path. Fix: pip install 'onnxruntime-gpu[cuda,cudnn]' nvidia-cublas "
            f"(CUDA {major} wheels, which onnxruntime.preload_dlls() finds), or install CUDA {major} and cuDNN 9 "
            "system-wide (ldconfig or LD_LIBRARY_PATH), or use the Docker image; "
            "`python -c 'import onnxruntime; onnxruntime.print_debug_info()'` lists what is found"
        )
    said = "; ".join(x.rstrip(". ") for x in (preload_report, printed) if x)
    return (
        f"--device {device}: onnxruntime created the session on {ran}, not {wanted}: {cause}"
        + (f". onnxruntime said: {clip(said, 600)}" if said else "")
        + (". --device auto would serve on the CPU instead" if device != "auto" else "")
    )


def _open_session(path: str, options: ort.SessionOptions, providers: list) -> ort.InferenceSession:
    """An InferenceSession without onnxruntime's run-time fallback to the CPU (see Engine)."""
    import onnxruntime as ort

    try:
        session = ort.InferenceSession(path, sess_options=options, providers=providers)
    except Exception as exc:
        # onnxruntime raises its own exception types for bad files
        raise EngineError(f"onnxruntime cannot load {path}: {exc}") from exc
    session.disable_fallback()
    return session


def _spec(arg, unranked: set[str]) -> TensorSpec:
    if arg.type not in _ORT_TYPES:
        raise EngineError(
            f"tensor '{arg.name}' has type {arg.type}, which this server does not serve; "
            f"supported: {', '.join(_ORT_TYPES)}"
        )
    dtype, datatype = _ORT_TYPES[arg.type]
    if arg.name in unranked:
        return TensorSpec(arg.name, dtype, datatype, (-1,), ranked=False)
    shape = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in (arg.shape or []))
    return TensorSpec(arg.name, dtype, datatype, shape)


def unranked_tensors(path: str, args) -> set[str]:
    """The names among `args` (onnxruntime's inputs and outputs) whose graph type has no shape at
    all. onnxruntime reports those as [], as it does a scalar: the graph itself is read to tell them
    apart, only when one says []."""
    if not any(not a.shape for a in args):
        return set()
    import onnx

    graph = onnx.load(path, load_external_data=False).graph
    return {
        v.name
        for v in [*graph.input, *graph.output]
        if v.type.HasField("tensor_type") and not v.type.tensor_type.HasField("shape")
    }


def feed_values(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The feeds as onnxruntime's Python API takes them: a BYTES input's elements as str (it would
    run bytes objects as their repr). ModelInputError for an element that is not UTF-8: a STRING
    tensor holds text."""
    out = feeds
    for name, x in feeds.items():
        if x.dtype != object or not x.size:
            continue
        try:
            text = [v.decode("utf-8") if isinstance(v, bytes) else v for v in x.reshape(-1)]
        except UnicodeDecodeError as exc:
            raise ModelInputError(
                f"input '{name}': an element is not UTF-8 text ({exc.reason} at byte {exc.start}); the "
                "model's STRING input takes text"
            ) from None
        if out is feeds:
            out = dict(feeds)
        out[name] = np.array(text, dtype=object).reshape(x.shape)
    return out


def zeros(spec: TensorSpec, shape) -> np.ndarray:
    """A warm-up value of the input's type: zeros; for strings "0" (what a Cast to a number takes,
    as text does)."""
    if spec.dtype == object:
        return np.full(shape, "0", dtype=object)
    return np.zeros(shape, dtype=spec.dtype)


class Engine:
    """An onnxruntime session over one model file, with its tensor specs.

    `batchable`: rows of different requests may be concatenated into one run. Only when the model's
    rows are known to be independent along the first axis (`batching`: True, the operator's say-so;
    None, what the file's metadata records: export checked it, lineage.ROWS_INDEPENDENT; False:
    never) and every input has a dynamic first axis. Otherwise each request runs alone, exactly the
    tensors it was sent. Every run of a batched version checks that each output's first axis is the
    rows it ran (padding included): a mismatch raises NotRowWise and turns batching off for good
    (set_batching), so that no answer is ever cut from another's.

    `batch_buckets`: batch sizes a run is padded up to, each run by a session that only ever sees
    that shape: the CUDA provider redoes its convolutions' cuDNN set-up at every change of a
    session's input shape, and dynamic batching makes a new batch size nearly every run (figures:
    serving/README.md, GPUs). A run past the largest bucket goes in chunks of it. Only for a model
    whose one dynamic axis, in and out, is the batch axis; not under TensorRT (an engine build per
    session; its profile spans the sizes warmed up).

    `device_id` is the CUDA device among those the process sees: CUDA_VISIBLE_DEVICES=2 makes
    the host's third GPU device 0, which is the usual way to pick one. Ignored on CPU.

    Invariant: `provider` is the provider the session really runs on. onnxruntime falls back to the
    CPU when a GPU provider fails to load (missing libraries), printing a note nobody reads; here
    --device cuda|tensorrt then raises EngineError, and auto goes on on the CPU with a warning. The
    session's own run-time fallback (a provider error in a run retried on the CPU for good) is
    switched off: such a run fails its requests instead of silently moving the server to the CPU.
    """

    def __init__(
        self,
        path: str,
        device: str = "auto",
        threads: int | None = None,
        device_id: int = 0,
        gpu: GpuOptions | None = None,
        batch_buckets: BatchBuckets | None = None,
        batching: bool | None = None,
        batching_why: str = "",
    ):
        import onnxruntime as ort

        wanted = choose_provider(device)
        self.threads = threads or usable_cpus()
        self.device_id = device_id
        self.gpu = gpu or GpuOptions()

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
        # Quiet unless --verbose: the placement warnings are noise, and a run's error is a client's
        # 400, which the app logs once in our format.
        options.log_severity_level = ort_severity()
        providers: list = [CPU]
        preload_report = ""
        if wanted in GPU_PROVIDERS:
            # before the session: the provider library needs them
            preload_report = preload_cuda_libraries()
            providers = [(CUDA, self.gpu.cuda(device_id)), CPU]
            if wanted == TENSORRT:
                missing = tensorrt_libraries_missing()
                if missing:
                    raise EngineError(
                        f"--device tensorrt asked for, but the TensorRT 10 libraries {', '.join(missing)} "
                        "cannot be loaded: install TensorRT 10 for CUDA 13 (its lib directory on "
                        "LD_LIBRARY_PATH, or the tensorrt-cu13-libs 10.x pip package), or use --device cuda"
                    )
                providers.insert(0, (TENSORRT, self.gpu.tensorrt(device_id)))
        printed = io.StringIO()
        # onnxruntime prints its provider fallback on stdout
        with contextlib.redirect_stdout(printed):
            self.session = _open_session(path, options, providers)
        self.provider = self.session.get_providers()[0]
        if self.provider != wanted:
            message = _not_on_gpu(
                device, wanted, self.provider, preload_report, " ".join(printed.getvalue().split())
            )
            if device != "auto":
                raise EngineError(message)
            log.warning("%s", message)
        # The options of the provider that runs, as onnxruntime took them: for the log and /metrics.
        self.provider_options: dict[str, str] = {}
        if self.provider in GPU_PROVIDERS:
            asked = dict(p for p in providers if isinstance(p, tuple))[self.provider]
            given = self.session.get_provider_options().get(self.provider, {})
            self.provider_options = {k: str(given.get(k, v)) for k, v in asked.items()}
        args = [*self.session.get_inputs(), *self.session.get_outputs()]
        unranked = unranked_tensors(path, args)
        self.inputs = [_spec(a, unranked) for a in self.session.get_inputs()]
        self.outputs = [_spec(a, unranked) for a in self.session.get_outputs()]
        self.output_names = [o.name for o in self.outputs]
        self.metadata: dict[str, str] = dict(self.session.get_modelmeta().custom_metadata_map)
        self.batchable = False
        # why it is batched or not, for the log
        self.batching = ""
        self.buckets: tuple[int, ...] = ()
        self._bucket_sessions: dict[int, ort.InferenceSession] = {}
        # bucket size -> cuda_graphs.BucketGraph (--cuda-graphs)
        self._graphs: dict = {}
        self._bucket_args = (path, options, providers, batch_buckets or BatchBuckets())
        if batching is None:
            recorded = self.metadata.get(ROWS_INDEPENDENT, "")
            why = (
                f"its file records independent rows ({ROWS_INDEPENDENT}: {recorded})"
                if recorded
                else "no record that its rows are independent (export records it; or --batching "
                "NAME=on, or max_batch_size in its config.pbtxt)"
            )
            self.set_batching(bool(recorded) and self.batch_axis, why)
        else:
            self.set_batching(batching, batching_why or f"batching={batching}")
        if self.gpu.cuda_graphs and not self.batchable:
            raise EngineError(
                f"--cuda-graphs runs each batch bucket as a CUDA graph, and {Path(path).name} is not "
                f"batched ({self.batching}); serve without --cuda-graphs"
            )

    @property
    def batch_axis(self) -> bool:
        """Every input has a known rank and a dynamic first axis: requests' rows could be
        concatenated there."""
        return bool(self.inputs) and all(
            s.ranked and len(s.shape) >= 1 and s.shape[0] == -1 for s in self.inputs
        )

    def set_batching(self, on: bool, why: str) -> None:
        """Whether requests' rows share runs from now on (`why`: for the log). On: EngineError for a
        model with no batch axis; the batch buckets asked for are opened. Off (also while serving,
        on the engine thread, when a run's outputs proved its rows are not independent): each
        request runs alone, no bucket pads it."""
        if on and not self.batch_axis:
            first = next(s for s in self.inputs if not (s.ranked and s.shape and s.shape[0] == -1))
            raise EngineError(
                f"{why} asks for batching, but input '{first.name}' {first.describe()} has no dynamic "
                "first axis to batch along; serve it unbatched"
            )
        self.batchable, self.batching = on, why
        self.inputs = [replace(s, batched=on) for s in self.inputs]
        self.outputs = [replace(s, batched=on) for s in self.outputs]
        if not on:
            self.buckets, self._bucket_sessions, self._graphs = (), {}, {}
        elif not self.buckets:
            self._open_buckets(*self._bucket_args)

    def _open_buckets(
        self, path: str, options: ort.SessionOptions, providers: list, asked: BatchBuckets
    ) -> None:
        """One more session per bucket below the largest (the first session runs that one and longer
        runs)."""
        if self.gpu.cuda_graphs and (self.provider != CUDA or not asked.sizes):
            raise EngineError(
                "--cuda-graphs runs each batch bucket as a CUDA graph: it needs the CUDA provider (this "
                f"session runs on {self.provider}) and batch buckets (--batch-buckets auto or sizes)"
            )
        if not asked.sizes or (asked.cuda_only and self.provider != CUDA):
            return
        why_not = (
            "TensorRT builds an engine per session"
            if self.provider == TENSORRT
            else "an input has a dynamic axis besides the batch axis"
            if self.other_dynamic_axes
            else "an input or output has no dynamic batch axis"
            if not self.inputs
            or not self.batchable
            or any(not s.shape or s.shape[0] != -1 for s in self.outputs)
            else ""
        )
        if why_not and self.gpu.cuda_graphs:
            raise EngineError(
                f"--cuda-graphs: {Path(path).name} can't have batch buckets ({why_not}), which a CUDA "
                "graph needs; serve without --cuda-graphs"
            )
        if why_not:
            log.info(
                "no batch buckets for %s: %s; it runs every batch size in one session",
                Path(path).name,
                why_not,
            )
            return
        if self.provider == CPU:
            # --device auto fell back: the GPU provider would be tried (and said) again
            providers = [CPU]
        sizes = tuple(sorted(set(asked.sizes)))
        # a graph session for every bucket, the largest too; the plain one checks them
        if self.gpu.cuda_graphs:
            try:
                self._graphs = open_graphs(
                    path,
                    options,
                    self.gpu.cuda(self.device_id),
                    sizes,
                    self.inputs,
                    self.outputs,
                    self.device_id,
                    self.session,
                    _open_session,
                )
            except (GraphError, EngineError) as exc:
                raise EngineError(f"--cuda-graphs: {exc}; serve without --cuda-graphs") from exc
            self.buckets = sizes
            return
        for size in sizes[:-1]:
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    self._bucket_sessions[size] = _open_session(path, options, providers)
            except EngineError as exc:
                self._bucket_sessions = {}
                raise EngineError(
                    f"opening the session for batch bucket {size} failed ({exc}); each bucket holds "
                    "a copy of the weights: use fewer --batch-buckets (e.g. 8,32) or off"
                ) from exc
        self.buckets = sizes

    def close(self) -> None:
        """Drop the onnxruntime sessions (their weights and memory arenas) now, not when the last
        reference to this engine goes: an unloaded model must give its memory back even while a late
        request still holds it."""
        self.session = None
        self._bucket_sessions = {}
        self._graphs = {}

    def bucket_for(self, rows: int) -> int:
        """The batch size a run of `rows` rows is padded to: the smallest bucket that holds them;
        `rows` itself without buckets. Past the largest, `run` goes in chunks of it, the last one
        padded."""
        return next((size for size in self.buckets if size >= rows), rows)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One request's feeds (input name -> array, already validated against `inputs`) through the
        model."""
        return self.run_parts([feeds])

    def run_parts(self, parts: list[dict[str, np.ndarray]], observe=None) -> dict[str, np.ndarray]:
        """A batch of requests' feeds (of one layout) through the model: the outputs of all their
        rows, in order.

        The parts concatenated (one part: as it is), padded up to the batch bucket and run by that
        bucket's session; past the largest bucket (one large request) the run goes in chunks of it.
        NaN or Inf in a part: ModelInputError. `observe(feeds, outputs)` sees the batch without
        padding (drift). A batch gathered in a batch buffer runs through `run_gathered` instead."""
        with self._mapped_errors(lambda: sent_shapes(parts)):
            rows = sum(rows_of(p) for p in parts) if self.batchable else 0
            size = self.bucket_for(rows)
            for part in parts:
                check_finite(part)
            feeds = concat(parts)
            # as it is, or in chunks
            if size == rows or rows > (self.buckets[-1] if self.buckets else rows):
                outputs = self._run_unstaged(feeds, rows)
                if self.batchable and not self.buckets:
                    self._check_rows(outputs, rows)
                if observe is not None:
                    observe(feeds, outputs)
                return outputs
            feeds = {
                n: np.concatenate([x, np.repeat(x[-1:], size - rows, axis=0)])
                for n, x in feeds.items()
            }
            return self._run_sized(feeds, rows, size, observe)

    def run_gathered(
        self, feeds: dict[str, np.ndarray], rows: int, observe=None
    ) -> dict[str, np.ndarray]:
        """A batch gathered in a batch buffer (serving/placements.py: checked, pinned on CUDA)
        through the model: `feeds` hold a batch bucket's rows, the first `rows` of them the
        requests' and the rest padding. Run as they are by that bucket's session; the engine writes
        none of them."""
        with self._mapped_errors(lambda: {name: [rows, *x.shape[1:]] for name, x in feeds.items()}):
            return self._run_sized(feeds, rows, rows_of(feeds), observe)

    def batch_buffers(self, capacity: int) -> BatchBuffers | None:
        """A new pool of batch buffers of `capacity` rows for this model's rows (pinned on a GPU),
        for a batcher's placements, which alone use it (serving/placements.py); None for a model
        whose inputs have another dynamic axis or no batch axis."""
        if not self.fixed_rows:
            return None
        return BatchBuffers(self.inputs, capacity, pin=self.provider in GPU_PROVIDERS)

    def _run_sized(
        self, feeds: dict[str, np.ndarray], rows: int, size: int, observe
    ) -> dict[str, np.ndarray]:
        """One run of `size` rows (a bucket's: its own session), the padding's rows cut off the
        outputs again."""
        session, graph = self._bucket_sessions.get(size, self.session), self._graphs.get(size)
        if session is None:
            raise EngineError("the model was unloaded")
        outputs = (
            graph.run(feeds)
            if graph is not None
            else dict(zip(self.output_names, session.run(self.output_names, feed_values(feeds))))
        )
        if self.batchable:
            self._check_rows(outputs, size)
        if size != rows:
            outputs = {name: out[:rows] for name, out in outputs.items()}
            feeds = {name: x[:rows] for name, x in feeds.items()}
        if observe is not None:
            observe(feeds, outputs)
        return outputs

    @contextlib.contextmanager
    def _mapped_errors(self, shapes: Callable[[], dict[str, list[int]]]):
        """NaN/Inf and the errors onnxruntime raises for values it can't compute on ->
        ModelInputError (a 400), naming each input's shape as sent (`shapes()`, without padding)
        beside the shape the model takes: its own words are of a node deep inside ("Add node ... 3
        by 4"). A node's failure (`Fail` too: two inputs of lengths each fine alone but not
        together) is the request's, since inputs were checked against the model's declared shapes;
        out of memory and everything else stay the server's problem."""
        try:
            yield
        except NonFinite as exc:
            raise ModelInputError(str(exc)) from None
        except Exception as exc:
            text = str(exc).strip()
            kind = type(exc).__name__
            if (
                kind in ("InvalidArgument", "RuntimeException")
                or (kind == "Fail" and "while running" in text)
            ) and "memory" not in text.lower():
                first = text.splitlines()[0] if text else kind
                specs = {s.name: s for s in self.inputs}
                sent = ", ".join(
                    f"{name} {shape} (the model takes {specs[name].describe()})"
                    for name, shape in shapes().items()
                    if name in specs
                )
                raise ModelInputError(
                    f"the model cannot compute on these input values: {sent}: {clip(first, 400)}"
                ) from exc
            raise

    def _run_unstaged(self, feeds: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
        """One session run, or with batch buckets one run per chunk of the largest bucket, the last
        one padded."""
        # one look: close() may come from another thread
        session, buckets = (
            self.session,
            self._bucket_sessions,
        )
        if session is None:
            raise EngineError("the model was unloaded")
        if not self.buckets or not rows:
            return dict(zip(self.output_names, session.run(self.output_names, feed_values(feeds))))
        largest = self.buckets[-1]
        chunks = [
            self._run_padded(session, buckets, feeds, start, min(largest, rows - start))
            for start in range(0, rows, largest)
        ]
        return {
            name: chunks[0][i] if len(chunks) == 1 else np.concatenate([c[i] for c in chunks])
            for i, name in enumerate(self.output_names)
        }

    def _run_padded(
        self,
        largest: ort.InferenceSession,
        buckets: dict[int, ort.InferenceSession],
        feeds: dict[str, np.ndarray],
        start: int,
        rows: int,
    ) -> list:
        """Rows start..start+rows of `feeds` by their bucket's session (`largest`'s for the
        largest), padded up to its size with copies of the last row, and the padding's rows cut off
        the outputs again (every output's first axis is the batch axis: see _open_buckets)."""
        size = self.bucket_for(rows)
        part = {name: x[start : start + rows] for name, x in feeds.items()}
        if size != rows:
            part = {
                name: np.concatenate([x, np.repeat(x[-1:], size - rows, axis=0)])
                for name, x in part.items()
            }
        if size in self._graphs:
            outputs = self._graphs[size].run(
                {name: np.ascontiguousarray(x) for name, x in part.items()}
            )
        else:
            run = buckets.get(size, largest).run(self.output_names, feed_values(part))
            outputs = dict(zip(self.output_names, run))
        self._check_rows(outputs, size)
        return [outputs[name][:rows] for name in self.output_names]

    def _check_rows(self, outputs: dict[str, np.ndarray], rows: int) -> None:
        """A batched version's run: every output's first axis is the `rows` it ran, or its rows are
        not independent after all; then batching is off from now on (this is the engine thread), and
        NotRowWise names the shapes."""
        wrong = {n: list(x.shape) for n, x in outputs.items() if not x.ndim or len(x) != rows}
        if wrong:
            self.set_batching(False, f"a run of {rows} rows gave outputs {wrong}")
            raise NotRowWise(
                f"a batched run of {rows} rows gave output(s) "
                + ", ".join(f"'{n}' of shape {shape}" for n, shape in wrong.items())
                + ": each output's first axis must be the rows run, so the model's rows are not "
                "independent; batching is off for this version from now on"
            )

    @property
    def row_bytes(self) -> int:
        """The bytes of one row of every input together (of the whole inputs, for a model without a
        batch axis); 0 when an axis besides the batch one is dynamic (the size is the request's)."""
        if (
            self.other_dynamic_axes
            or any(s.dtype == object for s in self.inputs)
            or (not self.batchable and any(-1 in s.shape for s in self.inputs))
        ):
            return 0
        return nbytes((s.dtype, s.shape[1:] if self.batchable else s.shape) for s in self.inputs)

    @property
    def other_dynamic_axes(self) -> bool:
        """An input has a dynamic axis besides the batch one (a sequence length, an image size), or
        no rank."""
        return any(-1 in s.shape[1:] or not s.ranked for s in self.inputs)

    @property
    def fixed_rows(self) -> bool:
        """Batched, and every input's row is of one fixed byte size (no other dynamic axis, no
        BYTES): what a batch buffer holds."""
        return (
            self.batchable
            and not self.other_dynamic_axes
            and all(s.dtype != object for s in self.inputs)
        )

    def warm_up(self, batch_sizes: tuple[int, ...] = (1,)) -> bool:
        """Run zeros through the model so that the first real request does not pay for allocation
        (and, on a GPU, for cuDNN's choice of algorithms for that input shape).

        Returns False (and runs nothing) when an input has a dynamic axis other than the first one
        (or no rank): no size can be guessed for it safely.
        """
        if self.other_dynamic_axes:
            return False
        sizes = batch_sizes if self.batchable else (1,)
        for n in sizes:
            feeds = {}
            for s in self.inputs:
                shape = (n, *s.shape[1:]) if s.shape and s.shape[0] == -1 else s.shape
                feeds[s.name] = zeros(s, shape)
            self.run(feeds)
        return True

    def options_text(self) -> str:
        """The provider's options, `key=value` comma-separated ("" on the CPU)."""
        return ",".join(f"{k}={v}" for k, v in sorted(self.provider_options.items()))

    def describe(self) -> str:
        import onnxruntime as ort

        ins = ", ".join(f"{s.name} {s.describe()}" for s in self.inputs)
        gpu = (
            f" device {self.device_id} ({self.options_text()})"
            if self.provider in GPU_PROVIDERS
            else ""
        )
        buckets = (
            f", batch buckets {','.join(map(str, self.buckets))} (a session each"
            + (", run as CUDA graphs)" if self._graphs else ")")
            if self.buckets
            else ""
        )
        batched = "batched" if self.batchable else "one request a run"
        return (
            f"{self.provider}{gpu}, {self.threads} intra-op threads{buckets} "
            f"(onnxruntime {ort.__version__}); {batched}: {self.batching}; inputs: {ins}"
        )
