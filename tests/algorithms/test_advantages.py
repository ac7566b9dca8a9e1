"""Advantage estimators against hand-computed values."""

import math
import typing

import pytest
import torch

from relay.algorithms.advantages import (
    ESTIMATORS,
    AdvantageInputs,
    AdvEstimator,
    compute_advantages,
    gae_advantages,
    grpo_advantages,
    masked_whiten,
    sequence_scores,
    token_level_rewards,
)


def estimate(name: str, inputs: AdvantageInputs, *, norm_adv_by_std_in_grpo: bool = True,
             gamma: float = 1.0) -> torch.Tensor:
    """``compute_advantages`` with verl's algorithm defaults for its two scalars."""
    return compute_advantages(name, inputs, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
                              gamma=gamma)


def test_grpo_normalizes_by_unbiased_group_std() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    adv = grpo_advantages(rewards, groups)
    std = math.sqrt(4 * 0.25 / 3)  # unbiased std of [1, 0, 0, 1]
    a = 0.5 / (std + 1e-6)
    expected = torch.tensor([a, -a, -a, a, 0.0, 0.0, 0.0])  # zero spread, group of one -> 0
    torch.testing.assert_close(adv, expected)


def test_dr_grpo_only_centers() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0])
    groups = torch.tensor([5, 5, 5, 5, 9])
    adv = grpo_advantages(rewards, groups, norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0]))


def test_groups_need_not_be_contiguous() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([7, 3, 7, 3, 7, 3])
    adv = grpo_advantages(rewards, groups, norm_by_std=False)
    expected = torch.tensor([1 / 3, -1 / 3, -2 / 3, -1 / 3, 1 / 3, 2 / 3])
    torch.testing.assert_close(adv, expected)


# ------------------------------------------------------------------ registry estimators
# Common batch: 2 groups of 3, rewards 1,0,0 / 1,1,0, response lengths 3,2,1 / 4,2,3 (T = 4).

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1])
LENGTHS = [3, 2, 1, 4, 2, 3]


def _mask(lengths: list[int], horizon: int = 4) -> torch.Tensor:
    return torch.tensor([[1.0] * n + [0.0] * (horizon - n) for n in lengths])


def _per_sample(values: list[float], lengths: list[int] = LENGTHS) -> torch.Tensor:
    """Expected (B, T): each sample's value on its response tokens, 0 after."""
    return torch.tensor(values).unsqueeze(-1) * _mask(lengths)


def _common(**extra: torch.Tensor) -> AdvantageInputs:
    return AdvantageInputs(rewards=REWARDS, group_ids=GROUPS, response_mask=_mask(LENGTHS),
                           **extra)


# Both groups have unbiased std sqrt(((2/3)^2 + (1/3)^2 + (1/3)^2) / 2) = sqrt(1/3).
STD = math.sqrt(1 / 3)


def test_grpo_estimator_normalizes_by_group_std() -> None:
    adv = estimate("grpo", _common())
    # group 0: mean 1/3 -> centered 2/3, -1/3, -1/3; group 1: mean 2/3 -> 1/3, 1/3, -2/3
    a, b = (2 / 3) / (STD + 1e-6), (1 / 3) / (STD + 1e-6)
    torch.testing.assert_close(adv, _per_sample([a, -b, -b, b, b, -a]))


