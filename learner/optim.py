"""AdamW and the learning-rate schedule, with verl's knobs.

The schedules are transformers' (``get_constant_schedule_with_warmup``,
``get_cosine_with_min_lr_schedule_with_warmup``), as verl's are. Warm-up is linear over
``lr_warmup_steps`` (or ``lr_warmup_steps_ratio`` of the run when that is -1); after it the
rate is constant, or follows a cosine from ``lr`` down to ``min_lr_ratio * lr`` at the last
step. At scheduler step s (0-based), with W warm-up steps of T:

    warm-up   lr * s / W                                         s < W
    constant  lr
    cosine    lr * (m + (1 - m) * (1 + cos(pi * (s - W) / (T - W))) / 2)

Resuming and replaying. A checkpoint restores the optimizer's ``param_groups`` and the
schedule's ``base_lrs`` with the values of the run that wrote it; the config's ``lr``,
``betas`` and ``weight_decay`` are put back over them (``configured_values`` before the load,
``reapply_configured`` after it), keeping the schedule's step count, so that a resume or a
replay with an edited ``run.toml`` trains with the edited values.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import torch
from torch import nn
from transformers import (
    get_constant_schedule_with_warmup,
    get_cosine_with_min_lr_schedule_with_warmup,
)

from relay.configs.run_schema import OptimConfig


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
                 offload_state: bool = False, device: torch.device | None = None) -> float:
    """Clip the gradient norm to ``max_norm`` and step, unless the norm is NaN/inf.

    Returns the norm before clipping (``grad_norm``: the full norm across FSDP shards). A
    non-finite gradient is discarded instead of stepped on; reading the norm to decide is
    the optimizer step's one host sync. ``device``: where the model computes (the
    learner's device; default: where the gradients are). ``offload_state``
    (``actor.fsdp_config.optimizer_offload``): the optimizer's state comes to its
    parameters' device for the step and goes back to the CPU after it.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    total = local_grad_norm(params, device)
    full = total.full_tensor() if hasattr(total, "full_tensor") else total
    norm = float(full)
    if math.isfinite(norm):
        nn.utils.clip_grads_with_norm_(params, max_norm, total)
        if offload_state:
            move_optimizer_state(optimizer, to_cpu=False)
        optimizer.step()
        if offload_state:
            move_optimizer_state(optimizer, to_cpu=True)
    optimizer.zero_grad(set_to_none=True)
    return norm


def local_grad_norm(params: list[nn.Parameter], device: torch.device | None) -> torch.Tensor:
    """||g||_2 of the gradients of ``params``, on ``device``. Under FSDP2 it is a DTensor
    holding this rank's part (each rank's shards' norm): the ranks combine their parts,

        ||g||_2 = (sum over ranks r of ||g_r||_2^2)^(1/2),

    in a collective when it is read (``full_tensor``) or used in arithmetic (the clipping),
    on the device the tensor is on. So it is moved to ``device`` first, as verl's
    ``fsdp2_clip_grad_norm_`` does: under ``actor.fsdp_config.param_offload`` the
    gradients are on the CPU, and the collective must run on the learner's device (NCCL
    on a GPU). A no-op on the CPU."""
    total = nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    if device is None or total.device == device:
        return total
    return total.to(device, non_blocking=True)


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


TUNED = ("betas", "weight_decay")
"""The ``param_groups`` entries ``build_optimizer`` sets from the config, besides the rate;
training never changes them."""


class ConfiguredValues(msgspec.Struct, frozen=True):
    """What the config set on an optimizer and its schedule: each parameter group's base
    rate (the schedule's ``base_lrs``) and its ``TUNED`` entries."""

    base_lrs: list[float]
    tuned: list[dict[str, Any]]


def configured_values(optimizer: torch.optim.Optimizer,
                      scheduler: torch.optim.lr_scheduler.LambdaLR) -> ConfiguredValues:
    """The values ``build_optimizer`` and ``build_scheduler`` took from the config; read them
    before a checkpoint's state replaces them."""
    return ConfiguredValues(base_lrs=list(scheduler.base_lrs),
                            tuned=[{key: group[key] for key in TUNED}
                                   for group in optimizer.param_groups])


def reapply_configured(optimizer: torch.optim.Optimizer,
                       scheduler: torch.optim.lr_scheduler.LambdaLR,
                       configured: ConfiguredValues, key: str) -> list[str]:
    """Put ``configured`` back over a checkpoint's values, keeping the schedule's step count
    s (``last_epoch``): group g's base rate becomes the config's b_g and its rate

        lr_g = b_g * lambda_g(s)

    (the config's schedule, ``lr_lambdas``, was never replaced), as if the run had always
    had the config's rate. Returns one line per value that differs from the checkpoint's,
    named under ``key`` (``actor.optim``)."""
    saved_lrs = list(scheduler.base_lrs)
    changes = [_change(f"{key}.lr", saved, configured_lr)
               for saved, configured_lr in zip(saved_lrs, configured.base_lrs, strict=True)]
    rates = [base * rate(scheduler.last_epoch)
             for base, rate in zip(configured.base_lrs, scheduler.lr_lambdas, strict=True)]
    for group, tuned, base, lr in zip(optimizer.param_groups, configured.tuned,
                                      configured.base_lrs, rates, strict=True):
        for name, value in tuned.items():
            changes.append(_change(f"{key}.{name}", group[name], value))
            group[name] = value
        group["initial_lr"], group["lr"] = base, lr
    state = scheduler.state_dict()
    state.update(base_lrs=list(configured.base_lrs), _last_lr=rates)
    scheduler.load_state_dict(state)
    return list(dict.fromkeys(change for change in changes if change))


def _change(name: str, saved: Any, configured: Any) -> str:
    """``name``'s line when the checkpoint's value differs from the config's, else ""."""
    saved, configured = _plain(saved), _plain(configured)
    if saved == configured:
        return ""
    return f"{name}: {saved} in the checkpoint, {configured} in the config: using the config's"


def _plain(value: Any) -> Any:
    """Sequences (``betas``: a tuple, or a list once loaded) as lists, to compare and print."""
    return [_plain(each) for each in value] if isinstance(value, (list, tuple)) else value
