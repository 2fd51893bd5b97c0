"""A recommender-shaped model whose weights are almost all one large embedding table, cheap to
compute: a bag of item ids -> the mean of their embeddings -> a small MLP -> click / no click.

The table is held as `blocks` row blocks (item ids [0, rows/blocks) in the first, and so on), each
an `ItemBlock`, so that FSDP2 shards it as that many units (pipeline/distributed/parallelize.py
picks the repeated class of the largest ModuleList): a rank then all-gathers, and holds the dense
gradient of, a few blocks at a time instead of the whole table. Row-wise blocks are what recommender
libraries (TorchRec's row-wise sharding) do for the same reason. The graph is plain Gather/Mul/Add:
any ONNX runtime runs it.
"""

from __future__ import annotations

import torch
from torch import nn


class ItemBlock(nn.Module):
    """Rows [first, first + rows) of the table: adds the embeddings of the ids it holds to the
    running sum.

    The sum is passed through every block on purpose: FSDP2 reduce-scatters a unit's gradient (and
    frees its gathered weights) when the gradient reaches the unit's inputs, and a lookup's only
    input, the ids, takes none; a block fed ids alone would keep its gathered weights and dense
    gradient until the end of the whole backward, every block at once (2 x the table per rank). Fed
    the sum, each block is done as soon as its own backward is, and only the first block waits for
    the end."""

    def __init__(self, first: int, rows: int, dim: int):
        super().__init__()
        self.first, self.rows = first, rows
        self.embedding = nn.Embedding(rows, dim)
        # near zero: the head learns faster from a small table
        nn.init.normal_(self.embedding.weight, std=0.05)

    def forward(self, items: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        # Ids of other blocks are clamped to a row of this one and zeroed: every block runs on every
        # batch.
        local = items - self.first
        mine = (local >= 0) & (local < self.rows)
        rows = self.embedding(local.clamp(0, self.rows - 1)) * mine.unsqueeze(-1).to(
            self.embedding.weight.dtype
        )
        return pooled + rows.sum(1)


class BagOfItems(nn.Module):
    def __init__(
        self, rows: int, dim: int = 128, blocks: int = 1, hidden: int = 64, num_classes: int = 2
    ):
        super().__init__()
        if rows < 1 or blocks < 1 or rows % blocks:
            raise ValueError(
                f"rows ({rows}) must be a positive multiple of blocks ({blocks}), "
                "so that every block holds the same number of item ids"
            )
        per_block = rows // blocks
        self.dim = dim
        self.table = nn.ModuleList(ItemBlock(k * per_block, per_block, dim) for k in range(blocks))
        self.head = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, items: torch.Tensor) -> torch.Tensor:
        """`items`: (batch, bag) int64 item ids in [0, rows)."""
        pooled = torch.zeros(
            items.shape[0], self.dim, dtype=self.head[0].weight.dtype, device=items.device
        )
        for block in self.table:
            pooled = block(items, pooled)
        return self.head(pooled / items.shape[1])