def test_grpo_estimator_dr_grpo_only_centers() -> None:
    adv = estimate("grpo", _common(), norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(adv, _per_sample([2 / 3, -1 / 3, -1 / 3, 1 / 3, 1 / 3, -2 / 3]))


def test_grpo_estimator_is_grpo_advantages_broadcast() -> None:
    adv = estimate("grpo", _common())
    per_sample = grpo_advantages(REWARDS, GROUPS)
    torch.testing.assert_close(adv, per_sample.unsqueeze(-1) * _mask(LENGTHS))


def test_rloo_leave_one_out_baseline() -> None:
    adv = estimate("rloo", _common())
    # n/(n-1) * (r - mean) with n = 3: 3/2 * (2/3, -1/3, -1/3) and 3/2 * (1/3, 1/3, -2/3);
    # e.g. sample 0: 1 - mean(0, 0) = 1, sample 1: 0 - mean(1, 0) = -0.5
    torch.testing.assert_close(adv, _per_sample([1.0, -0.5, -0.5, 0.5, 0.5, -1.0]))


def test_rloo_group_of_one_is_zero() -> None:
    inputs = AdvantageInputs(rewards=torch.tensor([1.0, 0.0, 5.0]),
                             group_ids=torch.tensor([0, 0, 1]), response_mask=_mask([2, 2, 2]))
    adv = estimate("rloo", inputs)
    # group 0: 2/1 * (1 - 0.5) = 1, 2/1 * (0 - 0.5) = -1; group 1 has one sample -> 0
    torch.testing.assert_close(adv, _per_sample([1.0, -1.0, 0.0], [2, 2, 2]))


def test_opo_length_weighted_baseline() -> None:
    adv = estimate("opo", _common())
    # group 0: b = (3*1 + 2*0 + 1*0) / (3+2+1) = 1/2 -> 1/2, -1/2, -1/2
    # group 1: b = (4*1 + 2*1 + 3*0) / (4+2+3) = 2/3 -> 1/3, 1/3, -2/3
    torch.testing.assert_close(adv, _per_sample([0.5, -0.5, -0.5, 1 / 3, 1 / 3, -2 / 3]))


def test_gpg_scales_centered_score_by_batch_over_nonzero() -> None:
    adv = estimate("gpg", _common())
    # alpha = B / #nonzero scores = 6 / 3 = 2; centered as in Dr.GRPO, times 2
    torch.testing.assert_close(adv, _per_sample([4 / 3, -2 / 3, -2 / 3, 2 / 3, 2 / 3, -4 / 3]))


def test_grpo_passk_only_best_sample_gets_gap() -> None:
    adv = estimate("grpo_passk", _common())
    # group 0: best = sample 0, gap 1 - 0 = 1, / (sqrt(1/3) + eps); group 1: tie 1 - 1 = 0
    torch.testing.assert_close(adv, _per_sample([1 / (STD + 1e-6), 0, 0, 0, 0, 0]))


def test_grpo_passk_second_best_and_std_flag() -> None:
    inputs = AdvantageInputs(rewards=torch.tensor([1.0, 0.0, 0.0, 0.2, 0.9, 0.5]),
                             group_ids=GROUPS, response_mask=_mask(LENGTHS))
    plain = estimate("grpo_passk", inputs, norm_adv_by_std_in_grpo=False)
    # group 1: best 0.9 (sample 4), second 0.5 -> 0.4
    torch.testing.assert_close(plain, _per_sample([1.0, 0, 0, 0, 0.4, 0]))
    normed = estimate("grpo_passk", inputs)
    # group 1 std: mean 1.6/3, sum of squares 0.04+0.81+0.25 - 3*(1.6/3)^2 = 0.74/3, / 2
    std1 = math.sqrt(0.37 / 3)
    expected = [1 / (STD + 1e-6), 0, 0, 0, 0.4 / (std1 + 1e-6), 0]
    torch.testing.assert_close(normed, _per_sample(expected))


def test_reinforce_plus_plus_baseline_whitens_over_tokens() -> None:
    inputs = AdvantageInputs(rewards=torch.tensor([1.0, 0.0]), group_ids=torch.tensor([0, 0]),
                             response_mask=_mask([2, 1], 3))
    adv = estimate("reinforce_plus_plus_baseline", inputs)
    # centered 0.5, -0.5 -> tokens 0.5, 0.5, -0.5; mean 1/6; deviations 1/3, 1/3, -2/3;
    # unbiased var (1/9 + 1/9 + 4/9) / 2 = 1/3
    sd = math.sqrt(1 / 3 + 1e-8)
    expected = torch.tensor([[(1 / 3) / sd, (1 / 3) / sd, 0.0], [(-2 / 3) / sd, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected)


def test_reinforce_plus_plus_discounted_returns_whitened() -> None:
    inputs = AdvantageInputs(rewards=torch.tensor([1.0, 2.0]), group_ids=torch.tensor([0, 1]),
                             response_mask=torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]),
                             token_rewards=torch.tensor([[0.0, -0.1, 0.0], [-0.2, 0.0, 0.0]]))
    adv = estimate("reinforce_plus_plus", inputs, gamma=0.5)
    # totals (outcome on the last response token): [0, -0.1, 1] and [-0.2, 2, -]
    # returns: row 0: t2 = 1, t1 = -0.1 + 0.5*1 = 0.4, t0 = 0 + 0.5*0.4 = 0.2
    #          row 1: t1 = 2, t0 = -0.2 + 0.5*2 = 0.8
    # tokens 0.2, 0.4, 1, 0.8, 2: mean 4.4/5 = 0.88, deviations -0.68, -0.48, 0.12, -0.08, 1.12
    # unbiased var = (0.4624 + 0.2304 + 0.0144 + 0.0064 + 1.2544) / 4 = 0.492
    sd = math.sqrt(0.492 + 1e-8)
    expected = torch.tensor([[-0.68 / sd, -0.48 / sd, 0.12 / sd], [-0.08 / sd, 1.12 / sd, 0.0]])
    torch.testing.assert_close(adv, expected)


def verl_reinforce_plus_plus(inputs: AdvantageInputs, gamma: float) -> torch.Tensor:
    """verl's REINFORCE++ recursion (the running return reset at every masked position),
    then the batch whitening: what Relay computed before it skipped masked positions."""
    rewards = token_level_rewards(inputs)
    mask = inputs.response_mask.to(torch.float64)
    returns, running = torch.zeros_like(rewards), torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[-1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return masked_whiten(returns, inputs.trained_mask.to(torch.float64)).float()


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_on_contiguous_responses_is_verls_bit_for_bit(gamma: float) -> None:
    """Single-turn responses (prompt offset, then a contiguous response, then padding): the
    returns that skip masked positions are exactly verl's, which reset there."""
    generator = torch.Generator().manual_seed(0)
    starts, lengths = torch.randint(0, 4, (16,), generator=generator), \
        torch.randint(1, 9, (16,), generator=generator)
    column = torch.arange(12)[None]
    mask = ((column >= starts[:, None]) & (column < (starts + lengths)[:, None])).float()
    inputs = AdvantageInputs(rewards=torch.randn(16, generator=generator),
                             group_ids=torch.arange(16) // 4, response_mask=mask,
                             token_rewards=torch.randn(16, 12, generator=generator) * mask,
                             kept_mask=(torch.rand(16, 12, generator=generator) > 0.2).float())
    ours = estimate("reinforce_plus_plus", inputs, gamma=gamma)
    assert torch.equal(ours, verl_reinforce_plus_plus(inputs, gamma))


def test_reinforce_plus_plus_carries_a_later_turns_return_across_inserted_tokens() -> None:
    """A two-turn episode: policy tokens at t0, t1, a tool response at t2, t3 (off the mask),
    policy tokens at t4, t5, outcome 1 on t5, gamma 0.5. The return steps from t4 to t1 as
    if the tool tokens were not there: returns 1, 0.5, (0, 0), 0.25, 0.125 reversed; verl's
    reset would leave turn 1 with nothing."""
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
    inputs = AdvantageInputs(rewards=torch.tensor([1.0, 0.0]), group_ids=torch.tensor([0, 1]),
                             response_mask=mask)
    adv = estimate("reinforce_plus_plus", inputs, gamma=0.5)
    returns = torch.tensor([[0.125, 0.25, 0.0, 0.0, 0.5, 1.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]],
                           dtype=torch.float64)
    torch.testing.assert_close(adv, masked_whiten(returns, mask.double()).float())
    assert (adv[0, :2] > adv[1, :2]).all() and adv[0, 2:4].eq(0).all()
    reset = verl_reinforce_plus_plus(inputs, 0.5)
    assert (reset[0, :2] == reset[1, :2]).all(), "verl's reset: turn 1 as if unrewarded"


def test_the_outcome_sits_on_the_last_policy_token_of_a_multi_turn_episode() -> None:
    """An episode that ends on inserted tokens (a tool response after the last turn): the
    outcome reward goes to the last token the policy sampled."""
    inputs = AdvantageInputs(rewards=torch.tensor([2.0]), group_ids=torch.tensor([0]),
                             response_mask=torch.tensor([[1.0, 1.0, 0.0, 1.0, 0.0, 0.0]]))
    torch.testing.assert_close(token_level_rewards(inputs), torch.tensor(
        [[0.0, 0.0, 0.0, 2.0, 0.0, 0.0]], dtype=torch.float64))


def test_remax_returns_minus_greedy_baseline() -> None:
    inputs = AdvantageInputs(rewards=torch.tensor([1.0, 0.0]), group_ids=torch.tensor([0, 1]),
                             response_mask=torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]),
                             token_rewards=torch.tensor([[0.0, -0.1, 0.0], [0.0, 0.0, 0.0]]),
                             baseline_rewards=torch.tensor([0.5, 0.5]))
    adv = estimate("remax", inputs)
    # row 0: totals [0, -0.1, 1] -> undiscounted returns [0.9, 0.9, 1] - 0.5
    # row 1: totals [0, 0, -] -> returns 0 - 0.5 on the two response tokens
    torch.testing.assert_close(adv, torch.tensor([[0.4, 0.4, 0.5], [-0.5, -0.5, 0.0]]))


