"""A model component: token embeddings and a small TransformerEncoder, any sequence length up to
max_len."""

from __future__ import annotations

import torch
from torch import nn


class SequenceClassifier(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        dim: int = 32,
        heads: int = 4,
        layers: int = 2,
        max_len: int = 128,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.position = nn.Embedding(max_len, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=dropout, batch_first=True)
        # enable_nested_tensor=False: the padded fast path would trace differently from training
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.encoder(self.embed(tokens) + self.position(positions), src_key_padding_mask=~mask)
        weights = mask.unsqueeze(-1).to(h.dtype)
        # the mean over real tokens
        pooled = (h * weights).sum(1) / weights.sum(1).clamp_min(1.0)
        return self.head(pooled)
