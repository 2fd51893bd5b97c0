"""The global gradient norm and clipping, whatever holds the gradients: plain tensors (DDP),
DTensors of one mesh (FSDP2) or of several (tensor parallelism beside the replicated rest), and the
stages of a pipeline, each rank holding only its stage's."""

from __future__ import annotations

import torch
import torch.distributed as dist


def needs_own_norm(parameters, stages) -> bool:
    """Whether torch's clip_grad_norm_ can't compute the norm: parameters on more than one device
    mesh (or some on none: it can't stack their norms), or a pipeline (each rank has only its
    stage's gradients)."""
    return stages is not None or len({getattr(p, "device_mesh", None) for p in parameters}) > 1


@torch.no_grad()
def grad_norm(parameters, stages=None) -> torch.Tensor:
    """The global L2 norm of the gradients: each mesh's norm made whole, then combined; with
    `stages` (the pipeline's process group), the stages' norms combined too."""
    groups: dict[object, list[torch.Tensor]] = {}
    device = None
    for p in parameters:
        device = device or p.device
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
    norms = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = (
        torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))
        if norms
        else torch.zeros((), device=device)
    )
    if stages is not None:
        squared = total.double() ** 2
        dist.all_reduce(squared, group=stages)
        total = squared.sqrt().to(total.dtype)
    return total


@torch.no_grad()
def clip_grads(parameters, max_norm: float, total_norm: torch.Tensor) -> None:
    """Scales the gradients so that their global norm is at most `max_norm`, as clip_grad_norm_ does
    (train_step calls it where clip_grad_norm_ can't: see needs_own_norm)."""
    # a number: DTensors of any mesh take it
    coef = float(torch.clamp(max_norm / (total_norm + 1e-6), max=1.0))
    if coef < 1.0:
        for p in parameters:
            if p.grad is not None:
                p.grad.mul_(coef)