def test_remax_without_baseline_raises() -> None:
    with pytest.raises(ValueError, match="baseline_rewards"):
        estimate("remax", _common())


def test_unknown_estimator_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'") as info:
        estimate("ppo", _common())
    for name in ESTIMATORS:
        assert name in str(info.value)


def test_mismatched_shapes_raise() -> None:
    inputs = AdvantageInputs(rewards=REWARDS[:5], group_ids=GROUPS, response_mask=_mask(LENGTHS))
    with pytest.raises(ValueError, match="rewards must have shape"):
        estimate("grpo", inputs)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_zero_off_the_response_mask(name: str) -> None:
    inputs = _common(token_rewards=torch.full((6, 4), -0.05) * _mask(LENGTHS),
                     baseline_rewards=torch.full((6,), 0.3))
    adv = estimate(name, inputs)
    assert adv.shape == (6, 4) and adv.dtype == torch.float32
    assert torch.isfinite(adv).all()
    assert (adv[_mask(LENGTHS) == 0] == 0).all()
    assert (adv != 0).any()


def test_token_rewards_enter_through_their_masked_sum() -> None:
    inputs = AdvantageInputs(rewards=torch.tensor([1.0, 0.0]), group_ids=torch.tensor([0, 0]),
                             response_mask=_mask([2, 1], 3),
                             token_rewards=torch.tensor([[-0.1, -0.1, 7.0], [-0.3, 7.0, 7.0]]))
    adv = estimate("rloo", inputs)
    # scores (7.0 is off the mask, ignored): 1 - 0.2 = 0.8 and 0 - 0.3 = -0.3; mean 0.25
    # n/(n-1) = 2: 2 * 0.55 = 1.1, 2 * -0.55 = -1.1
    torch.testing.assert_close(adv, torch.tensor([[1.1, 1.1, 0.0], [-1.1, 0.0, 0.0]]))


