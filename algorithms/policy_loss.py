"""The decoupled PPO policy loss, with the staleness correction of asynchronous training.

Three policies meet here (Hilton et al., 2022, "Batch size-invariance for policy
optimization"; Fu et al., 2025, AReaL):

- behavior  pi_b: the (possibly stale) weights that sampled the tokens on a generator;
- proximal  pi_prox: the learner's weights before this update (log-probs recomputed);
- current   pi_theta: the weights being optimized.

Per response token, with advantage A and r = pi_theta / pi_prox:

    pg1 = -A * r
    pg2 = -A * clip(r, 1 - eps_low, 1 + eps_high)        (DAPO's clip-higher: eps_high > eps_low)
    pg  = max(pg1, pg2)                                   (PPO, Schulman et al., 2017)
    pg  = min(pg, -A * c)          where A < 0            (dual-clip, Ye et al., 2020; c > 1)
    w   = min(pi_prox / pi_b, cap)                        (truncated importance weight; no grad)
    loss_t = w * pg

``cap = 0`` turns the importance weight off (w = 1). With eta = 0 (synchronous) behavior and
proximal coincide, w = 1 and this is vanilla PPO. Log-prob arithmetic is in fp32 and the log
ratio is clamped to [-20, 20] before exponentiation.
"""

from __future__ import annotations

import msgspec
import torch

LOG_RATIO_CLAMP = 20.0


class PolicyLossTerms(msgspec.Struct, frozen=True):
    """Per-token loss (B, T) and detached per-token diagnostics (B, T)."""

    loss: torch.Tensor
    ratio: torch.Tensor  # pi_theta / pi_prox
    clipped: torch.Tensor  # bool: the clipped branch was taken (PPO or dual clip)
    importance_weight: torch.Tensor  # w after truncation
    importance_weight_raw: torch.Tensor  # pi_prox / pi_b before truncation
    approx_kl: torch.Tensor  # k3 estimate of KL(pi_prox || pi_theta) per token


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    behav_imp_weight_cap: float = 2.0,
) -> PolicyLossTerms:
    """The decoupled PPO loss per token (see the module docstring for the formula).

    Shapes: every input (B, T); ``advantages`` already broadcast over tokens. Only
    ``logprobs`` carries gradient; the others are treated as constants.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (dual-clip bound), got {clip_ratio_c}")
    logprobs = logprobs.float()
    proximal = proximal_logprobs.detach().float()
    behavior = behavior_logprobs.detach().float()
    advantages = advantages.detach().float()

    log_ratio = (logprobs - proximal).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_pg_loss = torch.maximum(pg_loss1, pg_loss2)
    pg_loss3 = -advantages * clip_ratio_c
    dual_clipped = torch.minimum(clip_pg_loss, pg_loss3)
    pg_loss = torch.where(advantages < 0, dual_clipped, clip_pg_loss)

    with torch.no_grad():
        raw_weight = torch.exp((proximal - behavior).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        weight = raw_weight.clamp(max=behav_imp_weight_cap) if behav_imp_weight_cap > 0 \
            else torch.ones_like(raw_weight)
        clipped = (pg_loss2 > pg_loss1) | ((advantages < 0) & (pg_loss3 < clip_pg_loss))
        approx_kl = (ratio - 1.0) - log_ratio  # k3 of KL(prox || theta)

    return PolicyLossTerms(loss=pg_loss * weight, ratio=ratio.detach(), clipped=clipped,
                           importance_weight=weight, importance_weight_raw=raw_weight,
                           approx_kl=approx_kl)
