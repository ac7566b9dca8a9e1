"""The decoupled PPO loss against hand-computed values: clip-higher, dual-clip, TIS."""

import math

import pytest
import torch

from algorithms.policy_loss import decoupled_ppo_loss


def case() -> dict:
    # proximal log-probs 0; current ratios 1.5, 0.5, 1.1, 5; behavior such that the raw
    # importance weights pi_prox/pi_b are 2, 1, 0.25, 1.
    logprobs = torch.tensor([[math.log(1.5), math.log(0.5), math.log(1.1), math.log(5.0)]],
                            requires_grad=True)
    return dict(
        logprobs=logprobs,
        proximal_logprobs=torch.zeros(1, 4),
        behavior_logprobs=torch.tensor([[-math.log(2.0), 0.0, math.log(4.0), 0.0]]),
        advantages=torch.tensor([[1.0, -1.0, 1.0, -1.0]]),
    )


def test_clip_higher_dual_clip_and_truncated_importance_weight() -> None:
    inputs = case()
    terms = decoupled_ppo_loss(**inputs, clip_ratio_low=0.2, clip_ratio_high=0.28,
                               clip_ratio_c=3.0, behav_imp_weight_cap=1.5)
    # token 0: A=1, r=1.5 -> clipped at 1.28 -> -1.28, times w=min(2, 1.5)
    # token 1: A=-1, r=0.5 -> clipped at 0.8 -> 0.8 (below the dual bound 3), w=1
    # token 2: A=1, r=1.1 -> unclipped -1.1, w=0.25
    # token 3: A=-1, r=5 -> PPO gives 5, dual clip caps it at c=3, w=1
    torch.testing.assert_close(terms.loss, torch.tensor([[-1.92, 0.8, -0.275, 3.0]]))
    assert terms.clipped.tolist() == [[True, True, False, True]]
    torch.testing.assert_close(terms.importance_weight, torch.tensor([[1.5, 1.0, 0.25, 1.0]]))
    torch.testing.assert_close(terms.importance_weight_raw, torch.tensor([[2.0, 1.0, 0.25, 1.0]]))


def test_gradient_flows_only_through_unclipped_tokens() -> None:
    inputs = case()
    terms = decoupled_ppo_loss(**inputs, clip_ratio_low=0.2, clip_ratio_high=0.28,
                               behav_imp_weight_cap=1.5)
    terms.loss.sum().backward()
    # d(-A r w)/d logp = -A r w on the unclipped token (A=1, r=1.1, w=0.25); 0 elsewhere
    torch.testing.assert_close(inputs["logprobs"].grad, torch.tensor([[0.0, 0.0, -0.275, 0.0]]))


def test_cap_zero_turns_the_importance_weight_off() -> None:
    terms = decoupled_ppo_loss(**case(), clip_ratio_high=0.28, behav_imp_weight_cap=0.0)
    torch.testing.assert_close(terms.importance_weight, torch.ones(1, 4))
    torch.testing.assert_close(terms.loss, torch.tensor([[-1.28, 0.8, -1.1, 3.0]]))


def test_on_policy_is_vanilla_ppo_with_ratio_one() -> None:
    logprobs = torch.tensor([[-0.3, -1.2]], requires_grad=True)
    terms = decoupled_ppo_loss(logprobs, logprobs.detach(), logprobs.detach(),
                               torch.tensor([[2.0, -1.0]]))
    torch.testing.assert_close(terms.loss, torch.tensor([[-2.0, 1.0]]))
    torch.testing.assert_close(terms.approx_kl, torch.zeros(1, 2))


def test_dual_clip_bound_must_exceed_one() -> None:
    with pytest.raises(ValueError, match="clip_ratio_c"):
        decoupled_ppo_loss(**case(), clip_ratio_c=1.0)
