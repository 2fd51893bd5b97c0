"""The GPU paths of serving and of the export gates, checked on a machine without a GPU.

Where onnxruntime's own behaviour can be had here, it is the real one: asked for the CUDA provider
on this CPU-only machine, onnxruntime-gpu really fails to load it (its CUDA 13 libraries are absent)
and creates the session on the CPU provider, exactly what a GPU host without those libraries does.
What only a GPU would show (a session that does come up on CUDA, the options it took) goes through a
fake session that records what it was given.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import yaml
from onnx import TensorProto, helper
from serving_fixtures import ROOT, tiny_model, two_axes_model

from serving import core as serving_app
from serving import engine as serving_engine
from serving.cli import FLAGS, add_arguments, settings_from_args
from serving.config import Settings
from serving.engine import CPU, CUDA, TENSORRT, BatchBuckets, Engine, EngineError, GpuOptions
from serving.loader import LoadedModel, ModelInfo, SourceError, find_onnx, load_model

REAL_GPU = serving_engine.cuda_device_present()
REAL_SESSION = ort.InferenceSession
no_real_gpu = pytest.mark.skipif(
    REAL_GPU, reason="a real GPU is here: the CUDA provider may well load"
)


class FakeSession:
    """Stands in for onnxruntime.InferenceSession: records what it was given, runs on `runs_on`."""

    runs_on: list[str] = [CUDA, CPU]
    created: list[dict] = []

    def __init__(self, path, sess_options=None, providers=None):
        self.providers = providers
        self.fallback = True
        type(self).created.append({"path": path, "providers": providers, "options": sess_options})
        # for the model's inputs and outputs
        self._real = REAL_SESSION(path, providers=[CPU])

    def disable_fallback(self):
        self.fallback = False

    def get_providers(self):
        asked = [p[0] if isinstance(p, tuple) else p for p in self.providers]
        return [p for p in self.runs_on if p in asked]

    def get_provider_options(self):
        return {
            name: dict(opts)
            for name, opts in (p for p in self.providers if isinstance(p, tuple))
            if name in self.runs_on
        }

    # get_inputs, get_outputs, get_modelmeta, run
    def __getattr__(self, name):
        return getattr(self._real, name)


@pytest.fixture
def fake_gpu(monkeypatch):
    """A GPU as choose_provider sees it, preload_dlls recorded, sessions faked (on CUDA unless
    told)."""
    events: list[str] = []
    monkeypatch.setattr(serving_engine, "cuda_device_present", lambda: True)
    monkeypatch.setattr(ort, "get_available_providers", lambda: [TENSORRT, CUDA, CPU])
    monkeypatch.setattr(serving_engine, "_preload_report", None)
    monkeypatch.setattr(ort, "preload_dlls", lambda **kw: events.append("preload"), raising=False)

    class Recording(FakeSession):
        runs_on = [CUDA, CPU]
        created = []

        def __init__(self, *args, **kwargs):
            events.append("session")
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", Recording)
    return SimpleNamespace(events=events, session=Recording)


# ---- A.3: --device cuda is enforced; the CUDA libraries are preloaded ---------------------------


@no_real_gpu
def test_device_cuda_whose_provider_does_not_load_refuses_naming_provider_cause_and_fix(
    tmp_path, monkeypatch
):
    """The real onnxruntime-gpu on a host that has a GPU but not CUDA 13 / cuDNN 9 where it looks:
    the session comes up on the CPU. Before the fix this served on the CPU with --device cuda."""
    monkeypatch.setattr(serving_engine, "cuda_device_present", lambda: True)
    if CUDA not in ort.get_available_providers():
        pytest.skip("this onnxruntime has no CUDA provider")
    with pytest.raises(EngineError) as caught:
        Engine(str(tiny_model(tmp_path / "m.onnx")), device="cuda", threads=1)
    message = str(caught.value)
    assert (
        "onnxruntime created the session on CPUExecutionProvider, not CUDAExecutionProvider"
        in message
    )
    assert (
        "CUDA 13 and cuDNN 9" in message and "pip install 'onnxruntime-gpu[cuda,cudnn]'" in message
    )
    # what preload_dlls could not find, as onnxruntime said it
    assert "libcublasLt.so.13" in message


@no_real_gpu
def test_device_auto_falls_back_to_the_cpu_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(serving_engine, "cuda_device_present", lambda: True)
    if CUDA not in ort.get_available_providers():
        pytest.skip("this onnxruntime has no CUDA provider")
    engine = Engine(str(tiny_model(tmp_path / "m.onnx")), device="auto", threads=1)
    assert engine.provider == CPU and engine.provider_options == {}
    assert any(
        r.levelname == "WARNING" and "not CUDAExecutionProvider" in r.getMessage()
        for r in caplog.records
    )


def test_cuda_session_is_created_after_preload_with_explicit_options(tmp_path, fake_gpu):
    engine = Engine(str(tiny_model(tmp_path / "m.onnx")), device="cuda", threads=1, device_id=1)
    assert fake_gpu.events == ["preload", "session"]
    (created,) = fake_gpu.session.created
    assert created["providers"] == [
        (
            CUDA,
            {
                "device_id": "1",
                "cudnn_conv_algo_search": "HEURISTIC",
                "use_tf32": "0",
                "arena_extend_strategy": "kSameAsRequested",
            },
        ),
        CPU,
    ]
    assert engine.provider == CUDA and engine.session.fallback is False
    assert (
        "use_tf32=0" in engine.describe()
        and "cudnn_conv_algo_search=HEURISTIC" in engine.describe()
    )
    # The flags reach the options.
    gpu = GpuOptions(conv_algo_search="EXHAUSTIVE", tf32=True, gpu_mem_limit_mb=512)
    Engine(str(tmp_path / "m.onnx"), device="cuda", threads=1, gpu=gpu)
    assert fake_gpu.session.created[-1]["providers"][0] == (
        CUDA,
        {
            "device_id": "0",
            "cudnn_conv_algo_search": "EXHAUSTIVE",
            "use_tf32": "1",
            "arena_extend_strategy": "kSameAsRequested",
            "gpu_mem_limit": str(512 << 20),
        },
    )
    # once per process
    assert fake_gpu.events.count("preload") == 1


def test_cpu_never_preloads_and_a_missing_preload_dlls_is_tolerated(
    tmp_path, fake_gpu, monkeypatch
):
    engine = Engine(str(tiny_model(tmp_path / "m.onnx")), device="cpu", threads=1)
    assert fake_gpu.events == ["session"] and fake_gpu.session.created[0]["providers"] == [CPU]
    assert engine.describe().startswith("CPUExecutionProvider, 1 intra-op threads")
    monkeypatch.delattr(ort, "preload_dlls")
    Engine(str(tmp_path / "m.onnx"), device="cuda", threads=1)
    assert "has no preload_dlls()" in serving_engine._preload_report


def test_flags_and_environment_reach_the_provider_options(monkeypatch):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    monkeypatch.setenv("TRAINSERVE_ALLOW_TF32", "1")
    args = parser.parse_args(
        [
            "--model",
            "m.onnx",
            "--cudnn-conv-algo-search",
            "EXHAUSTIVE",
            "--gpu-mem-limit-mb",
            "256",
            "--variant",
            "fp16",
            "--device",
            "cuda",
        ]
    )
    settings = settings_from_args(args)
    assert settings.variant == "fp16"
    assert settings.gpu_options().cuda() == {
        "device_id": "0",
        "cudnn_conv_algo_search": "EXHAUSTIVE",
        "use_tf32": "1",
        "arena_extend_strategy": "kSameAsRequested",
        "gpu_mem_limit": str(256 << 20),
    }
    assert {
        "variant",
        "cudnn-conv-algo-search",
        "allow-tf32",
        "gpu-mem-limit-mb",
        "trt-cache-dir",
    } <= set(FLAGS)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"variant": "fp16", "device": "cpu"}, "--variant fp16 is for the CUDA provider"),
        ({"variant": "bf16"}, "--variant must be fp32, fp16, int8, uint8 or auto"),
        (
            {"cuda_graphs": True, "batch_buckets": "off"},
            "--cuda-graphs runs each batch bucket as a CUDA graph",
        ),
        ({"allow_tf32": True, "device": "cpu"}, "--allow-tf32 only apply to a GPU"),
        (
            {"cudnn_conv_algo_search": "FAST"},
            "--cudnn-conv-algo-search must be HEURISTIC, EXHAUSTIVE, DEFAULT",
        ),
        (
            {"trt_cache_dir": "/tmp/x", "device": "cuda"},
            "--trt-cache-dir only applies to --device tensorrt",
        ),
        ({"device": "gpu"}, "--device must be auto, cpu, cuda, tensorrt"),
    ],
)
def test_gpu_settings_are_checked_at_load_time(values, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Settings(model="m.onnx", **values).check()


def test_compose_gpu_server_asks_for_cuda():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert (
        compose["services"]["server"]["environment"]["TRAINSERVE_DEVICE"] == "${SERVE_DEVICE:-cuda}"
    )


# ---- TensorRT ------------------------------------------------------------------------------------


def test_tensorrt_without_a_gpu_is_refused(tmp_path):
    if REAL_GPU:
        pytest.skip("a real GPU is here")
    with pytest.raises(EngineError, match="--device tensorrt asked for, but no CUDA device found"):
        Engine(str(tiny_model(tmp_path / "m.onnx")), device="tensorrt")


def test_tensorrt_without_its_libraries_is_refused_naming_them(tmp_path, fake_gpu):
    if not serving_engine.tensorrt_libraries_missing():
        pytest.skip("TensorRT is installed here")
    with pytest.raises(
        EngineError, match=r"TensorRT 10 libraries libnvinfer\.so\.10, libnvonnxparser\.so\.10"
    ):
        Engine(str(tiny_model(tmp_path / "m.onnx")), device="tensorrt")
    # refused before any session
    assert fake_gpu.session.created == []


def test_tensorrt_session_caches_its_engines(tmp_path, fake_gpu, monkeypatch):
    monkeypatch.setattr(serving_engine, "tensorrt_libraries_missing", lambda: [])
    fake_gpu.session.runs_on = [TENSORRT, CUDA, CPU]
    cache = str(tmp_path / "trt")
    engine = Engine(
        str(tiny_model(tmp_path / "m.onnx")), device="tensorrt", gpu=GpuOptions(trt_cache_dir=cache)
    )
    providers = fake_gpu.session.created[0]["providers"]
    assert [p[0] if isinstance(p, tuple) else p for p in providers] == [TENSORRT, CUDA, CPU]
    assert providers[0][1] == {
        "device_id": "0",
        "trt_engine_cache_enable": "1",
        "trt_engine_cache_path": cache,
        "trt_timing_cache_enable": "1",
        "trt_timing_cache_path": cache,
    }
    assert engine.provider == TENSORRT
    # TensorRT did not come up: refused, not served on plain CUDA
    fake_gpu.session.runs_on = [
        CUDA,
        CPU,
    ]
    with pytest.raises(
        EngineError,
        match="created the session on CUDAExecutionProvider, not TensorrtExecutionProvider",
    ):
        Engine(str(tmp_path / "m.onnx"), device="tensorrt")


# ---- A.6: the fp16 variant is servable -----------------------------------------------------------


def model_dir(tmp_path: Path, *names: str) -> Path:
    directory = tmp_path / "model"
    directory.mkdir(parents=True)
    for name in names:
        tiny_model(directory / name)
    return directory


def test_loader_picks_each_variants_file(tmp_path):
    both = model_dir(
        tmp_path, "model.onnx", "model.fp16.onnx", "model.int8.onnx", "model.optimized.onnx"
    )
    assert find_onnx(both).name == "model.onnx"
    assert find_onnx(both, "fp16").name == "model.fp16.onnx"
    assert find_onnx(both, "int8").name == "model.int8.onnx"
    only_fp32 = model_dir(tmp_path / "a", "model.onnx")
    with pytest.raises(SourceError, match=r"no model\.fp16\.onnx under .*export\.fp16=true"):
        find_onnx(only_fp32, "fp16")
    only_fp16 = model_dir(tmp_path / "b", "model.fp16.onnx")
    with pytest.raises(SourceError, match="only variant models .* --variant fp16, int8 or uint8"):
        find_onnx(only_fp16)
    with pytest.raises(SourceError, match=r"no model\.int8\.onnx under .*export\.int8=true"):
        find_onnx(only_fp32, "int8")
    custom = model_dir(tmp_path / "c", "net.onnx")
    assert find_onnx(custom).name == "net.onnx"
    with pytest.raises(
        SourceError, match=r"no model\.uint8\.onnx under .*export\.uint8_inputs=true"
    ):
        find_onnx(only_fp32, "uint8")
    assert (
        find_onnx(model_dir(tmp_path / "d", "model.onnx", "model.uint8.onnx"), "uint8").name
        == "model.uint8.onnx"
    )


def test_cuda_graphs_are_refused_with_the_reason_where_they_cannot_run(tmp_path, fake_gpu):
    """A CUDA graph needs the CUDA provider and a batch bucket's one shape: a CPU session, or a
    model whose buckets can't be made (another dynamic axis), is refused at load, never served
    another way."""
    model = str(tiny_model(tmp_path / "m.onnx"))
    r = subprocess.run(
        [sys.executable, "-m", "serving", "--model", model, "--cuda-graphs", "--device", "cpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--cuda-graphs only apply to a GPU" in r.stderr, r.stderr
    # --device auto, which falls back to the CPU here: the engine refuses, naming why
    if not REAL_GPU:
        r = subprocess.run(
            [sys.executable, "-m", "serving", "--model", model, "--cuda-graphs"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        out = r.stdout + r.stderr
        assert (
            r.returncode != 0 and "--cuda-graphs runs each batch bucket as a CUDA graph" in out
        ), out[-2000:]
        assert "this session runs on CPUExecutionProvider" in out
    with pytest.raises(
        EngineError,
        match=r"--cuda-graphs: dyn\.onnx can't have batch buckets \(an input has a dynamic "
        r"axis besides the batch axis\)",
    ):
        Engine(
            str(two_axes_model(tmp_path / "dyn.onnx")),
            device="cuda",
            gpu=GpuOptions(cuda_graphs=True),
            batch_buckets=BatchBuckets((1, 2, 4), cuda_only=True),
            batching=True,
        )


def test_fp16_variant_is_refused_on_the_cpu_with_a_clear_message(tmp_path):
    directory = model_dir(tmp_path, "model.onnx", "model.fp16.onnx")
    if not REAL_GPU:
        with pytest.raises(EngineError, match="--variant fp16 is served on the CUDA provider only"):
            load_model(str(directory), device="auto", threads=1, variant="fp16")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "serving",
            "--model",
            str(directory),
            "--variant",
            "fp16",
            "--device",
            "cpu",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--variant fp16 is for the CUDA provider" in r.stderr


@no_real_gpu
def test_fp16_variant_whose_gpu_provider_did_not_load_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(serving_engine, "cuda_device_present", lambda: True)
    if CUDA not in ort.get_available_providers():
        pytest.skip("this onnxruntime has no CUDA provider")
    directory = model_dir(tmp_path, "model.onnx", "model.fp16.onnx")
    with pytest.raises(EngineError, match="CUDA provider only .*runs on CPUExecutionProvider here"):
        load_model(str(directory), device="auto", threads=1, variant="fp16")


def test_fp16_variant_on_cuda_loads_model_fp16(tmp_path, fake_gpu):
    directory = model_dir(tmp_path, "model.onnx", "model.fp16.onnx")
    model = load_model(str(directory), device="cuda", threads=1, variant="fp16")
    assert (
        Path(fake_gpu.session.created[0]["path"]).name == "model.fp16.onnx"
        and model.variant == "fp16"
    )


def test_the_fp16_file_is_logged_inside_the_registered_model(tmp_path, monkeypatch):
    import mlflow

    from pipeline import tracking
    from pipeline.tracking import log_beside_model

    monkeypatch.chdir(tmp_path)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    # Not the experiment id another test left active in this process (it does not exist in this
    # store).
    experiment = mlflow.create_experiment(
        "fp16-beside", artifact_location=(tmp_path / "artifacts").as_uri()
    )
    fp32, fp16 = (
        tiny_model(tmp_path / "model.onnx"),
        tiny_model(tmp_path / "model.fp16.onnx", seed=1),
    )
    try:
        with mlflow.start_run(experiment_id=experiment):
            uri = tracking.log_onnx_model(
                onnx.load(str(fp32)),
                {"input": np.zeros((1, 1, 8, 8), np.float32)},
                None,
                [CPU],
                metadata={},
            )
            log_beside_model(uri, fp16)
        version = mlflow.register_model(uri, "tiny-variants").version
        local = Path(
            mlflow.artifacts.download_artifacts(
                f"models:/tiny-variants/{version}", dst_path=str(tmp_path / "down")
            )
        )
    finally:
        mlflow.set_tracking_uri("")
    assert find_onnx(local).read_bytes() == fp32.read_bytes()
    assert find_onnx(local, "fp16").read_bytes() == fp16.read_bytes()


# ---- A.5 / A.6: every export gate records the provider it ran on ---------------------------------


class Mean(torch.nn.Module):
    def forward(self, x):
        return x.mean(1)


@pytest.fixture
def mean_export(tmp_path):
    """x.mean(1) as a PyTorch head and as a hand-made ONNX graph, on 20 validation rows."""
    from pipeline.artifact import gates
    from pipeline.artifact.onnx_export import ExportHead
    from pipeline.config import ExportConfig
    from pipeline.tasks.regression import Regression

    graph = helper.make_graph(
        [helper.make_node("ReduceMean", ["input"], ["prediction"], axes=[1], keepdims=0)],
        "mean",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 6])],
        [helper.make_tensor_value_info("prediction", TensorProto.FLOAT, ["batch"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    path = tmp_path / "mean.onnx"
    onnx.save(model, str(path))
    x = torch.rand(20, 6, generator=torch.Generator().manual_seed(0))
    # (inputs, target) pairs
    val = torch.utils.data.TensorDataset(x, x.mean(1))
    task = Regression()
    head = ExportHead(Mean(), task, ["input"], True)
    batches, _ = gates.parity_batches(val, {}, head, sizes=(1, 7))
    # what rebuild() gives export
    ref = SimpleNamespace(head=head, task=task, splits=SimpleNamespace(val=val))
    return SimpleNamespace(path=path, model=model, ref=ref, batches=batches, cfg=ExportConfig())


def test_every_gate_records_the_provider_it_ran_on(mean_export):
    from pipeline.artifact import gates
    from pipeline.artifact.rebuild import run_gates

    e = mean_export
    results = run_gates(gates.session(e.path), e.ref, e.batches, e.cfg)
    assert set(results) == {"parity.b1", "parity.b7", "parity.val", "rmse"}
    assert all(g["passed"] and g["provider"] == CPU for g in results.values()), results


@no_real_gpu
def test_a_gate_asked_for_cuda_that_onnxruntime_ran_on_the_cpu_fails_naming_it(mean_export):
    """The real fallback: onnxruntime-gpu asked for [CUDA, CPU] here creates a CPU session. Before
    the fix the gate measured the CPU and called it CUDA."""
    from pipeline import export
    from pipeline.artifact import gates
    from pipeline.artifact.rebuild import run_gates

    e = mean_export
    if CUDA not in ort.get_available_providers():
        pytest.skip("this onnxruntime has no CUDA provider")
    sess = gates.session(e.path, [(CUDA, export._cuda_options()), CPU])
    results = run_gates(sess, e.ref, e.batches, e.cfg, provider=CUDA)
    assert list(results) == ["provider"] and not results["provider"]["passed"]
    assert results["provider"]["provider"] == CPU
    assert (
        "asked for CUDAExecutionProvider, but onnxruntime created the session on CPUExecutionProvider"
        in results["provider"]["message"]
    )


@no_real_gpu
def test_fp16_gate_asserts_and_records_its_provider(mean_export, tmp_path):
    from pipeline import export
    from pipeline.artifact import gates

    e = mean_export
    fp16 = tmp_path / "mean.fp16.onnx"
    onnx.save(gates.to_fp16(e.model), str(fp16))
    on_cpu = export._fp16_gates(fp16, e.ref, e.batches, e.cfg, on_cuda=False)
    assert all(g["passed"] for g in on_cpu.values()), on_cpu
    assert {g["provider"] for k, g in on_cpu.items() if k != "fp16.checker"} == {CPU}
    # asked for CUDA, ran on the CPU: fails, naming it
    if CUDA in ort.get_available_providers():
        on_cuda = export._fp16_gates(fp16, e.ref, e.batches, e.cfg, on_cuda=True)
        assert (
            not on_cuda["fp16.provider"]["passed"] and on_cuda["fp16.provider"]["provider"] == CPU
        )


def test_export_gates_cuda_only_where_a_cuda_provider_really_runs(mean_export, monkeypatch):
    from pipeline import export

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert export._cuda_session(mean_export.path) == (None, "no CUDA device here")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    if CUDA in ort.get_available_providers() and not REAL_GPU:
        sess, why = export._cuda_session(mean_export.path)
        assert (
            sess is None
            and "CUDA provider did not load (the session ran on CPUExecutionProvider)" in why
        )


# ---- A.7: warm-up --------------------------------------------------------------------------------


class RecordingEngine:
    def __init__(self, provider: str):
        self.provider = provider
        self.calls: list[tuple[tuple[int, ...], str]] = []
        self.batchable = True
        self.buckets = ()
        self.inputs = self.outputs = []
        self.output_names = []

    def warm_up(self, sizes):
        self.calls.append((tuple(sizes), threading.current_thread().name))
        return True

    def options_text(self):
        return ""

    def describe(self):
        return self.provider


def test_warm_up_covers_every_batch_size_on_a_gpu_and_two_on_the_cpu():
    for provider in (CUDA, TENSORRT):
        engine = RecordingEngine(provider)
        serving_app.warm_up(LoadedModel(engine, ModelInfo("m", "1", "m.onnx")), 32)
        ((sizes, _),) = engine.calls
        assert sorted(sizes) == list(range(1, 33)) and sizes[:2] == (32, 1)
    engine = RecordingEngine(CPU)
    serving_app.warm_up(LoadedModel(engine, ModelInfo("m", "1", "m.onnx")), 32)
    assert engine.calls[0][0] == (1, 32)


def test_on_cuda_the_server_pads_to_power_of_two_buckets_a_session_each_and_warms_each_once(
    tmp_path, fake_gpu
):
    path = str(tiny_model(tmp_path / "m.onnx"))
    source = Settings(model=path).sources()[0]
    model = serving_app.open_source(Settings(model=path, device="cuda", max_batch_size=8), source)
    assert model.engine.buckets == (1, 2, 4, 8)
    options = [c["providers"][0] for c in fake_gpu.session.created]
    assert len(options) == 4 and all(
        p[0] == CUDA and p[1]["cudnn_conv_algo_search"] == "HEURISTIC" for p in options
    )
    assert "batch buckets 1,2,4,8 (a session each)" in model.engine.describe()
    assert serving_app.warm_up_sizes(model.engine, 8) == (1, 2, 4, 8)

    fake_gpu.session.created.clear()
    model = serving_app.open_source(
        Settings(model=path, device="cuda", max_batch_size=8, batch_buckets="off"), source
    )
    assert model.engine.buckets == () and len(fake_gpu.session.created) == 1
    # every size, as before
    assert serving_app.warm_up_sizes(model.engine, 8) == (
        8,
        1,
        2,
        3,
        4,
        5,
        6,
        7,
    )
    assert Settings(model=path, max_batch_size=24).bucket_sizes() == BatchBuckets(
        (1, 2, 4, 8, 16, 24), cuda_only=True
    )
    assert Settings(model=path, max_batch_size=8, batch_buckets="4").bucket_sizes() == BatchBuckets(
        (4, 8)
    )

    # --device auto whose CUDA provider does not load: the CPU, where auto's buckets do not pay: one
    # session, no second try of the CUDA provider per bucket.
    fake_gpu.session.created.clear()
    fake_gpu.session.runs_on = [CPU]
    model = serving_app.open_source(Settings(model=path, device="auto", max_batch_size=8), source)
    assert (
        model.engine.provider == CPU
        and model.engine.buckets == ()
        and len(fake_gpu.session.created) == 1
    )
    fake_gpu.session.created.clear()
    model = serving_app.open_source(
        Settings(model=path, device="auto", max_batch_size=8, batch_buckets="4"), source
    )
    assert model.engine.buckets == (4, 8) and [c["providers"] for c in fake_gpu.session.created][
        1:
    ] == [[CPU]]


def test_a_reloads_warm_up_runs_on_the_engine_thread_one_size_at_a_time(tmp_path):
    current = load_model(str(tiny_model(tmp_path / "m.onnx")), device="cpu", threads=1)
    server = serving_app.Server(Settings(model="models:/m@champion", max_batch_size=4), current)
    new = RecordingEngine(CUDA)
    try:
        asyncio.run(server.warm_up.between_batches(LoadedModel(new, ModelInfo("m", "2", "x"))))
    finally:
        server.executor.shutdown(wait=True)
    assert [sizes for sizes, _ in new.calls] == [(4,), (1,), (2,), (3,)]
    # the thread every live batch runs on
    assert {thread for _, thread in new.calls} == {"engine_0"}


# ---- A.11: the image's build-time check looks at the libraries -----------------------------------


def test_missing_cuda_libraries_are_read_from_ldd_and_the_loader_cache():
    ldd = (
        "\tlinux-vdso.so.1 (0x00007f)\n\tlibcublasLt.so.13 => not found\n"
        "\tlibcudart.so.13 => /usr/local/cuda/lib64/libcudart.so.13 (0x00007f)\n\tlibcuda.so.1 => not found\n"
    )
    assert serving_engine.missing_libraries(ldd, "") == ["libcublasLt.so.13", "libcudnn.so.9"]
    cache = "\tlibcudnn.so.9 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcudnn.so.9\n"
    assert (
        serving_engine.missing_libraries(ldd.replace("libcublasLt.so.13 => not found", ""), cache)
        == []
    )


def test_the_dockerfile_checks_the_libraries_not_the_provider_list():
    text = (ROOT / "Dockerfile").read_text()
    assert "system_cuda_libraries_missing" in text and "get_available_providers()," not in text
    if CUDA in ort.get_available_providers() and serving_engine.system_cuda_libraries_missing():
        # Here the old check (the provider list) passes while the provider cannot load: the new one
        # fails.
        code = re.search(
            r'&& (python -c "import sys; from serving\.engine import .*?)" \\\n    && rm',
            text,
            re.S,
        )
        command = code.group(1).replace("\\\n", "") + '"'
        proc = subprocess.run(
            ["bash", "-c", command.replace("python", sys.executable, 1)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert (
            proc.returncode == 1
            and "libraries not found" in proc.stderr
            and "libcublasLt.so.13" in proc.stderr
        )


def test_variant_auto_on_a_gpu_takes_the_gated_fp16_when_the_export_measured_nothing_there(
    tmp_path, monkeypatch, caplog
):
    """An export on a CPU machine measures no GPU: `--variant auto` on a GPU then serves the
    version's gated fp16 file (the GPU's fast path) and says why; what the export did measure on the
    GPU decides when there is a measurement; the CPU is never given fp16. A real SQLite registry."""
    import mlflow

    from serving import lineage
    from serving.loader import _auto_variant

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    previous = mlflow.get_tracking_uri()
    # (another test of this process may have set one: it wins over the variable)
    mlflow.set_tracking_uri(uri)
    try:
        client = mlflow.MlflowClient(uri)
        client.create_registered_model("m")
        fp16_only = {
            lineage.SHA256: json.dumps({"model.fp16.onnx": "ab" * 32}),
            lineage.FASTEST_VARIANTS: json.dumps({CPU: "fp32"}),
        }
        measured = {**fp16_only, lineage.FASTEST_VARIANTS: json.dumps({CPU: "fp32", CUDA: "fp32"})}
        for tags in (fp16_only, measured, {}):
            client.create_model_version("m", str(tmp_path), tags=tags)
        with caplog.at_level("INFO", logger="serving.loader"):
            assert _auto_variant("models:/m/1", "version", None, CUDA) == "fp16"
        assert "its gated fp16 variant" in caplog.text
        assert _auto_variant("models:/m/1", "version", None, CPU) == "fp32"
        # measured there: fp32 was faster
        assert _auto_variant("models:/m/2", "version", None, CUDA) == "fp32"
        # no fp16 file passed its gates
        assert _auto_variant("models:/m/3", "version", None, CUDA) == "fp32"
    finally:
        mlflow.set_tracking_uri(previous)
