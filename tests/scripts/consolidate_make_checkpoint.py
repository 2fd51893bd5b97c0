"""Run under torchrun (gloo, CPU): train a few AdamW steps with DDP or FSDP2, save a trainserve
checkpoint through `pipeline.checkpoint.save`, and with --live write what the live model holds:

    <out>/run/checkpoints/step_XXXXXXXX/   the sharded checkpoint
    <out>/live.safetensors                 the model's full state dict (gathered for FSDP)
    <out>/live_outputs.safetensors         {"input", "output"}: the model's outputs on a fixed input

    python -m torch.distributed.run --standalone --nproc-per-node 2 consolidate_make_checkpoint.py \
        --strategy fsdp --model '{"component": "pipeline.models:resnet18", "args": {...}}' --out DIR [--live]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from pipeline import checkpoint
from pipeline.components.build import ModelSpec, instantiate_model, state_manifest
from pipeline.config import Config
from pipeline.distributed import setup, teardown


def input_shape(spec: ModelSpec) -> tuple[int, int, int]:
    """(C, H, W) of the built-in image models' inputs (8x8 unless the args say otherwise)."""
    size = spec.args.get("image_size", 8)
    return (spec.args["in_channels"], size, size)


def wrap(model: torch.nn.Module, strategy: str) -> torch.nn.Module:
    if strategy == "ddp":
        return DistributedDataParallel(model)
    # one FSDP unit per top-level block that has parameters
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child)
    return fully_shard(model)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], required=True)
    parser.add_argument("--model", required=True, help='JSON {"component": ..., "args": {...}}')
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--live", action="store_true")
    args = parser.parse_args()
    spec = ModelSpec(**json.loads(args.model))
    out = Path(args.out)

    info = setup("cpu", 1)
    try:
        torch.manual_seed(0)
        plain = instantiate_model(spec)
        manifest = state_manifest(plain)
        model = wrap(plain, args.strategy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        # each rank its own batches, as a DistributedSampler gives
        torch.manual_seed(1 + info.rank)
        for _ in range(args.steps):
            x = torch.rand(8, *input_shape(spec))
            y = torch.randint(0, spec.args["num_classes"], (8,))
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        # Without SyncBatchNorm each rank's BatchNorm statistics drift apart, and DCP stores each
        # replicated buffer from one rank, not necessarily rank 0: make them agree before saving.
        with torch.no_grad():
            for buf in model.buffers():
                dist.broadcast(buf, 0)

        config = Config().model_dump(mode="json")
        meta = {
            "config": config,
            "model": spec.to_json(),
            "model_state": manifest,
            "labels": [str(i) for i in range(spec.args["num_classes"])],
            "strategy": args.strategy,
            "mlflow_run_id": None,
            "train_state": {"epoch": 0},
        }
        checkpoint.save(
            out / "run" / "checkpoints", args.steps, model, optimizer, meta, info, keep_last=2
        )

        if args.live:
            full = get_model_state_dict(
                model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
            model.eval()
            torch.manual_seed(123)
            x = torch.rand(16, *input_shape(spec))
            with torch.no_grad():
                # collective under FSDP: every rank runs it
                y = model(x)
            if info.is_main:
                save_file(
                    {k: v.contiguous() for k, v in full.items()}, str(out / "live.safetensors")
                )
                save_file(
                    {"input": x, "output": y.contiguous()}, str(out / "live_outputs.safetensors")
                )
        dist.barrier()
    finally:
        teardown()


if __name__ == "__main__":
    main()
