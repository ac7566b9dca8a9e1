"""A user's own advantage estimator and policy loss, outside the relay package, as a run
config names them: ``algorithm.adv_estimator = "tests/e2e/user_algorithms.py:..."``.

The decorated ones declare what they need (``relay.algorithms.registry``): ``td_lambda``
needs a critic, so the learner trains one for it; the undecorated ``plain_centered_score`` is
used by path alone, declaring nothing. Each call appends one line
to the file ``$RELAY_USER_ALGORITHMS_CALLS`` names, if set, so a test can see which process
ran what. ``wrong_signature_loss`` takes too few arguments: the launch must refuse it.
"""

from __future__ import annotations

import os

import torch

from relay.algorithms.advantages import (AdvantageInputs, gae_advantages, group_stats,
                                         sequence_scores)
from relay.algorithms.policy_loss import Clip, PolicyLossConfig, PolicyLossTerms
from relay.algorithms.registry import register_adv_estimator, register_policy_loss


def _record(what: str) -> None:
    calls = os.environ.get("RELAY_USER_ALGORITHMS_CALLS")
    if calls:
        with open(calls, "a") as out:
            out.write(f"{os.getpid()} {what}\n")


@register_adv_estimator("user_centered_score", paper="a test's own", group=True)
def centered_score(inputs: AdvantageInputs, norm_adv_by_std_in_grpo: bool,
                   gamma: float) -> torch.Tensor:
    """A_i = s_i - mean_g(s), broadcast over the trained tokens (B, T)."""
    _record("centered_score")
    return plain_centered_score(inputs, norm_adv_by_std_in_grpo, gamma)


def plain_centered_score(inputs: AdvantageInputs, norm_adv_by_std_in_grpo: bool,
                         gamma: float) -> torch.Tensor:
    """``centered_score``, undecorated."""
    scores = sequence_scores(inputs)
    mean, _, _ = group_stats(scores, inputs.group_ids)
    return ((scores - mean).unsqueeze(-1) * inputs.trained_mask).float()


@register_adv_estimator("user_td_lambda", paper="a test's own", critic=True,
                        config_keys=("algorithm.gamma", "algorithm.lam", "critic"))
def td_lambda(token_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
              gamma: float, lam: float, kept_mask: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE's TD(lambda) returns as the critic's targets, and unwhitened advantages
    A_t = returns_t - V_t (GAE's advantages before whitening), clipped to [-5, 5]."""
    _record("td_lambda")
    _, returns = gae_advantages(token_rewards, values, response_mask, gamma, lam, kept_mask)
    advantages = ((returns - values.float()) * response_mask).clamp(-5.0, 5.0)
    if kept_mask is not None:
        advantages = advantages * kept_mask
    return advantages, returns


@register_policy_loss("user_clipped_reinforce", paper="a test's own",
                      zero_advantage_zero_gradient=True)
def clipped_reinforce(logprobs: torch.Tensor, proximal_logprobs: torch.Tensor,
                      advantages: torch.Tensor, response_mask: torch.Tensor,
                      config: PolicyLossConfig, clip: Clip, *,
                      generator: torch.Generator | None = None) -> PolicyLossTerms:
    """-A log pi_theta, weighted by the ratio clipped to [1 - eps_low, 1 + eps_high], no
    gradient through the weight (CISPO's form)."""
    _record("clipped_reinforce")
    log_ratio = (logprobs.float() - proximal_logprobs.detach().float()).clamp(-20, 20)
    ratio = log_ratio.detach().exp()
    weight = ratio.clamp(1 - clip.low, 1 + clip.high)
    loss = -weight * advantages.detach().float() * logprobs.float()
    return PolicyLossTerms(loss=loss, ratio=ratio, clipped=weight != ratio,
                           approx_kl=torch.expm1(log_ratio.detach()) - log_ratio.detach())


def wrong_signature_loss(logprobs: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Not the loss modes' signature."""
    return -advantages * logprobs
