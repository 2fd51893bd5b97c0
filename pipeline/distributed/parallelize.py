"""The model on its device and across ranks: SyncBatchNorm, memory format, tensor parallelism
(tensor_parallel.py, on the device mesh of mesh.py), DDP or FSDP2 (HSDP on a mesh with replicas). A
pipeline's stage (pipeline_parallel.py) is wrapped here the same way.

FSDP2 shards the model in units: each unit's parameters are all-gathered just before its forward
and freed after, so a unit should be one repeated block (a transformer layer, a residual block).
`train.fsdp_wrap` names the block classes; without it, the rule is: the class that repeats most
among the children of the model's largest `ModuleList`/`Sequential` (by parameters), and every
module of that class anywhere in the model. The root is always a unit too (whatever no block holds).
"""

from __future__ import annotations

import logging
import os
from collections import Counter

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel as DDP

from pipeline.components import amp
from pipeline.config import ConfigError
from pipeline.distributed import mesh, tensor_parallel
from pipeline.distributed.process_group import DistInfo

log = logging.getLogger(__name__)


def uses_channels_last(train_cfg, info: DistInfo, model: nn.Module | None = None) -> bool:
    """NHWC inputs (and, under DDP, weights): CUDA only, where cuDNN's tensor-core convolutions want
    it. `auto` (the default) turns it on for a model with 2-d convolutions, which train faster in
    channels_last on a GPU (docs/benchmarks.md#pipelinedistributedparallelizepy); a model without
    convolutions gains nothing from it."""
    if info.device.type != "cuda" or train_cfg.channels_last is False:
        return False
    if train_cfg.channels_last is True:
        return True
    return model is not None and any(isinstance(m, nn.Conv2d) for m in model.modules())


def wrap_model(
    model: nn.Module, train_cfg, precision: str, info: DistInfo, device_mesh=None
) -> nn.Module:
    """`model` (the whole model, or this rank's pipeline stage) on its device, split over the mesh's
    tensor-parallel ranks and wrapped for its data-parallel ones: DDP (over the whole world, or the
    stage's copies on a mesh) or FSDP2 (HSDP on a mesh with replicas)."""
    if train_cfg.sync_batchnorm and info.distributed:
        if info.device.type == "cuda":
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        else:
            log.warning(
                "train.sync_batchnorm ignored: torch's SyncBatchNorm has no CPU kernel; "
                "BatchNorm statistics stay per rank"
            )
    if train_cfg.compile:
        check_compiler(info.device.type)
    model = model.to(info.device)
    if info.device.type == "cuda":
        torch.backends.cudnn.benchmark = train_cfg.cudnn_benchmark
    if device_mesh is not None:
        if device_mesh["tp"].size() > 1:
            tensor_parallel.parallelize(model, device_mesh["tp"], device_mesh["tp"].size())
        if device_mesh["dp_replicate"].size() * device_mesh["dp_shard"].size() == 1:
            # no data-parallel ranks: nothing to wrap (the replicated rest is the same on every
            # rank)
            return model
    if train_cfg.strategy == "fsdp":
        # FSDP2 refuses non-contiguous parameters (NotImplementedError in fully_shard), and its
        # all-gathered parameters are contiguous anyway: the weights stay NCHW and only the inputs
        # go NHWC (see data.to_device), which is enough for cuDNN to pick its channels_last kernels.
        return shard(
            model,
            train_cfg.fsdp_wrap,
            precision,
            train_cfg.compile,
            mesh.data_parallel(device_mesh),
        )
    if uses_channels_last(train_cfg, info, model):
        model = model.to(memory_format=torch.channels_last)
    if info.distributed:
        model = DDP(
            model,
            device_ids=[info.device.index] if info.device.type == "cuda" else None,
            process_group=mesh.data_parallel(device_mesh).get_group()
            if device_mesh is not None
            else None,
        )
    if train_cfg.compile:
        # In place (the parameter names stay those of the checkpoints) and after DDP: compiling the
        # DDP module lets TorchDynamo's DDPOptimizer split the graph at the gradient buckets, so the
        # all-reduces still overlap the backward; a model compiled inside DDP reduces only at the
        # end.
        model.compile()
    return model


