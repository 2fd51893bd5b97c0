"""Distribution: the process group from torchrun's environment, collectives, the device mesh and
what runs on it, and the replica checks.

    process_group.py     rank/world from torchrun, device and CPU threads, gloo/NCCL group,
                         collectives
    launch.py            torchrun's command line
    mesh.py              train.parallel's device mesh: where each rank sits, which ranks hold copies
    parallelize.py       the model on its device and across ranks: DDP, FSDP2/HSDP, tensor
                         parallelism
    tensor_parallel.py   DTensor plans for the projections of attention and MLP blocks
    pipeline_parallel.py the model cut into stages at named modules, driven by a 1F1B/GPipe schedule
    gradients.py         the global gradient norm and clipping, across meshes and pipeline stages
    replicas.py          DDP's (and HSDP's, and a stage's copies') promise of identical replicas,
                         checked by checksums
"""

from pipeline.distributed.process_group import (  # noqa: F401
    DistInfo,
    all_gather_object,
    all_reduce_sum,
    attempt_store,
    barrier,
    broadcast_object,
    configure_logging,
    job_restarts,
    keep_freed_memory,
    pick_device,
    setup,
    sum_over_ranks,
    teardown,
    usable_cpus,
)
