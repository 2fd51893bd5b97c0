"""Optimizer and learning-rate schedule from the `optim` section."""

from __future__ import annotations

import math

import torch


def build_optimizer(params, optim_cfg) -> torch.optim.Optimizer:
    if optim_cfg.name == "sgd":
        return torch.optim.SGD(
            params,
            lr=optim_cfg.lr,
            momentum=optim_cfg.momentum,
            nesterov=optim_cfg.momentum > 0,
            weight_decay=optim_cfg.weight_decay,
        )
    return torch.optim.AdamW(
        params, lr=optim_cfg.lr, betas=tuple(optim_cfg.betas), weight_decay=optim_cfg.weight_decay
    )


def lr_factor(
    step: int, total_steps: int, warmup_steps: int, schedule: str, min_ratio: float
) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): linear warm-up, then cosine or
    flat."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer, optim_cfg, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(
            step, total_steps, optim_cfg.warmup_steps, optim_cfg.schedule, optim_cfg.min_lr_ratio
        ),
    )
