"""A recommender-shaped model whose weights are almost all one large embedding table, cheap to compute:
a bag of item ids -> the mean of their embeddings -> a small MLP -> click / no click.

The table is held as `blocks` row blocks (item ids [0, rows/blocks) in the first, and so on), each its
own nn.Embedding, so that FSDP2 shards it as that many units (pipeline/distributed/parallelize.py picks the
repeated class of the largest ModuleList): a rank then all-gathers, and holds the dense gradient of, one
block at a time instead of the whole table. That is what keeps a rank near its shard of the weights when
the table is gigabytes. Row-wise blocks are what recommender libraries (TorchRec's row-wise sharding) do
for the same reason. The graph is plain Gather/Mul/Add: any ONNX runtime runs it.
"""

from __future__ import annotations

import torch
from torch import nn


class BagOfItems(nn.Module):
    def __init__(self, rows: int, dim: int = 128, blocks: int = 1, hidden: int = 64, num_classes: int = 2):
        super().__init__()
        if rows < 1 or blocks < 1 or rows % blocks:
            raise ValueError(f"rows ({rows}) must be a positive multiple of blocks ({blocks}), "
                             "so that every block holds the same number of item ids")
        self.rows_per_block = rows // blocks
        self.table = nn.ModuleList(nn.Embedding(self.rows_per_block, dim) for _ in range(blocks))
        for block in self.table:  # small weights: a mean of unit-variance rows would saturate nothing, but
            nn.init.normal_(block.weight, std=0.05)  # the head learns faster from a table near zero
        self.head = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, items: torch.Tensor) -> torch.Tensor:
        """`items`: (batch, bag) int64 item ids in [0, rows). Each block looks up the ids it holds (the others
        are clamped to a row of it and zeroed), so every block runs on every batch: FSDP2 gathers each once."""
        pooled = 0
        for k, block in enumerate(self.table):
            local = items - k * self.rows_per_block
            mine = (local >= 0) & (local < self.rows_per_block)
            rows = block(local.clamp(0, self.rows_per_block - 1)) * mine.unsqueeze(-1).to(block.weight.dtype)
            pooled = pooled + rows.sum(1)
        return self.head(pooled / items.shape[1])
