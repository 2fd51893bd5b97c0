"""The model on its device and across ranks: SyncBatchNorm, memory format, DDP or FSDP2.

FSDP2 shards the model in units: each unit's parameters are all-gathered just before its forward
and freed after, so a unit should be one repeated block (a transformer layer, a residual block).
`train.fsdp_wrap` names the block classes; without it, the rule is: the class that repeats most
among the children of the model's largest `ModuleList`/`Sequential` (by parameters), and every
module of that class anywhere in the model. The root is always a unit too (whatever no block holds).
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from pipeline.components import amp
from pipeline.config import ConfigError
from pipeline.distributed.process_group import DistInfo

log = logging.getLogger(__name__)


def wrap_model(model: nn.Module, train_cfg, precision: str, info: DistInfo) -> nn.Module:
    if train_cfg.sync_batchnorm and info.distributed:
        if info.device.type == "cuda":
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        else:
            log.warning("train.sync_batchnorm ignored: torch's SyncBatchNorm has no CPU kernel; "
                        "BatchNorm statistics stay per rank")
    model = model.to(info.device)
    if info.device.type == "cuda":
        torch.backends.cudnn.benchmark = train_cfg.cudnn_benchmark
        if train_cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)
    if train_cfg.strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # FSDP2 casts parameters itself; gradients are reduced in fp32 for accuracy.
        mp = MixedPrecisionPolicy(param_dtype=amp.DTYPES[precision], reduce_dtype=torch.float32) \
            if precision != "fp32" else MixedPrecisionPolicy()
        units = fsdp_units(model, train_cfg.fsdp_wrap)
        log.info("FSDP2 units: %d x %s, and the root", len(units),
                 ", ".join(sorted({type(u).__name__ for u in units})) or "none")
        for unit in units:  # innermost first: a unit inside another is sharded before its parent
            fully_shard(unit, mp_policy=mp)
        return fully_shard(model, mp_policy=mp)
    if info.distributed:
        return DDP(model, device_ids=[info.device.index] if info.device.type == "cuda" else None)
    return model


def fsdp_units(model: nn.Module, class_names: list[str]) -> list[nn.Module]:
    """The modules to shard as units, innermost first (see the module docstring for the default)."""
    if class_names:
        present = sorted({type(m).__name__ for m in model.modules()})
        unknown = [n for n in class_names if n not in present]
        if unknown:
            raise ConfigError(f"train.fsdp_wrap names {unknown}, but the model has no module of that class; its "
                              f"module classes are: {', '.join(present)}")
        wanted = set(class_names)
    else:
        block = repeated_block(model)
        wanted = {block} if block else set()
    return [m for m in reversed(list(model.modules())) if m is not model and type(m).__name__ in wanted]


def repeated_block(model: nn.Module) -> str | None:
    """The class repeated most among the children of the largest ModuleList/Sequential, by parameters."""
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
