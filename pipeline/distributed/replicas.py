"""The replica consistency check: DDP promises identical replicas; this makes it visible.

Each rank reduces every parameter and buffer to a float64 checksum; one all-reduce of the max and
one of the min tell, tensor by tensor, whether all ranks agree. Any tensor whose max and min
differ has diverged on some rank, and the first one is named.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class ReplicaDivergence(RuntimeError):
    pass


def named_state(model: torch.nn.Module):
    # DDP wraps the model; names are the plain ones
    module = getattr(model, "module", model)
    yield from module.named_parameters()
    yield from module.named_buffers()


def split_over_tensor_parallel_ranks(t) -> bool:
    """A DTensor sharded over the mesh's `tp` dimension: each rank holds another part, not a
    copy."""
    if not hasattr(t, "placements"):
        return False
    names = t.device_mesh.mesh_dim_names or ()
    return any(
        name == "tp" and not placement.is_replicate()
        for name, placement in zip(names, t.placements)
    )


def checksums(model: torch.nn.Module) -> tuple[list[str], torch.Tensor]:
    names, sums = [], []
    for name, tensor in named_state(model):
        if split_over_tensor_parallel_ranks(tensor):
            continue
        t = tensor.detach()
        # HSDP: this rank's shard, the same on each replica
        t = t.to_local() if hasattr(t, "to_local") else t
        names.append(name)
        # Sum and sum of squares in float64: a one-ulp change in a float32 element shows up.
        d = t.double()
        sums.append(torch.stack([d.sum(), (d * d).sum()]))
    return names, torch.stack(sums)


def sync_buffers(model: torch.nn.Module, group=None) -> None:
    """The first rank's buffers on every rank of `group` (the world, or the ranks of one pipeline
    stage, whose buffers are the stage's). DDP does this at the start of each forward, so after a
    step BatchNorm's running statistics still hold each rank's own batch; sync before comparing or
    saving, so that every copy is the one the next forward would use."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    module = getattr(model, "module", model)
    for buffer in module.buffers():
        dist.broadcast(buffer.data, group=group, group_src=0)


def check(model: torch.nn.Module, step: int, group=None) -> None:
    """Collective over `group` (the ranks that hold copies of the same tensors; None: the world):
    every rank calls it at the same step. Raises ReplicaDivergence on all of them."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    names, local = checksums(model)
    hi, lo = local.clone(), local.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    differs = (hi != lo).any(dim=1).nonzero().flatten().tolist()
    if differs:
        first = differs[0]
        raise ReplicaDivergence(
            f"replicas diverged at step {step}: '{names[first]}' differs between ranks "
            f"(checksum min {lo[first, 0].item():.17g}, max {hi[first, 0].item():.17g}); "
            f"{len(differs)} tensor(s) differ in all. This rank's value: {local[first, 0].item():.17g}"
        )
