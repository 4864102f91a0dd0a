"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def build_optimizer(model: torch.nn.Module, opt_cfg) -> torch.optim.Optimizer:
    """AdamW (or Adam) over the model's (sharded) parameters."""
    cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[opt_cfg.name]
    return cls(model.parameters(), lr=opt_cfg.lr, betas=(opt_cfg.beta1, opt_cfg.beta2), eps=opt_cfg.eps,
               weight_decay=opt_cfg.weight_decay, foreach=True)


def lr_factor(step: int, total_steps: int, warmup_steps: int, decay_type: str, min_factor: float) -> float:
    """Multiplier of the peak lr for the optimizer step that follows `step` completed steps.

    Linear warmup over warmup_steps (never exactly 0), then linear or cosine decay from 1 to
    min_factor at total_steps, or constant.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if decay_type == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if decay_type == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_factor + (1.0 - min_factor) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, sched_cfg, total_steps: int) -> LambdaLR:
    """A LambdaLR that follows lr_factor; its state_dict is the step count."""
    return LambdaLR(optimizer, lambda s: lr_factor(s, total_steps, sched_cfg.warmup_steps,
                                                   sched_cfg.decay_type, sched_cfg.min_lr_factor))
