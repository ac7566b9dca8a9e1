"""PRIME: process rewards from an implicit PRM trained online on outcome labels.

Cui et al. 2025, "Process Reinforcement through Implicit Rewards" (arXiv 2502.01456). The
implicit process reward model pi_phi is a causal LM (initialised from the policy) scored
against the frozen reference pi_ref; per response token t of sample i

    q_it = log pi_phi(y_it | y_i,<t) - log pi_ref(y_it | y_i,<t)
    process reward   p_it = beta * q_it   on every response token but the last, 0 there (B, T)

The last token's process reward is 0 as in verl's PRIME recipe (``prime_dp_rm``, token
granularity fills the scores up to, not including, the last response position): the last
token is where the outcome reward sits, and the PRM's summed q is already trained to predict
that outcome.

It learns from outcome labels l_i in [0, 1] (the verifier's score) alone, with the
cross-entropy of the sequence-level implicit reward:

    loss = mean_i BCE( sigmoid(beta * sum_t m_it q_it), l_i )

Advantages (``prime_advantages``, verl's PRIME recipe ``compute_rloo_advantage_return``)
give both signals a leave-one-out baseline within each prompt's group of K samples:

    loo(x)_it = x_it * K / (K - 1) - (1 / (K - 1)) * sum_{j in g} mean_{t in j} x_jt
    R_it = c_dpo * loo(p)_it + c_gt * loo(o)_it
    G_it = sum_{t' >= t} R_it'            A = whiten_batch(G)

where o puts the outcome reward on the last response token (so loo(o) there is
r_i - mean_{j != i} r_j, RLOO), c_dpo = ``reward_dpo_coef``, c_gt = ``reward_gt_coef``.
Shapes: log-probs and masks (B, T) on the learner's shifted grid, per-sample tensors (B,).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from relay.algorithms.advantages import group_index, group_sum, masked_whiten
from relay.algorithms.registry import register_adv_estimator


def implicit_process_rewards(prm_logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                             response_mask: torch.Tensor, beta: float) -> torch.Tensor:
    """p_it = beta * (log pi_phi - log pi_ref) on the response but its last token, 0
    elsewhere; (B, T) fp32."""
    mask = response_mask.float() * (1.0 - last_token_mask(response_mask).float())
    return beta * (prm_logprobs - ref_logprobs).float() * mask


def implicit_prm_loss(prm_logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                      response_mask: torch.Tensor, labels: torch.Tensor,
                      beta: float) -> torch.Tensor:
    """Per-sequence BCE(sigmoid(beta * sum_t m_t q_t), l), (B,); gradient flows through
    ``prm_logprobs`` only. ``labels`` must lie in [0, 1]."""
    if bool(((labels < 0) | (labels > 1)).any()):
        raise ValueError(f"PRIME's implicit PRM learns from outcome labels in [0, 1]; got "
                         f"rewards {sorted(set(labels.tolist()))[:8]}")
    implicit = beta * ((prm_logprobs.float() - ref_logprobs.detach().float())
                       * response_mask).sum(-1)
    return F.binary_cross_entropy_with_logits(implicit, labels.float(), reduction="none")


def leave_one_out(values: torch.Tensor, mask: torch.Tensor,
                  group_ids: torch.Tensor) -> torch.Tensor:
    """loo(x)_it = x_it K/(K-1) - sum_{j in g} mean_{t in j} x_jt / (K-1), masked; (B, T)
    float64. Every group needs K >= 2; a sample with an empty mask has mean 0."""
    inverse, num_groups = group_index(group_ids)
    values, mask = values.to(torch.float64), mask.to(torch.float64)
    size = group_sum(torch.ones(len(group_ids), dtype=torch.float64, device=values.device),
                     inverse, num_groups)
    if bool((size < 2).any()):
        raise ValueError("PRIME's leave-one-out baseline needs at least 2 samples per prompt")
    means = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    baseline = group_sum(means, inverse, num_groups)[inverse] / (size[inverse] - 1)
    k = size[inverse].unsqueeze(-1)
    return (values * k / (k - 1) - baseline.unsqueeze(-1)) * mask


def last_token_mask(response_mask: torch.Tensor) -> torch.Tensor:
    """1 at each row's last response position, (B, T) float64 (all 0 for an empty row)."""
    mask = response_mask.to(torch.float64)
    positions = torch.arange(mask.shape[1], dtype=torch.float64, device=mask.device)
    last = (mask * (positions + 1)).argmax(-1)
    out = torch.zeros_like(mask).scatter_(1, last.unsqueeze(-1), 1.0)
    return out * (mask.sum(-1, keepdim=True) > 0)


@register_adv_estimator("prime", paper="Cui et al. 2025, PRIME", group=True, prm=True,
                        reference=True,
                        config_keys=("algorithm.reward_dpo_coef", "algorithm.reward_gt_coef",
                                     "reward_model"))
def prime_advantages(process_rewards: torch.Tensor, outcome_rewards: torch.Tensor,
                     response_mask: torch.Tensor, group_ids: torch.Tensor,
                     reward_dpo_coef: float, reward_gt_coef: float,
                     kept_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages whitened over the batch's trained tokens, returns), both (B, T) float32
    and 0 off the response; see the module docstring. ``kept_mask``: the tokens the
    off-policy correction kept (None: all); as in ``relay.algorithms.advantages``, only the
    whitening statistics see it, and rejected tokens get advantage 0."""
    mask = response_mask.to(torch.float64)
    total = torch.zeros_like(mask)
    if reward_dpo_coef:
        total += reward_dpo_coef * leave_one_out(process_rewards, mask, group_ids)
    if reward_gt_coef:
        last = last_token_mask(mask)
        outcome = outcome_rewards.to(torch.float64).unsqueeze(-1) * last
        total += reward_gt_coef * leave_one_out(outcome, last, group_ids)
    returns = (total * mask).flip(-1).cumsum(-1).flip(-1) * mask
    trained = mask if kept_mask is None else mask * kept_mask.to(torch.float64)
    return masked_whiten(returns, trained).float(), returns.float()