def test_token_level_rewards_put_outcome_on_last_response_token() -> None:
    inputs = AdvantageInputs(rewards=torch.tensor([2.0, 3.0, 4.0]),
                             group_ids=torch.tensor([0, 0, 0]),
                             response_mask=torch.tensor([[1.0, 0.0, 1.0, 0.0],
                                                         [1.0, 1.0, 1.0, 1.0],
                                                         [0.0, 0.0, 0.0, 0.0]]),
                             token_rewards=torch.tensor([[-0.5, 0.0, -0.5, 0.0],
                                                         [0.1, 0.0, 0.0, 0.0],
                                                         [0.0, 0.0, 0.0, 0.0]]))
    expected = torch.tensor([[-0.5, 0.0, 1.5, 0.0],  # last response token is t = 2
                             [0.1, 0.0, 0.0, 3.0],
                             [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)  # empty response
    torch.testing.assert_close(token_level_rewards(inputs), expected)
    torch.testing.assert_close(sequence_scores(inputs),
                               torch.tensor([1.0, 3.1, 4.0], dtype=torch.float64))


def test_gae_against_hand_unrolled_three_tokens() -> None:
    rewards = torch.tensor([[0.1, 0.0, 1.0], [0.1, 1.0, 5.0]])
    values = torch.tensor([[0.5, 0.4, 0.6], [0.5, 0.4, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # row 1's t = 2 must not count
    adv, returns = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    # gamma * lam = 0.72
    # row 0: t2: delta = 1 - 0.6 = 0.4;               A2 = 0.4
    #        t1: delta = 0 + 0.9*0.6 - 0.4 = 0.14;    A1 = 0.14 + 0.72*0.4 = 0.428
    #        t0: delta = 0.1 + 0.9*0.4 - 0.5 = -0.04; A0 = -0.04 + 0.72*0.428 = 0.26816
    # row 1: t1: delta = 1 - 0.4 = 0.6;               A1 = 0.6
    #        t0: delta = -0.04;                       A0 = -0.04 + 0.72*0.6 = 0.392
    raw = [0.26816, 0.428, 0.4, 0.392, 0.6]
    torch.testing.assert_close(
        returns, torch.tensor([[0.76816, 0.828, 1.0], [0.892, 1.0, 0.0]]))  # A + V
    mean = sum(raw) / 5  # 0.417632
    sd = math.sqrt(sum((a - mean) ** 2 for a in raw) / 4 + 1e-8)
    white = [(a - mean) / sd for a in raw]
    torch.testing.assert_close(adv, torch.tensor([white[:3], white[3:] + [0.0]]))


# ------------------------------------------------------------- rejection (kept_mask)


def test_opo_lengths_count_only_the_kept_tokens() -> None:
    # one group: rewards 1, 0; responses of 4 and 2 tokens; the correction rejected the last
    # 3 tokens of the first. Kept lengths 1 and 2: baseline (1*1 + 2*0) / 3 = 1/3 (the whole
    # lengths would give 4/6), so A = 2/3, -1/3, on the kept tokens only.
    inputs = AdvantageInputs(rewards=torch.tensor([1.0, 0.0]), group_ids=torch.tensor([0, 0]),
                             response_mask=_mask([4, 2]),
                             kept_mask=torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 1]]))
    adv = estimate("opo", inputs)
    torch.testing.assert_close(adv, torch.tensor([[2 / 3, 0, 0, 0], [-1 / 3, -1 / 3, 0, 0]]))


def test_reinforce_plus_plus_whitens_over_the_kept_tokens_with_returns_over_the_response() -> None:
    # rewards 1 and 0, responses of 2 and 1 tokens (gamma 1): returns [1, 1] and [0]. The
    # correction rejected the first row's last token: its reward still flows back (return 1
    # at t0), and the whitening is over the 2 kept tokens, returns 1 and 0: mean 1/2, unbiased
    # var 1/2 -> +-(1/2) / sqrt(1/2); the rejected token gets 0.
    inputs = AdvantageInputs(rewards=torch.tensor([1.0, 0.0]), group_ids=torch.tensor([0, 1]),
                             response_mask=_mask([2, 1], 3),
                             kept_mask=torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]]))
    adv = estimate("reinforce_plus_plus", inputs)
    a = 0.5 / math.sqrt(0.5 + 1e-8)
    torch.testing.assert_close(adv, torch.tensor([[a, 0.0, 0.0], [-a, 0.0, 0.0]]))


