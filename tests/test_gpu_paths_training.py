"""The training branches a GPU takes, proven on CPU by forcing them (review gpu-paths-a1205b7, A and
B): FSDP2 with channels_last and with bf16 BatchNorm, precision=auto on old and new GPUs, a CPU
checkpoint resumed on a GPU node, divergence as a collective, no host sync per step, GPU system
metrics, torch.compile and persistent loader workers."""

from __future__ import annotations

import logging
import os
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import (
    CPU1,
    REPO,
    TINY,
    checkpoint_meta,
    cli_env,
    mlflow_client,
    mlp_spec,
    resnet_spec,
    run_killing_group,
)
from torch import nn

from pipeline import checkpoint, tracking
from pipeline.checkpoint import dcp_read
from pipeline.components import amp
from pipeline.components.build import instantiate_model
from pipeline.components.data import make_train_loader, to_device
from pipeline.config import ConfigError, TrackingConfig, TrainConfig, load_config
from pipeline.distributed import DistInfo, parallelize
from pipeline.plan import BatchPlan
from pipeline.train import Learner, TrainingDiverged, mean_loss_over_ranks, new_window, train_step


@pytest.fixture
def world_of_one(tmp_path):
    """A real gloo process group of one in this process (FSDP2 needs its device mesh), destroyed
    after."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield DistInfo(0, 1, 0, 1, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def batch(rows=8, size=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(rows, 1, size, size, generator=g), torch.randint(0, 10, (rows,), generator=g)


def spy_fully_shard(monkeypatch) -> list[tuple[nn.Module, bool, torch.dtype | None]]:
    """Every fully_shard call: the module, whether all its parameters were contiguous, the policy's
    param dtype."""
    import torch.distributed.fsdp as fsdp

    calls = []
    real = fsdp.fully_shard

    def spy(module, **kwargs):
        policy = kwargs.get("mp_policy")
        calls.append(
            (
                module,
                all(p.is_contiguous() for p in module.parameters()),
                policy.param_dtype if policy else None,
            )
        )
        return real(module, **kwargs)

    monkeypatch.setattr(fsdp, "fully_shard", spy)
    return calls


# --- A.1: FSDP2 + channels_last ----------------------------------------------------------------


def test_fsdp_with_channels_last_shards_contiguous_weights_and_trains_on_nhwc_inputs(
    world_of_one, monkeypatch
):
    """FSDP2 raises NotImplementedError on a non-contiguous parameter; a channels_last 3x3 conv
    weight is one. The CUDA branch, forced on CPU: weights stay contiguous, the inputs go NHWC, a
    step trains."""
    monkeypatch.setattr(
        parallelize, "uses_channels_last", lambda cfg, info, model=None: cfg.channels_last
    )
    calls = spy_fully_shard(monkeypatch)
    torch.manual_seed(0)
    model = parallelize.wrap_model(
        instantiate_model(resnet_spec()),
        TrainConfig(strategy="fsdp", channels_last=True),
        "fp32",
        world_of_one,
    )
    assert calls and all(contiguous for _, contiguous, _ in calls)
    x, y = batch()
    assert to_device(x, world_of_one.device, channels_last=True).is_contiguous(
        memory_format=torch.channels_last
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss, _ = train_step(
        Learner(
            model=model,
            optimizer=opt,
            scaler=amp.grad_scaler("fp32", world_of_one.device),
            device=world_of_one.device,
            precision="fp32",
            loss_fn=F.cross_entropy,
            channels_last=True,
        ),
        [(x, y)],
        want_norm=False,
    )
    assert torch.isfinite(loss)


def test_ddp_with_channels_last_still_puts_the_weights_in_nhwc(world_of_one, monkeypatch):
    monkeypatch.setattr(
        parallelize, "uses_channels_last", lambda cfg, info, model=None: cfg.channels_last
    )
    model = parallelize.wrap_model(
        instantiate_model(resnet_spec()), TrainConfig(channels_last=True), "fp32", world_of_one
    )
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.weight.shape[1] > 1]
    assert convs and all(c.weight.is_contiguous(memory_format=torch.channels_last) for c in convs)


# --- A.2: FSDP2 mixed precision and BatchNorm ---------------------------------------------------


def spy_weight_dtypes(monkeypatch) -> dict[str, list]:
    """The dtypes batch_norm and conv2d are called with: what the kernels see, after FSDP2's
    casts."""
    seen = {"bn": [], "conv": []}
    real_bn, real_conv = F.batch_norm, F.conv2d

    def bn(input, running_mean, running_var, weight=None, bias=None, *args, **kwargs):
        seen["bn"].append((weight.dtype, running_mean.dtype))
        return real_bn(input, running_mean, running_var, weight, bias, *args, **kwargs)

    def conv(input, weight, *args, **kwargs):
        seen["conv"].append(weight.dtype)
        return real_conv(input, weight, *args, **kwargs)

    monkeypatch.setattr(F, "batch_norm", bn)
    monkeypatch.setattr(F, "conv2d", conv)
    return seen


def test_fsdp_bf16_keeps_batchnorm_in_fp32_and_casts_the_convolutions(world_of_one, monkeypatch):
    """A bf16 BatchNorm weight with its fp32 running statistics: 'expected scalar type BFloat16 but
    found Float', on CPU as on CUDA. Each BatchNorm is its own fp32 unit; the convolutions still get
    bf16."""
    torch.manual_seed(0)
    model = parallelize.wrap_model(
        instantiate_model(resnet_spec()), TrainConfig(strategy="fsdp"), "bf16", world_of_one
    )
    seen = spy_weight_dtypes(monkeypatch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss, _ = train_step(
        Learner(
            model=model,
            optimizer=opt,
            scaler=amp.grad_scaler("bf16", world_of_one.device),
            device=world_of_one.device,
            precision="bf16",
            loss_fn=F.cross_entropy,
            clip_grad_norm=1.0,
        ),
        [batch()],
        want_norm=True,
    )
    assert torch.isfinite(loss)
    assert len(seen["bn"]) == 20 and set(seen["bn"]) == {(torch.float32, torch.float32)}
    assert len(seen["conv"]) == 20 and set(seen["conv"]) == {torch.bfloat16}
    # the sharded masters stay fp32
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_fsdp_bf16_gives_sync_batchnorm_an_fp32_unit_too(world_of_one, monkeypatch):
    """SyncBatchNorm (CUDA's train.sync_batchnorm) is a _BatchNorm as well. Its training forward has
    no CPU kernel, so the eval forward shows the dtypes (it calls the same batch_norm)."""
    calls = spy_fully_shard(monkeypatch)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(instantiate_model(resnet_spec()))
    model = parallelize.shard(model, [], "bf16")
    norms = [m for m, _, dtype in calls if isinstance(m, nn.SyncBatchNorm)]
    assert len(norms) == 20 and all(
        dtype is None for m, _, dtype in calls if isinstance(m, nn.SyncBatchNorm)
    )
    # the blocks come after the norms they hold
    assert calls[len(norms)][2] == torch.bfloat16
    seen = spy_weight_dtypes(monkeypatch)
    model.eval()
    with torch.no_grad(), amp.autocast("bf16", world_of_one.device):
        model(batch()[0])
    assert set(seen["bn"]) == {(torch.float32, torch.float32)} and set(seen["conv"]) == {
        torch.bfloat16
    }


# --- A.4: precision=auto on CUDA ----------------------------------------------------------------


@pytest.mark.parametrize(
    "capability,expected",
    [((7, 0), "fp16"), ((7, 5), "fp16"), ((8, 0), "bf16"), ((8, 9), "bf16"), ((9, 0), "bf16")],
)
def test_auto_precision_takes_bf16_only_where_the_gpu_has_it_natively(
    monkeypatch, capability, expected
):
    """torch.cuda.is_bf16_supported() says yes on Volta/Turing too (it can allocate a bf16 tensor
    there); faked here as torch 2.13 computes it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(
        torch.cuda,
        "is_bf16_supported",
        lambda including_emulation=True: capability >= (8, 0) or including_emulation,
    )
    assert amp.resolve_precision("auto", torch.device("cuda", 0)) == expected
    assert amp.grad_scaler(expected, torch.device("cpu")).is_enabled() == (expected == "fp16")


# --- A.8: a CPU checkpoint resumed on a GPU node ------------------------------------------------


def test_a_checkpoint_written_on_cpu_resumes_on_a_gpu_node(tmp_path, monkeypatch):
    """On a GPU node the RNG state includes 'cuda'; a checkpoint saved on CPU has no rng.rank0.cuda,
    and DCP refuses a requested key the checkpoint lacks. The other generators are restored all the
    same."""
    spec = mlp_spec()
    model = instantiate_model(spec)
    opt = torch.optim.AdamW(model.parameters())
    model(batch()[0]).sum().backward()
    opt.step()
    path = checkpoint.save(tmp_path, 1, model, opt, checkpoint_meta(model, spec), CPU1, keep_last=1)
    after_save = torch.rand(4)

    # a GPU node, as checkpoint.py sees it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: torch.zeros(16, dtype=torch.uint8))
    assert "cuda" in dcp_read.rng_state()
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", lambda state: pytest.fail("no CUDA state was saved")
    )
    torch.manual_seed(123)
    fresh = instantiate_model(spec)
    checkpoint.load(path, fresh, torch.optim.AdamW(fresh.parameters()), CPU1)
    assert torch.equal(torch.rand(4), after_save)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name


