"""Advantage estimators for outcome rewards (one scalar reward per sample).

Samples of the same prompt form a group, identified by ``group_ids`` (B,) (any integer
labels; groups need not be contiguous nor equal in size). Estimators return one advantage
per sample (B,); the learner broadcasts it over the sample's response tokens.
"""

from __future__ import annotations

import torch


def group_stats(values: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-sample group mean, unbiased group std and group size, each (B,).

    A group of one has std 0 (no spread to normalize by).
    """
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    values = values.to(torch.float64)
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse,
                                                                     torch.ones_like(values))
    total = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse, values)
    mean = total / count
    sq_dev = torch.zeros(num_groups, dtype=torch.float64).index_add_(
        0, inverse, (values - mean[inverse]) ** 2)
    std = torch.where(count > 1, (sq_dev / (count - 1).clamp(min=1)).sqrt(),
                      torch.zeros_like(count))
    return mean[inverse], std[inverse], count[inverse]


def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO's group-relative advantage (Shao et al., 2024, DeepSeekMath):

        A_i = (r_i - mean_g(r)) / (std_g(r) + eps)     if norm_by_std  (GRPO)
        A_i =  r_i - mean_g(r)                          otherwise      (Dr.GRPO, Liu et al. 2025)

    std is the unbiased sample standard deviation of the group's rewards (as verl computes
    it); a group of one sample gets advantage 0. Shapes: rewards, group_ids (B,) -> (B,).
    """
    mean, std, count = group_stats(rewards, group_ids)
    centered = rewards.to(torch.float64) - mean
    advantages = centered / (std + eps) if norm_by_std else centered
    return torch.where(count > 1, advantages, torch.zeros_like(advantages)).to(torch.float32)