def test_gae_whitens_over_the_kept_tokens_and_keeps_the_critics_returns() -> None:
    # the three-token case above with row 0's t1 rejected: the raw advantages and returns
    # are unchanged; the whitening is over the 4 kept ones [0.26816, 0.4, 0.392, 0.6]
    rewards = torch.tensor([[0.1, 0.0, 1.0], [0.1, 1.0, 5.0]])
    values = torch.tensor([[0.5, 0.4, 0.6], [0.5, 0.4, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    kept = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    adv, returns = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8, kept_mask=kept)
    torch.testing.assert_close(
        returns, torch.tensor([[0.76816, 0.828, 1.0], [0.892, 1.0, 0.0]]))
    raw = [0.26816, 0.4, 0.392, 0.6]
    mean = sum(raw) / 4
    sd = math.sqrt(sum((a - mean) ** 2 for a in raw) / 3 + 1e-8)
    white = [(a - mean) / sd for a in raw]
    torch.testing.assert_close(adv, torch.tensor([[white[0], 0.0, white[1]],
                                                  [white[2], white[3], 0.0]]))


def test_every_configurable_estimator_has_its_code() -> None:
    # gae runs with the learner's critic, prime with its implicit PRM; the rest are here
    assert set(typing.get_args(AdvEstimator)) == set(ESTIMATORS) | {"gae", "prime"}
