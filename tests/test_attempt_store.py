"""The process group's store of one torchrun attempt (distributed.attempt_store): the ranks of every
node meet in the store rank 0 started for this attempt, never in one a dead attempt announced,
whatever each node's agent counted as its restarts."""

from __future__ import annotations

import socket
import subprocess
import sys
from datetime import timedelta

import torch.distributed as dist
from conftest import cli_env

from pipeline.distributed import process_group

# One rank of the new attempt: its store from attempt_store, then one key each way through it.
RANK = """
import sys
from datetime import timedelta
from pipeline.distributed import process_group
rank = int(sys.argv[1])
store = process_group.attempt_store(rank, 2)
store.set_timeout(timedelta(seconds=20))
store.set(f"hello from {rank}", "yes")
print(store.get(f"hello from {1 - rank}").decode(), store.port)
"""


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ranks_meet_in_this_attempts_store_whatever_each_node_counted(tmp_path):
    agent = dist.TCPStore(
        "127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False
    )
    # What a dead attempt left in torchrun's agent store: its rank 0's store, gone, announced under
    # our key.
    agent.set(process_group.ATTEMPT_STORE_KEY, f"{dead_port()} 0123456789abcdef")
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(agent.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    # Node B's worker died (a failure restart: 1); node A was restarted for the membership change
    # (0). rank 1 first: it reads the stale announcement
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(rank)],
            env=cli_env({**env, "TORCHELASTIC_RESTART_COUNT": count}),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, count in ((1, "1"), (0, "0"))
    ]
    outputs = [proc.communicate(timeout=90) for proc in ranks]
    for proc, (out, err) in zip(ranks, outputs):
        assert proc.returncode == 0, err[-3000:]
        assert out.split()[0] == "yes"
    # not the agent's store: its keys outlive attempts
    assert {out.split()[1] for out, _ in outputs} != {str(agent.port)}