# --- A.10: divergence is collective; no host sync per step --------------------------------------


def test_a_non_finite_window_raises_and_names_the_rank():
    window = new_window(CPU1)
    window += torch.tensor(2.0, dtype=torch.float64)
    assert mean_loss_over_ranks(window, 2, 4, CPU1) == 1.0
    window += torch.tensor(float("inf"), dtype=torch.float64)
    with pytest.raises(
        TrainingDiverged,
        match=r"the training loss is inf \(not finite on rank 0, between steps 3 and 5\)",
    ):
        mean_loss_over_ranks(window, 3, 5, CPU1)


def test_train_step_never_waits_for_the_device_unless_asked_for_the_norm(monkeypatch):
    """A .item() per micro-batch (and one for the clipped norm) is a CUDA sync per step; the loop
    reads the loss at its log steps only. Every way a tensor reaches the host is counted."""
    reads = []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__", "__index__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor,
            name,
            lambda self, *a, _real=real, _name=name, **k: (
                reads.append(_name),
                _real(self, *a, **k),
            )[1],
        )
    torch.manual_seed(0)
    model = instantiate_model(mlp_spec())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = amp.grad_scaler("fp32", CPU1.device)
    learner = Learner(
        model=model,
        optimizer=opt,
        scaler=scaler,
        device=CPU1.device,
        precision="fp32",
        loss_fn=F.cross_entropy,
        clip_grad_norm=1.0,
    )
    loss, norm = train_step(learner, [batch(seed=1), batch(seed=2)], want_norm=False)
    assert reads == [] and loss.dtype == torch.float64 and norm != norm
    _, norm = train_step(learner, [batch(seed=3)], want_norm=True)
    assert reads == ["item"] and norm > 0


