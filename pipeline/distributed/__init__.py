"""Distribution: the process group from torchrun's environment, collectives, and the replica checks.

    process_group.py  rank/world from torchrun, device and CPU threads, gloo/NCCL group, collectives
    replicas.py       DDP's promise of identical replicas, checked by checksums
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
