"""The device mesh of train.parallel: which ranks replicate, shard, or split the model's tensors, and where
this rank sits in it.

Ranks are laid out as torchtitan lays them, row-major over (dp_replicate, dp_shard, tp): the `tp` ranks of a
tensor-parallel group are neighbours (one node's fast links), the data-parallel ranks stride over them. The
data is dealt over the data-parallel ranks only: every rank of a tensor-parallel group reads the same batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pipeline.distributed.process_group import DistInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layout:
    dp_rank: int     # this rank's place among the data-parallel ranks (what the loader and evaluation deal by)
    dp_size: int
    tp_rank: int
    tp: int

    @property
    def reads_for_its_group(self) -> bool:
        """The rank whose evaluation counts for its tensor-parallel group (all of them compute the same)."""
        return self.tp_rank == 0


def layout(train_cfg, info: DistInfo) -> Layout:
    degrees = train_cfg.parallel.degrees(info.world_size)
    tp = degrees["tp"]
    return Layout(info.rank // tp, info.world_size // tp, info.rank % tp, tp)


def build(train_cfg, info: DistInfo):
    """The DeviceMesh ("dp_replicate", "dp_shard", "tp") when train.parallel asks for more than FSDP2 over the
    whole world (replicas or tensor parallelism); else None (DDP, or FSDP2's default 1-D mesh)."""
    degrees = train_cfg.parallel.degrees(info.world_size)
    if degrees["dp_replicate"] == 1 and degrees["tp"] == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    shape = (degrees["dp_replicate"], degrees["dp_shard"], degrees["tp"])
    log.info("device mesh: %d replicas x %d shards x %d tensor-parallel%s", *shape,
             " (HSDP)" if shape[0] > 1 else "")
    return init_device_mesh(info.device.type, shape, mesh_dim_names=("dp_replicate", "dp_shard", "tp"))


def data_parallel(mesh):
    """The part of the mesh FSDP2 shards (and replicates) parameters over."""
    if mesh is None:
        return None
    return mesh["dp_replicate", "dp_shard"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard"]
