"""AdamW and the learning-rate schedule, with verl's knobs.

Warm-up is linear over ``lr_warmup_steps`` (or ``lr_warmup_steps_ratio`` of the run when
that is -1); after it the rate is constant, or follows a cosine from ``lr`` down to
``min_lr_ratio * lr`` at the last step:

    warm-up   lr * (s + 1) / W                                   s < W
    constant  lr
    cosine    lr * (m + (1 - m) * (1 + cos(pi * (s - W) / (T - W))) / 2)
"""

from __future__ import annotations

import math

import torch
from torch import nn

from configs.run_schema import OptimConfig


def build_optimizer(model: nn.Module, optim: OptimConfig) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas),
                             weight_decay=optim.weight_decay)


def lr_factor(step: int, *, total_steps: int, optim: OptimConfig) -> float:
    """The multiplier of ``optim.lr`` at scheduler step ``step`` (0-based)."""
    warmup = optim.lr_warmup_steps if optim.lr_warmup_steps >= 0 \
        else int(optim.lr_warmup_steps_ratio * total_steps)
    if step < warmup:
        return (step + 1) / warmup
    if optim.warmup_style == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    floor = optim.min_lr_ratio
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def clipped_step(model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> float:
    """Clip the gradient norm to ``max_norm`` and step, unless the norm is NaN/inf.

    Returns the norm before clipping (the full norm across FSDP shards). A non-finite
    gradient is discarded instead of stepped on.
    """
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    norm = float(grad_norm)
    if math.isfinite(norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def build_scheduler(optimizer: torch.optim.Optimizer, *, total_steps: int,
                    optim: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps=total_steps, optim=optim))
