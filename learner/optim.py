"""AdamW and the learning-rate schedule, with verl's knobs.

The schedules are transformers' (``get_constant_schedule_with_warmup``,
``get_cosine_with_min_lr_schedule_with_warmup``), as verl's are. Warm-up is linear over
``lr_warmup_steps`` (or ``lr_warmup_steps_ratio`` of the run when that is -1); after it the
rate is constant, or follows a cosine from ``lr`` down to ``min_lr_ratio * lr`` at the last
step. At scheduler step s (0-based), with W warm-up steps of T:

    warm-up   lr * s / W                                         s < W
    constant  lr
    cosine    lr * (m + (1 - m) * (1 + cos(pi * (s - W) / (T - W))) / 2)
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import (
    get_constant_schedule_with_warmup,
    get_cosine_with_min_lr_schedule_with_warmup,
)

from configs.run_schema import OptimConfig


def build_optimizer(model: nn.Module, optim: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters. On the CPU it runs torch's fused kernel: the
    default there is a Python loop of a dozen ops per parameter (7% of a 24M-parameter
    learner step, against 3% fused); elsewhere torch's default (foreach on GPUs)."""
    params = [p for p in model.parameters() if p.requires_grad]
    on_cpu = all(p.device.type == "cpu" for p in params)
    return torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas),
                             weight_decay=optim.weight_decay, fused=True if on_cpu else None)


def warmup_steps(optim: OptimConfig, total_steps: int) -> int:
    """``lr_warmup_steps``, or ``lr_warmup_steps_ratio`` of the run when that is -1."""
    if optim.lr_warmup_steps >= 0:
        return optim.lr_warmup_steps
    return int(optim.lr_warmup_steps_ratio * total_steps)


def clipped_step(model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float,
                 offload_state: bool = False) -> float:
    """Clip the gradient norm to ``max_norm`` and step, unless the norm is NaN/inf.

    Returns the norm before clipping (the full norm across FSDP shards). A non-finite
    gradient is discarded instead of stepped on. ``offload_state``
    (``actor.fsdp_config.optimizer_offload``): the optimizer's state comes to its
    parameters' device for the step and goes back to the CPU after it.
    """
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    norm = float(grad_norm)
    if math.isfinite(norm):
        if offload_state:
            move_optimizer_state(optimizer, to_cpu=False)
        optimizer.step()
        if offload_state:
            move_optimizer_state(optimizer, to_cpu=True)
    optimizer.zero_grad(set_to_none=True)
    return norm


def move_optimizer_state(optimizer: torch.optim.Optimizer, to_cpu: bool) -> None:
    """Every state tensor of ``optimizer`` (not Adam's step counts) to the CPU, or to the
    device of the parameter it belongs to."""
    for param, state in optimizer.state.items():
        device = torch.device("cpu") if to_cpu else param.device
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step" and value.device != device:
                state[key] = value.to(device)


def build_scheduler(optimizer: torch.optim.Optimizer, *, total_steps: int,
                    optim: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = warmup_steps(optim, total_steps)
    if optim.warmup_style == "constant":
        return get_constant_schedule_with_warmup(optimizer, num_warmup_steps=warmup)
    return get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=warmup, num_training_steps=total_steps,
        min_lr_rate=optim.min_lr_ratio)
