"""Every policy-loss mode against hand-computed values, gradients and clip flags.

The shared case has 2 rows x 3 tokens; the last token of row 1 is masked and has an extreme
ratio e^5, so any leak of a masked token into the other tokens would show. Log-probs and
ratios are chosen directly and the proximal log-probs derived from them:

    log pi_theta = [[-1.0, -2.0, -0.5], [-1.5, -0.5, -3.0]]
    r            = [[ 1.5,  0.5,  1.1], [ 0.5,  5.0,  e^5 ]]     (mask [[1, 1, 1], [1, 1, 0]])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from relay.algorithms.aggregation import aggregate_loss
from relay.algorithms.policy_loss import (
    LOSS_MODES,
    PolicyLossConfig,
    PolicyLossTerms,
    policy_loss,
    policy_loss_agg_mode,
)

LOGPROBS = [[-1.0, -2.0, -0.5], [-1.5, -0.5, -3.0]]
RATIOS = [[1.5, 0.5, 1.1], [0.5, 5.0, math.exp(5.0)]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


@dataclass
class Case:
    logprobs: torch.Tensor  # leaf with requires_grad
    proximal_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor


def make_case(row_advantages: tuple[float, float]) -> Case:
    logprobs = torch.tensor(LOGPROBS, requires_grad=True)
    proximal = logprobs.detach() - torch.tensor(RATIOS).log()
    advantages = torch.tensor(row_advantages).unsqueeze(-1).expand(2, 3)
    return Case(logprobs, proximal, advantages, torch.tensor(MASK))


CLIP = dict(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)  # ActorConfig's


def run(case: Case, generator: torch.Generator | None = None,
        importance_weights: torch.Tensor | None = None, **params: object) -> PolicyLossTerms:
    """``params``: PolicyLossConfig's keys and the actor's clip_ratio_* (defaults as verl's)."""
    clip = {key: params.pop(key, value) for key, value in CLIP.items()}
    return policy_loss(case.logprobs, case.proximal_logprobs, case.advantages, case.mask,
                       PolicyLossConfig(**params), **clip,  # type: ignore[arg-type]
                       importance_weights=importance_weights, generator=generator)


def masked(values: torch.Tensor, case: Case) -> torch.Tensor:
    return values * case.mask


def flags(terms: PolicyLossTerms, case: Case) -> list[list[bool]]:
    return (terms.clipped & case.mask.bool()).tolist()


def grad(terms: PolicyLossTerms, case: Case) -> torch.Tensor:
    """d/d logprobs of the masked sum of token losses."""
    return torch.autograd.grad(masked(terms.loss, case).sum(), case.logprobs)[0]


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_registry_holds_the_verl_modes() -> None:
    assert set(LOSS_MODES) == {
        "vanilla", "gspo", "clip_cov", "kl_cov", "gpg", "geo_mean", "cispo", "sapo"}


def test_vanilla_clip_higher_and_dual_clip() -> None:
    case = make_case((1.0, -1.0))
    terms = run(case, loss_mode="vanilla", clip_ratio_low=0.2, clip_ratio_high=0.28,
                clip_ratio_c=3.0)
    # row 0, A=+1: r=1.5 -> max(-1.5, -1.28) = -1.28 (clipped); r=0.5 -> max(-0.5, -0.8) = -0.5;
    #              r=1.1 -> -1.1
    # row 1, A=-1: r=0.5 -> max(0.5, 0.8) = 0.8 (clipped, below c=3);
    #              r=5   -> max(5, 1.28) = 5, dual-clip min(5, 3) = 3 (clipped)
    expected = torch.tensor([[-1.28, -0.5, -1.1], [0.8, 3.0, 0.0]])
    torch.testing.assert_close(masked(terms.loss, case), expected)
    assert flags(terms, case) == [[True, False, False], [True, True, False]]
    torch.testing.assert_close(terms.ratio, torch.tensor(RATIOS))
    # k3 = (r - 1) - log r per token
    expected_kl = torch.tensor([[0.5 - math.log(1.5), -0.5 - math.log(0.5), 0.1 - math.log(1.1)],
                                [-0.5 - math.log(0.5), 4.0 - math.log(5.0), 0.0]])
    torch.testing.assert_close(masked(terms.approx_kl, case), expected_kl)


def test_vanilla_gradient_flows_only_through_unclipped_tokens() -> None:
    case = make_case((1.0, -1.0))
    terms = run(case, loss_mode="vanilla", clip_ratio_low=0.2, clip_ratio_high=0.28)
    # d(-A r)/d log pi = -A r on the unclipped tokens (row 0: r=0.5, 1.1); clipped ones are
    # constant in log pi
    expected = torch.tensor([[0.0, -0.5, -1.1], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(grad(terms, case), expected)


def test_vanilla_on_policy_is_minus_advantage() -> None:
    logprobs = torch.tensor([[-0.3, -1.2]], requires_grad=True)
    terms = policy_loss(logprobs, logprobs.detach(), torch.tensor([[2.0, -1.0]]),
                        torch.ones(1, 2), PolicyLossConfig(), **CLIP)
    # r = 1: loss = -A, no clipping, KL 0
    torch.testing.assert_close(terms.loss, torch.tensor([[-2.0, 1.0]]))
    torch.testing.assert_close(terms.approx_kl, torch.zeros(1, 2))
    assert not terms.clipped.any()


def test_gspo_sequence_ratio_and_token_gradient() -> None:
    case = make_case((1.0, 0.5))
    terms = run(case, loss_mode="gspo", clip_ratio_low=0.2, clip_ratio_high=0.28)
    # row 0: s = (1.5 * 0.5 * 1.1)^(1/3) = 0.825^(1/3) ~ 0.938, inside [0.8, 1.28]: loss -1 * s
    # row 1: s = (0.5 * 5)^(1/2) ~ 1.581 (masked e^5 left out), A=0.5 > 0 and s > 1.28:
    #        clipped, loss -0.5 * 1.28 = -0.64
    s0, s1 = 0.825 ** (1 / 3), 2.5 ** 0.5
    torch.testing.assert_close(masked(terms.loss, case),
                               torch.tensor([[-s0, -s0, -s0], [-0.64, -0.64, 0.0]]))
    torch.testing.assert_close(terms.ratio, torch.tensor([[s0, s0, s0], [s1, s1, s1]]))
    assert flags(terms, case) == [[False, False, False], [True, True, False]]
    # token-level stop-gradient form: d(-A s_it)/d log pi_it = -A s_i per token of row 0
    torch.testing.assert_close(grad(terms, case),
                               torch.tensor([[-s0, -s0, -s0], [0.0, 0.0, 0.0]]))


def test_clip_cov_detaches_the_covariance_token() -> None:
    case = make_case((1.0, -1.0))
    terms = run(case, loss_mode="clip_cov", clip_ratio_low=0.2, clip_ratio_high=0.28,
                clip_cov_lb=0.3, clip_cov_ub=1.0)
    # over the 5 unmasked tokens: mean A = (3 - 2)/5 = 0.2, mean log pi = -5.5/5 = -1.1
    # cov = (A - 0.2)(log pi + 1.1): row 0: 0.8 * [0.1, -0.9, 0.6] = [0.08, -0.72, 0.48]
    #                                row 1: -1.2 * [-0.4, 0.6]     = [0.48, -0.72]
    # in (0.3, 1.0): row 0 token 2, and row 1 token 0 which PPO already clipped; the budget
    # max(1, floor(0.0002 * 5)) = 1 picks row 0 token 2 and zeroes its loss.
    # PPO without dual-clip: row 0 [-1.28 (clipped), -0.5, -1.1 -> 0], row 1 [0.8 (clipped), 5]
    torch.testing.assert_close(masked(terms.loss, case),
                               torch.tensor([[-1.28, -0.5, 0.0], [0.8, 5.0, 0.0]]))
    assert flags(terms, case) == [[True, False, True], [True, False, False]]
    # gradient -A r survives only on row 0 token 1 (r=0.5) and row 1 token 1 (A=-1, r=5)
    torch.testing.assert_close(grad(terms, case),
                               torch.tensor([[0.0, -0.5, 0.0], [0.0, 5.0, 0.0]]))


def test_clip_cov_random_choice_is_reproducible_with_a_generator() -> None:
    # cov in (-1, 1) and not PPO-clipped: row 0 tokens 1, 2 and row 1 token 1 (see above);
    # budget floor(0.4 * 5) = 2 of these 3
    params = dict(loss_mode="clip_cov", clip_ratio_low=0.2, clip_ratio_high=0.28,
                  clip_cov_lb=-1.0, clip_cov_ub=1.0, clip_cov_ratio=0.4)
    ppo_clipped = torch.tensor([[True, False, False], [True, False, False]])
    candidates = torch.tensor([[False, True, True], [False, True, False]])
    picks = []
    for _ in range(2):
        case = make_case((1.0, -1.0))
        terms = run(case, generator=torch.Generator().manual_seed(7), **params)
        picked = terms.clipped & case.mask.bool() & ~ppo_clipped
        assert int(picked.sum()) == 2 and not (picked & ~candidates).any()
        assert (terms.loss[picked] == 0).all()
        picks.append(picked)
    assert torch.equal(picks[0], picks[1])


def test_kl_cov_penalizes_the_top_covariance_tokens() -> None:
    case = make_case((1.0, -1.0))
    terms = run(case, loss_mode="kl_cov", kl_cov_ratio=0.4, ppo_kl_coef=0.1)
    # cov as in the clip_cov test; top floor(0.4 * 5) = 2: row 0 token 2, row 1 token 0 (0.48)
    # loss = -A r, plus 0.1 |log r| there: row 0 [-1.5, -0.5, -1.1 + 0.1 log 1.1],
    #                                      row 1 [0.5 + 0.1 log 2, 5.0]   (no clipping)
    expected = torch.tensor([[-1.5, -0.5, -1.1 + 0.1 * math.log(1.1)],
                             [0.5 + 0.1 * math.log(2.0), 5.0, 0.0]])
    torch.testing.assert_close(masked(terms.loss, case), expected)
    assert flags(terms, case) == [[False, False, True], [True, False, False]]


def test_gpg_is_plain_policy_gradient() -> None:
    case = make_case((1.0, -1.0))
    terms = run(case, loss_mode="gpg")
    # loss = -A log pi; gradient -A
    torch.testing.assert_close(masked(terms.loss, case),
                               torch.tensor([[1.0, 2.0, 0.5], [-1.5, -0.5, 0.0]]))
    torch.testing.assert_close(grad(terms, case),
                               torch.tensor([[-1.0, -1.0, -1.0], [1.0, 1.0, 0.0]]))
    assert not terms.clipped.any()


def test_geo_mean_clips_in_log_space_and_broadcasts_the_sequence_loss() -> None:
    case = make_case((1.0, -1.0))
    terms = run(case, loss_mode="geo_mean", clip_ratio_low=0.4, clip_ratio_high=0.4)
    # row 0, A=+1: log r = [log 1.5 ~ 0.405, log 0.5, log 1.1]; min(log r, clip(log r, -0.4, 0.4))
    #              = [0.4 (clipped), log 0.5, log 1.1]; G0 = exp((0.4 + log 0.55) / 3); L = -G0
    # row 1, A=-1: max(log r, clip(log r)) = [-0.4 (clipped, log 0.5 < -0.4), log 5];
    #              G1 = exp((log 5 - 0.4) / 2); L = +G1
    g0 = math.exp((0.4 + math.log(0.55)) / 3)
    g1 = math.exp((math.log(5.0) - 0.4) / 2)
    torch.testing.assert_close(masked(terms.loss, case),
                               torch.tensor([[-g0, -g0, -g0], [g1, g1, 0.0]]))
    assert flags(terms, case) == [[True, False, False], [True, False, False]]
    # masked sum: row 0 is -3 G0, dG0/dlog pi_t = G0/3 on unclipped tokens -> -G0;
    #             row 1 is 2 G1, dG1/dlog pi_t = G1/2 on the unclipped token -> G1
    torch.testing.assert_close(grad(terms, case),
                               torch.tensor([[0.0, -g0, -g0], [0.0, g1, 0.0]]))


def test_cispo_weights_reinforce_by_the_clipped_stop_gradient_ratio() -> None:
    case = make_case((1.0, -1.0))
    terms = run(case, loss_mode="cispo", clip_ratio_low=0.2, clip_ratio_high=0.28)
    # w = clip(r, 0.8, 1.28) = [[1.28, 0.8, 1.1], [0.8, 1.28]]; loss = -w A log pi:
    # row 0: -1.28 * -1.0 = 1.28, -0.8 * -2.0 = 1.6, -1.1 * -0.5 = 0.55
    # row 1: 0.8 * -1.5 = -1.2, 1.28 * -0.5 = -0.64
    torch.testing.assert_close(masked(terms.loss, case),
                               torch.tensor([[1.28, 1.6, 0.55], [-1.2, -0.64, 0.0]]))
    assert flags(terms, case) == [[True, True, False], [True, True, False]]
    # every token keeps a gradient -w A, clipped or not
    torch.testing.assert_close(grad(terms, case),
                               torch.tensor([[-1.28, -0.8, -1.1], [0.8, 1.28, 0.0]]))


def test_sapo_soft_gates() -> None:
    case = make_case((1.0, -1.0))
    terms = run(case, loss_mode="sapo", tau_pos=1.0, tau_neg=1.05)
    # loss = -A (4/tau) sigmoid(tau (r - 1)); row 0 tau=1, row 1 tau=1.05
    expected = torch.tensor([
        [-4 * sigmoid(0.5), -4 * sigmoid(-0.5), -4 * sigmoid(0.1)],
        [4 / 1.05 * sigmoid(1.05 * -0.5), 4 / 1.05 * sigmoid(1.05 * 4.0), 0.0],
    ])
    torch.testing.assert_close(masked(terms.loss, case), expected)
    assert not terms.clipped.any()

    # d loss / d log pi = -A * 4 sigma (1 - sigma) r (tau cancels)
    def slope(x: float, r: float) -> float:
        return 4 * sigmoid(x) * (1 - sigmoid(x)) * r

    expected_grad = torch.tensor([
        [-slope(0.5, 1.5), -slope(-0.5, 0.5), -slope(0.1, 1.1)],
        [slope(1.05 * -0.5, 0.5), slope(1.05 * 4.0, 5.0), 0.0],
    ])
    torch.testing.assert_close(grad(terms, case), expected_grad)


@pytest.mark.parametrize("mode", sorted(LOSS_MODES))
def test_every_mode_is_fp32_and_differentiates_only_logprobs(mode: str) -> None:
    logprobs = torch.tensor(LOGPROBS, dtype=torch.bfloat16, requires_grad=True)
    proximal = (logprobs.detach().float() - 0.1).requires_grad_()
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], requires_grad=True)
    terms = policy_loss(logprobs, proximal, advantages, torch.tensor(MASK),
                        PolicyLossConfig(loss_mode=mode), **CLIP, generator=torch.Generator())
    assert terms.loss.dtype == torch.float32 and terms.loss.shape == (2, 3)
    assert terms.clipped.dtype == torch.bool
    assert not any(t.requires_grad for t in (terms.ratio, terms.clipped, terms.approx_kl))
    grads = torch.autograd.grad(terms.loss.sum(), (logprobs, proximal, advantages),
                                allow_unused=True)
    assert grads[0] is not None and grads[1] is None and grads[2] is None


def test_unknown_mode_names_the_known_modes() -> None:
    with pytest.raises(ValueError, match="vanilla, gspo, clip_cov"):
        run(make_case((1.0, -1.0)), loss_mode="ppo2")


def test_dual_clip_bound_must_exceed_one() -> None:
    with pytest.raises(ValueError, match="clip_ratio_c"):
        run(make_case((1.0, -1.0)), clip_ratio_c=1.0)


@pytest.mark.parametrize("mode", ["gspo", "sapo", "geo_mean"])
def test_sequence_objectives_are_aggregated_per_sequence_as_verl_forces(mode: str) -> None:
    # verl aggregates gspo and sapo with seq-mean-token-mean and geo_mean with a plain mean
    # over sequences, whatever actor.loss_agg_mode says; the token-level modes follow it.
    for configured in ("token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        assert policy_loss_agg_mode(mode, configured) == "seq-mean-token-mean"
        assert policy_loss_agg_mode("vanilla", configured) == configured


@pytest.mark.parametrize("mode, objective", [("gspo", -1.0), ("geo_mean", -1.0),
                                             ("sapo", -2.0)])
def test_half_a_rejected_sequence_keeps_its_whole_sequence_objective(mode: str,
                                                                      objective: float) -> None:
    # One sequence of 4 tokens, A = 1, on policy (ratio 1), its last 2 tokens rejected. Each
    # kept token's loss is -A s = -1 (gspo), the sequence's -A exp(0) = -1 (geo_mean) or
    # -A (4 / tau) sigmoid(0) = -2 (sapo, tau_pos = 1). The learner aggregates under the kept
    # mask with the response's counts (1 sequence, 4 tokens): the mean over the kept tokens
    # is the whole objective, verl's -1.0; the response's length would halve it (-0.5).
    logprobs = torch.full((1, 4), -1.0, requires_grad=True)
    kept = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    terms = policy_loss(logprobs, logprobs.detach(), torch.ones(1, 4), kept,
                        PolicyLossConfig(loss_mode=mode), **CLIP)  # type: ignore[arg-type]
    aggregation = policy_loss_agg_mode(mode, "token-mean")
    loss = aggregate_loss(terms.loss, kept, aggregation, num_tokens=4, num_seqs=1)
    assert loss.item() == pytest.approx(objective)
    halved = aggregate_loss(terms.loss * kept, torch.ones(1, 4), aggregation)
    assert halved.item() == pytest.approx(objective / 2)


def test_gspo_sequence_log_ratio_is_bounded_at_ten() -> None:
    # every token log ratio 12: log s_i = 12 -> bounded at 10 (verl), s_i = e^10; A = -1 and
    # s_i above 1 + eps_high: the unclipped -A s_i wins, loss e^10, and no gradient past the
    # bound.
    logprobs = torch.tensor([[-0.5, -0.5]], requires_grad=True)
    terms = policy_loss(logprobs, logprobs.detach() - 12.0, torch.full((1, 2), -1.0),
                        torch.ones(1, 2), PolicyLossConfig(loss_mode="gspo"), **CLIP)
    torch.testing.assert_close(terms.loss, torch.full((1, 2), math.exp(10.0)))
    (gradient,) = torch.autograd.grad(terms.loss.sum(), logprobs)
    torch.testing.assert_close(gradient, torch.zeros(1, 2))


def test_geo_mean_rejected_token_leaves_the_mean_and_is_weights_combine_geometrically() -> None:
    # One row, A = +1, token log ratios [0.1, -0.2, 0.3]; the off-policy correction rejected
    # the middle token (mask 0 there) and weighs the others w = [2, -, 0.5].
    # Geometric mean over the kept tokens: exp((0.1 + 0.3) / 2) = e^0.2 (clip 0.4 not hit);
    # the IS weights enter as their geometric mean over the kept tokens: sqrt(2 * 0.5) = 1
    # (their arithmetic mean would be 1.25). Loss per token -e^0.2; gradient of the row's
    # sequence loss L = -exp(mean l) w.r.t. log pi: -e^0.2 / 2 on each kept token, 0 on the
    # rejected one (it must not reach the geometric mean).
    logprobs = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    proximal = logprobs.detach() - torch.tensor([[0.1, -0.2, 0.3]])
    kept = torch.tensor([[1.0, 0.0, 1.0]])
    weights = torch.tensor([[2.0, 7.0, 0.5]])  # 7: a rejected token's weight plays no part
    terms = policy_loss(logprobs, proximal, torch.ones(1, 3), kept,
                        PolicyLossConfig(loss_mode="geo_mean"), clip_ratio_low=0.4,
                        clip_ratio_high=0.4, clip_ratio_c=3.0, importance_weights=weights)
    torch.testing.assert_close(terms.loss, torch.full((1, 3), -math.exp(0.2)))
    (gradient,) = torch.autograd.grad(terms.loss[0, 0], logprobs)  # L_i itself
    torch.testing.assert_close(gradient,
                               torch.tensor([[-math.exp(0.2) / 2, 0.0, -math.exp(0.2) / 2]]))


def test_token_modes_multiply_each_tokens_loss_by_its_is_weight() -> None:
    case = make_case((1.0, -1.0))
    weights = torch.tensor([[2.0, 0.5, 1.0], [1.5, 0.25, 9.0]])
    plain = run(case, loss_mode="vanilla", clip_ratio_high=0.28)
    weighted = run(case, loss_mode="vanilla", clip_ratio_high=0.28, importance_weights=weights)
    torch.testing.assert_close(weighted.loss, plain.loss * weights)