def poisoned_mlp(
    num_classes: int,
    in_channels: int,
    image_size: int,
    hidden: list[int] = (16,),
    mean=None,
    std=None,
    poison_rank: int = 1,
    poison_at: int = 6,
) -> nn.Module:
    """Test component: the built-in MLP, whose training output on rank `poison_rank` is infinite
    from its `poison_at`-th training forward on (the loss NaN). Evaluation and other ranks are
    untouched."""
    from pipeline.models import mlp

    class Poisoned(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp(num_classes, in_channels, image_size, hidden, mean, std)
            self.calls = 0

        def forward(self, x):
            out = self.net(x)
            if self.training and int(os.environ.get("RANK", 0)) == poison_rank:
                self.calls += 1
                if self.calls >= poison_at:
                    out = out * float("inf")
            return out

    return Poisoned()


@pytest.mark.slow
def test_one_rank_diverging_stops_both_ranks_at_the_same_step_before_the_save(workdir):
    """Rank 1's loss turns NaN at step 6, rank 0's is finite there. Rank 1 used to raise alone
    (under NCCL its peer then hangs in the next collective until the timeout); both raise at step 6
    now, where the checkpoint was due and is not written. Straight under torchrun: the launcher's
    checks add 10 s."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "pipeline.train",
        "--config",
        str(TINY),
        "train.run_name=diverged",
        "model.component=test_gpu_paths_training:poisoned_mlp",
        "model.args={hidden: [16]}",
        "train.max_steps=12",
        "train.log_every=100",
        "train.eval_every=0",
        "train.consistency_every=0",
        "checkpoint.every_n_steps=6",
    ]
    proc = run_killing_group(
        cmd,
        cwd=workdir,
        timeout=120,
        env=cli_env({"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}),
    )
    assert proc.returncode != 0
    said = "error: the training loss is nan (not finite on rank 1, between steps 1 and 6)"
    for rank in (0, 1):
        assert f"[rank{rank}] {said}" in proc.stderr, proc.stderr[-4000:]
    assert not (workdir / "outputs/diverged/checkpoints/step_00000006").exists()
    client = mlflow_client(workdir)
    run = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])[0]
    assert run.info.status == "FAILED"


# --- A.12: GPU system metrics ---------------------------------------------------------------------


def test_a_gpu_run_without_pynvml_says_it_gets_no_gpu_metrics(tmp_path, monkeypatch, caplog):
    """MLflow samples NVIDIA GPUs through pynvml only, and says so at INFO when it is missing."""
    tracking.setup(
        TrackingConfig(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="gpu-metrics")
    )

    def warnings_starting(gpu: bool, pynvml: types.ModuleType | None) -> list[str]:
        # None: `import pynvml` raises ImportError
        monkeypatch.setitem(sys.modules, "pynvml", pynvml)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=tracking.log.name):
            tracking.start_run("run", None, {}, system_metrics=True, gpu=gpu)
            tracking.end_run()
        return [r.getMessage() for r in caplog.records if "pynvml" in r.getMessage()]

    assert warnings_starting(gpu=True, pynvml=None) == [
        "MLflow system metrics will have no GPU utilization or memory: pynvml is not installed; "
        "pip install 'trainserve[gpu]' (nvidia-ml-py)"
    ]
    assert warnings_starting(gpu=True, pynvml=types.ModuleType("pynvml")) == []
    # a CPU run has no GPU to miss
    assert warnings_starting(gpu=False, pynvml=None) == []


def test_the_gpu_extra_names_nvidia_ml_py():
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(req.startswith("nvidia-ml-py") for req in extras["gpu"])


# --- train.compile --------------------------------------------------------------------------------


def test_train_compile_is_a_checked_option_off_by_default():
    assert load_config(TINY).train.compile is False
    assert load_config(TINY, ["train.compile=true"]).train.compile is True
    with pytest.raises(ConfigError, match="train.compile"):
        load_config(TINY, ["train.compile=sometimes"])


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_train_compile_without_a_compiler_is_refused_before_training(monkeypatch, device):
    import shutil

    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    info = DistInfo(0, 1, 0, 1, torch.device(device))
    with pytest.raises(ConfigError, match=f"train.compile=true on {device} needs a C.* compiler"):
        parallelize.wrap_model(
            instantiate_model(mlp_spec()), TrainConfig(compile=True), "fp32", info
        )


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_compiled_model_trains_like_the_eager_one_and_keeps_its_parameter_names(
    world_of_one, strategy, monkeypatch
):
    """Two steps of two micro-batches (DDP's no_sync, FSDP2's gradient-sync switch) on the MLP.
    Dynamo, DDP's graph splitting and AOTAutograd run for real; only the code generation is left
    out: Inductor's C++ build is slow even for this MLP
    (docs/benchmarks.md#teststest_gpu_paths_trainingpy), the aot_eager backend keeps the test to
    seconds."""
    real = nn.Module.compile
    monkeypatch.setattr(
        nn.Module, "compile", lambda self, **kw: real(self, **{"backend": "aot_eager", **kw})
    )
    torch._dynamo.reset()
    results = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = parallelize.wrap_model(
            instantiate_model(mlp_spec(hidden=[32])),
            TrainConfig(strategy=strategy, compile=compiled),
            "fp32",
            world_of_one,
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        learner = Learner(
            model=model,
            optimizer=opt,
            scaler=amp.grad_scaler("fp32", world_of_one.device),
            device=world_of_one.device,
            precision="fp32",
            loss_fn=F.cross_entropy,
        )
        losses = [
            train_step(learner, [batch(seed=2 * s), batch(seed=2 * s + 1)], want_norm=False)
            for s in range(2)
        ]
        results[compiled] = [loss.item() for loss, _ in losses], model
    (eager, eager_model), (compiled, compiled_model) = results[False], results[True]
    assert compiled == pytest.approx(eager, rel=1e-5)
    assert any(
        getattr(m, "_compiled_call_impl", None) is not None for m in compiled_model.modules()
    )
    plain = lambda m: [n.removeprefix("module.") for n, _ in m.named_parameters()]  # noqa: E731
    assert plain(compiled_model) == plain(eager_model) and not any(
        "_orig_mod" in n for n in plain(compiled_model)
    )


# --- persistent loader workers --------------------------------------------------------------------


class WorkerPids(torch.utils.data.Dataset):
    """Each sample says which process loaded it."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.tensor([float(os.getpid())]), 0


def test_train_loader_workers_outlive_the_epoch():
    def pids(loader, epoch):
        loader.sampler.set_epoch(epoch)
        return {int(x) for inputs, _ in loader for x in inputs.flatten()}

    loader = make_train_loader(
        WorkerPids(), BatchPlan(rows=4), 0, seed=0, num_workers=1, pin_memory=False
    )
    first = pids(loader, 0)
    assert os.getpid() not in first and pids(loader, 1) == first
    assert not make_train_loader(
        WorkerPids(), BatchPlan(rows=4), 0, seed=0, num_workers=0, pin_memory=False
    ).persistent_workers


def test_channels_last_auto_is_on_for_a_convolutional_model_on_cuda_only():
    """The GPU's pace by default: train.channels_last=auto (the default) puts a model with 2-d
    convolutions in NHWC on CUDA, leaves a model without them, and the CPU, alone; true and false
    are taken as they are."""
    from types import SimpleNamespace

    from pipeline.config import TrainConfig

    cuda, cpu = (
        SimpleNamespace(device=torch.device("cuda", 0)),
        SimpleNamespace(device=torch.device("cpu")),
    )
    conv, mlp = instantiate_model(resnet_spec()), torch.nn.Sequential(torch.nn.Linear(4, 4))
    auto = TrainConfig()
    assert auto.channels_last == "auto"
    assert parallelize.uses_channels_last(auto, cuda, conv) and not parallelize.uses_channels_last(
        auto, cuda, mlp
    )
    assert not parallelize.uses_channels_last(auto, cpu, conv)
    assert parallelize.uses_channels_last(TrainConfig(channels_last=True), cuda, mlp)
    assert not parallelize.uses_channels_last(TrainConfig(channels_last=False), cuda, conv)