def check_compiler(device_type: str) -> None:
    """torch.compile builds native code at the first step: Triton's launcher with a C compiler on
    CUDA, Inductor's kernels with a C++ compiler on CPU. Without one it fails deep inside the first
    step."""
    import shutil

    names = ("cc", "gcc", "clang") if device_type == "cuda" else ("c++", "g++", "clang++")
    chosen = os.environ.get("CC" if device_type == "cuda" else "CXX")
    if not any(shutil.which(n) for n in ((chosen,) if chosen else names)):
        raise ConfigError(
            f"train.compile=true on {device_type} needs a {'C' if device_type == 'cuda' else 'C++'} "
            f"compiler ({chosen or ', '.join(names)}) on PATH, and none is there: install one "
            "(e.g. apt-get install gcc g++) or set train.compile=false"
        )


def shard(
    model: nn.Module, fsdp_wrap: list[str], precision: str, compile_units: bool = False, mesh=None
) -> nn.Module:
    """FSDP2: every unit (see the module docstring) and the root, innermost first.

    With bf16/fp16, each BatchNorm (SyncBatchNorm included) is a unit of its own with an fp32
    policy, sharded before the blocks that hold it: under the blocks' policy its weight would be
    cast to bf16 while its running statistics stay fp32, and batch_norm refuses the mix ("expected
    scalar type BFloat16 but found Float"), on CUDA and CPU alike (torchtitan #674). It computes on
    the blocks' low-precision activations all the same, as autocast's BatchNorm does.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # FSDP2 casts parameters itself; gradients are reduced in fp32 for accuracy.
    mp = (
        MixedPrecisionPolicy(param_dtype=amp.DTYPES[precision], reduce_dtype=torch.float32)
        if precision != "fp32"
        else MixedPrecisionPolicy()
    )
    norms = [m for m in model.modules() if isinstance(m, _BatchNorm)] if precision != "fp32" else []
    units = [u for u in fsdp_units(model, fsdp_wrap) if not any(u is n for n in norms)]
    log.info(
        "FSDP2 units: %d x %s, and the root%s",
        len(units),
        ", ".join(sorted({type(u).__name__ for u in units})) or "none",
        f"; {len(norms)} BatchNorm kept in fp32" if norms else "",
    )
    for norm in norms:
        fully_shard(norm, mesh=mesh, mp_policy=MixedPrecisionPolicy())
    # innermost first: a unit inside another is sharded before its parent
    for unit in units:
        # per block, before its hooks (torchtitan's order); Dynamo skips FSDP2's hooks
        if compile_units:
            unit.compile()
        fully_shard(unit, mesh=mesh, mp_policy=mp)
    if compile_units and not units:
        model.compile()
    return fully_shard(model, mesh=mesh, mp_policy=mp)


def fsdp_units(model: nn.Module, class_names: list[str]) -> list[nn.Module]:
    """The modules to shard as units, innermost first (see the module docstring for the default)."""
    if class_names:
        present = sorted({type(m).__name__ for m in model.modules()})
        unknown = [n for n in class_names if n not in present]
        if unknown:
            raise ConfigError(
                f"train.fsdp_wrap names {unknown}, but the model has no module of that class; its "
                f"module classes are: {', '.join(present)}"
            )
        wanted = set(class_names)
    else:
        block = repeated_block(model)
        wanted = {block} if block else set()
    return [
        m for m in reversed(list(model.modules())) if m is not model and type(m).__name__ in wanted
    ]


def repeated_block(model: nn.Module) -> str | None:
    """The class repeated most among the children of the largest ModuleList/Sequential, by
    parameters."""
    best, best_size = None, 0
    for container in model.modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = [c for c in container.children() if any(True for _ in c.parameters())]
        counts = Counter(type(c).__name__ for c in children)
        if not counts:
            continue
        name, count = counts.most_common(1)[0]
        if count < 2:
            continue
        size = sum(p.numel() for c in children if type(c).__name__ == name for p in c.parameters())
        if size > best_size:
            best, best_size = name, size
    return best
