"""The device mesh of train.parallel: which ranks replicate, shard, or split the model's tensors,
and where this rank sits in it.

Ranks are laid out as torchtitan lays them, row-major over (pp, dp_replicate, dp_shard, tp): the
`tp` ranks of a tensor-parallel group are neighbours (one node's fast links), the data-parallel
ranks stride over them, and the pipeline stages are the outermost (their point-to-point sends cross
the slow links best). The data is dealt over the data-parallel ranks only: every rank of a
tensor-parallel group and of a pipeline reads the same batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pipeline.distributed.process_group import DistInfo
from pipeline.plan import Degrees

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layout:
    # This rank's place among the data-parallel ranks: what the loader and evaluation deal by.
    dp_rank: int
    dp_size: int
    tp_rank: int
    tp: int
    pp_rank: int = 0
    pp: int = 1

    @property
    def reads_for_its_group(self) -> bool:
        """The rank whose evaluation counts for its group: of a tensor-parallel group (all of them
        compute the same), the first; of a pipeline, a rank of the last stage (the one that has the
        model's output)."""
        return self.tp_rank == 0 and self.pp_rank == self.pp - 1


@dataclass(frozen=True)
class Mesh:
    """train.parallel's mesh as this rank sees it, built once by `build` and passed to what runs on
    it: the DeviceMesh (None for data parallelism over every rank), where this rank sits, and the
    groups the replica check and the buffer syncs run over."""

    device: Any
    layout: Layout
    replica_group: Any
    stage_group: Any


def build(degrees: Degrees, strategy: str, info: DistInfo) -> Mesh:
    """Collective where a DeviceMesh is needed (every rank builds it at the same point)."""
    device_mesh = device_mesh_of(degrees, info)
    return Mesh(
        device_mesh,
        layout(degrees, info),
        replica_group(strategy, info, device_mesh),
        stage_group(device_mesh),
    )


def layout(degrees: Degrees, info: DistInfo) -> Layout:
    per_stage = info.world_size // degrees.pp
    within = info.rank % per_stage
    tp = degrees.tp
    return Layout(
        within // tp, per_stage // tp, within % tp, tp, info.rank // per_stage, degrees.pp
    )


def device_mesh_of(degrees: Degrees, info: DistInfo):
    """The DeviceMesh ("pp", "dp_replicate", "dp_shard", "tp") when the degrees ask for more than
    data parallelism over the whole world (replicas, tensor or pipeline parallelism); else None
    (DDP, or FSDP2's default 1-D mesh)."""
    if not degrees.needs_mesh:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    shape = (degrees.pp, degrees.dp_replicate, degrees.dp_shard, degrees.tp)
    log.info(
        "device mesh: %d pipeline stages x %d replicas x %d shards x %d tensor-parallel%s",
        *shape,
        " (HSDP)" if shape[1] > 1 else "",
    )
    return init_device_mesh(
        info.device.type, shape, mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp")
    )


def data_parallel(mesh):
    """The part of the mesh FSDP2 shards (and replicates) parameters over."""
    if mesh is None:
        return None
    return mesh["dp_replicate", "dp_shard"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard"]


def replica_group(strategy: str, info: DistInfo, device_mesh):
    """The process group of the ranks that hold the same tensors as this one (DDP's replicas, a
    pipeline stage's data-parallel copies, HSDP's replicas of a shard, a tensor-parallel group's
    copies of what it does not split): what the replica check compares over (replicas.check skips
    the tensor-parallel halves). None where no other rank holds a copy (one rank; FSDP2 alone;
    tensor parallelism beside FSDP2, which shards the rest)."""
    import torch.distributed as dist

    if not info.distributed:
        return None
    if device_mesh is None:
        return dist.group.WORLD if strategy == "ddp" else None
    if device_mesh["tp"].size() > 1:
        alone = device_mesh["dp_replicate"].size() * device_mesh["dp_shard"].size() == 1
        return device_mesh["tp"].get_group() if alone else None
    copies = device_mesh["dp_shard"] if strategy == "ddp" else device_mesh["dp_replicate"]
    return copies.get_group() if copies.size() > 1 else None


def stage_group(device_mesh):
    """The ranks of this rank's pipeline stage (they hold its buffers); None (the world) without a
    pipeline. A stage's ranks are its data-parallel copies: pipeline parallelism does not combine
    with tensor parallelism or HSDP yet."""
    if device_mesh is None or device_mesh["pp"].size() == 1:
        return None
    return device_mesh["dp_shard"].get_group()
