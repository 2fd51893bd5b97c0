"""Process-group setup from torchrun's environment, device choice, and CPU thread budget.

Rank and world size come from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE). Without them the process is a world of one and needs no process group, so a
plain `python -m pipeline train` works too.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from serving.cpus import usable_cpus


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @classmethod
    def cpu_alone(cls) -> "DistInfo":
        """A world of one process on the CPU: for reductions done outside training (export,
        promotion)."""
        return cls(0, 1, 0, 1, torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def setup(device_request: str, threads_per_rank: int) -> DistInfo:
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    device = pick_device(device_request, local_rank)

    # Oversubscribed CPU threads make gloo ranks collapse
    # (docs/benchmarks.md#pipelinedistributedprocess_grouppy): give each local rank its share of the
    # usable cores.
    threads = threads_per_rank or max(1, usable_cpus() // local_world_size)
    torch.set_num_threads(threads)
    if device.type == "cpu":
        keep_freed_memory()

    if device.type == "cuda":
        torch.cuda.set_device(device)
    # Under torchrun always a process group, even of one: FSDP2 needs its device mesh.
    if (world_size > 1 or "MASTER_ADDR" in os.environ) and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        # device_id binds NCCL to this rank's GPU eagerly, avoiding a hang on the first collective.
        dist.init_process_group(
            backend=backend,
            store=attempt_store(rank, world_size),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(minutes=10),
            device_id=device if device.type == "cuda" else None,
        )
    return DistInfo(rank, world_size, local_rank, local_world_size, device)


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# glibc's ceiling on 64-bit
MMAP_THRESHOLD_MAX = 32 << 20


def keep_freed_memory() -> bool:
    """Stops glibc from handing freed tensor memory back to the kernel between training steps.

    With its defaults, the gradients freed by `zero_grad(set_to_none=True)` and the activations
    freed by backward go back to the kernel (heap trimming, per-allocation mmap), and every step
    faults them in again, which slows every step
    (docs/benchmarks.md#pipelinedistributedprocess_grouppy). Allocations up to 32 MiB now stay in
    the heap and the heap is never trimmed, much as jemalloc or tcmalloc behave (PyTorch's CPU
    tuning guide preloads one; this needs nothing installed). The rank keeps its peak heap until it
    exits. Returns False where the C library is not glibc, or when the user set
    MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ themselves.
    """
    import ctypes

    if any(k in os.environ for k in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        # musl, macOS, Windows
        return False
    return bool(
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) and mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
    )


# in torchrun's agent store: "<port> <nonce>" of this attempt's store
ATTEMPT_STORE_KEY = "trainserve/attempt_store"
STORE_TIMEOUT = timedelta(minutes=10)


def attempt_store(rank: int, world_size: int) -> dist.Store:
    """A store of this attempt's own, for the process group: no key of a dead attempt can be in it.

    torchrun's agent store outlives the workers, and `env://` shares it across restarts unprefixed:
    a restarted rank can read the dead attempt's gloo address of a peer before the peer
    re-registers, and fail with "Connection refused" (seen here when rank 0 was killed). A prefix
    per TORCHELASTIC_RESTART_COUNT fixed that on one machine only: the count is each node's own
    (torch counts a failure restart, not a membership change), so after one node's worker died the
    two nodes' ranks waited under different prefixes until the timeout. So rank 0 starts a fresh
    store on a free port and announces it in the agent store with a nonce; the others connect to the
    announced one that answers with that nonce (a stale announcement points at a dead rank 0's port,
    or at a reused port holding another nonce).
    """
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    # rank 0 hosts MASTER_PORT's store: new per attempt
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return dist.TCPStore(
            addr, port, world_size, is_master=rank == 0, timeout=STORE_TIMEOUT, multi_tenant=True
        )
    agent = dist.TCPStore(addr, port, world_size, is_master=False, timeout=STORE_TIMEOUT)
    if rank == 0:
        nonce = secrets.token_hex(8)
        own = dist.TCPStore(
            addr, 0, world_size, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False
        )
        own.set(ATTEMPT_STORE_KEY, nonce)
        agent.set(ATTEMPT_STORE_KEY, f"{own.port} {nonce}")
        return own
    return join_attempt_store(agent, addr, world_size)


def join_attempt_store(agent: dist.Store, addr: str, world_size: int) -> dist.Store:
    """The store rank 0 of this attempt announced (see attempt_store), once it answers with its
    nonce."""
    deadline = time.monotonic() + STORE_TIMEOUT.total_seconds()
    while time.monotonic() < deadline:
        # waits for the first announcement
        port, nonce = agent.get(ATTEMPT_STORE_KEY).decode().split()
        # A dead attempt's port refuses at once; a store client would retry it for its 2 s.
        if not _listening(addr, int(port)):
            time.sleep(0.05)
            continue
        try:
            own = dist.TCPStore(
                addr, int(port), world_size, is_master=False, timeout=timedelta(seconds=2)
            )
            if own.get(ATTEMPT_STORE_KEY).decode() == nonce:
                own.set_timeout(STORE_TIMEOUT)
                return own
        except (
            RuntimeError,
            dist.DistStoreError,
        ):
            # a dead attempt's port: rank 0 has not announced yet
            pass
        time.sleep(0.2)
    raise TimeoutError(
        f"rank 0 announced no live store at {addr} in {STORE_TIMEOUT} (agent store key "
        f"{ATTEMPT_STORE_KEY}): did rank 0 start?"
    )


def _listening(addr: str, port: int) -> bool:
    try:
        socket.create_connection((addr, port), timeout=1).close()
    except OSError:
        return False
    return True


def job_restarts(info: DistInfo) -> int:
    """How many times torchrun restarted this job's workers: the most any node counted. Each node's
    agent counts only its own failure restarts (TORCHELASTIC_RESTART_COUNT); a node restarted
    because another node's worker died counts 0, yet its ranks resume with everyone else's.
    Collective."""
    # On the group's own device: NCCL reduces only CUDA tensors (a CPU tensor there fails every rank
    # at start).
    count = torch.tensor(
        [int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))], device=info.device
    )
    if info.distributed:
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


# How long the main thread hands the GIL to gloo's worker threads before the interpreter exits.
GLOO_DRAIN_SECONDS = 0.25


def teardown(clean: bool = True) -> None:
    """Destroys the process group. `clean`: every rank got here normally, so wait for all of them
    first. On an error path, never wait: the peers may be gone or still training, and torchrun is
    about to stop them anyway.

    Then a short sleep, for a torch defect seen under load (3-4 exits in 30 on 2 busy cores,
    SIGABRT "terminate called without an active exception", a run that finished reported as
    failed): a DistributedDataParallel reducer keeps the gloo group alive after
    destroy_process_group, so its worker threads outlive it, and one of them still drops the last
    collectives' tensors, which needs the GIL. If the interpreter is already finalizing, that
    thread is unwound and the process aborts (gdb: pt_gloo_runloop in ~AsyncBarrierWork ->
    decref_pyobject -> take_gil -> pthread_exit). Sleeping releases the GIL so those threads finish
    first; pytorch/pytorch#179291 tried an atexit fix upstream and was abandoned."""
    if dist.is_available() and dist.is_initialized():
        backend = dist.get_backend()
        if clean:
            dist.barrier()
        dist.destroy_process_group()
        if backend == "gloo":
            time.sleep(GLOO_DRAIN_SECONDS)


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()


def broadcast_object(obj, info: DistInfo):
    """Rank 0's value on every rank."""
    if not info.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(obj, info: DistInfo) -> list:
    """Every rank's value, in rank order, on every rank."""
    if not info.distributed:
        return [obj]
    box = [None] * info.world_size
    dist.all_gather_object(box, obj)
    return box


def all_reduce_sum(values: list[float], info: DistInfo) -> list[float]:
    if not info.distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=info.device)
    dist.all_reduce(t)
    return t.tolist()


def sum_over_ranks(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """`t` summed over every rank, in place, on its device (no host sync: read it when needed)."""
    if info.distributed:
        dist.all_reduce(t)
    return t


def configure_logging(rank: int) -> None:
    from pipeline.tools import logs

    logs.configure(rank)
