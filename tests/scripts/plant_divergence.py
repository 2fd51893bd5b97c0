"""Run under torchrun with 2 processes: replicas agree, then rank 1's weights are perturbed and
the check must name the tensor. Exit 0 only if the divergence was caught."""

import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from pipeline import distributed
from pipeline.components.build import ModelSpec, instantiate_model
from pipeline.distributed import replicas


def caught_divergence(rank: int) -> bool:
    torch.manual_seed(0)
    spec = ModelSpec(
        "pipeline.models:mlp",
        {"num_classes": 10, "in_channels": 1, "image_size": 8, "hidden": [16]},
    )
    model = DDP(instantiate_model(spec))
    # identical replicas pass
    replicas.check(model, step=1)
    if rank == 1:
        with torch.no_grad():
            # a tiny, silent corruption on one rank
            model.module.head.weight[3, 5] += 1e-6
    try:
        replicas.check(model, step=2)
    except replicas.ReplicaDivergence as exc:
        print(f"rank {rank} caught: {exc}", flush=True)
        return True
    print(f"rank {rank}: divergence NOT caught", flush=True)
    return False
    # DDP (and its hold on the process group) is gone when this returns: before teardown, as in
    # train.main.


info = distributed.setup("cpu", 1)
ok = False
try:
    ok = caught_divergence(info.rank)
finally:
    distributed.teardown(clean=ok)
sys.exit(0 if ok else 1)
