"""The asynchronous save's writer (dcp.AsyncWriter, through the trainer's Saver) in one process:
what it publishes is the state of the step saved, and its background thread runs at the lowest CPU
priority."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

from pipeline import checkpoint
from pipeline.checkpoint.dcp import AsyncWriter
from pipeline.checkpoint.saver import Saver
from pipeline.distributed import DistInfo


def test_an_async_save_publishes_the_staged_state_from_a_lowest_priority_thread(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.rand(4, 64)).sum().backward()
    optimizer.step()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    info = DistInfo.cpu_alone()
    saver = Saver(tmp_path, info, keep_last=2, asynchronous=True)
    published = []
    try:
        saver.save(1, model, optimizer, {}, (), published.append)
        # training goes on at once: the save holds its own copy
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        nice = saver.writer.worker.submit(
            lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        )
        path = saver.finish()
    finally:
        saver.close()
    assert published == [path] and path == checkpoint.latest(tmp_path)
    # a thread's own priority is Linux's; elsewhere the writer keeps training's
    if sys.platform == "linux":
        assert nice.result() == AsyncWriter.NICE == 19
    restored = torch.nn.Linear(64, 8)
    checkpoint.load(path, restored, None, info)
    for key, value in restored.state_dict().items():
        assert torch.equal(value, saved[key]), key


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
