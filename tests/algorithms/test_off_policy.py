"""Off-policy corrections against hand-computed values: IS, rejection, M2PO, A-3PO."""

import math

import msgspec
import pytest
import torch

from relay.algorithms.off_policy import (
    RolloutCorrectionConfig,
    a3po_proximal_logprobs,
    off_policy_correction,
)

LN = math.log
NO_IS = dict(rollout_is="none")


def logprobs(ratios: list[list[float | None]]) -> tuple[torch.Tensor, ...]:
    """(proximal, behavior, response_mask) with pi_prox / pi_b = the given ratios.

    None marks a position off the response; it gets wild log-probs (ratio e^35) that must
    never be counted.
    """
    proximal = [[5.0 if r is None else 0.0 for r in row] for row in ratios]
    behavior = [[-30.0 if r is None else -LN(r) for r in row] for row in ratios]
    mask = [[0.0 if r is None else 1.0 for r in row] for row in ratios]
    return torch.tensor(proximal), torch.tensor(behavior), torch.tensor(mask)


def test_token_is_is_truncated_per_token() -> None:
    prox, behav, mask = logprobs([[3.0, 1.5, 0.5, 1.0, None]])
    config = RolloutCorrectionConfig(rollout_is_threshold=2.0)
    out = off_policy_correction(prox, behav, mask, config)
    # r = 3, 1.5, 0.5, 1 -> min(r, 2) = 2, 1.5, 0.5, 1; off the response: weight 1
    torch.testing.assert_close(out.weight, torch.tensor([[2.0, 1.5, 0.5, 1.0, 1.0]]))
    torch.testing.assert_close(out.mask, mask)
    # log ratio: ln 3, ln 1.5, -ln 2, 0 and 0 off the response (not 5 - (-30) = 35)
    torch.testing.assert_close(out.log_ratio, torch.tensor([[LN(3), LN(1.5), -LN(2), 0, 0]]))


def test_sequence_is_is_the_truncated_product_over_the_response() -> None:
    prox, behav, mask = logprobs([[1.5, 1.2, None], [2.0, 3.0, 0.5], [0.25, None, None]])
    out = off_policy_correction(prox, behav, mask,
                                RolloutCorrectionConfig(rollout_is="sequence",
                                                        rollout_is_threshold=2.0))
    # row 0: exp(ln 1.5 + ln 1.2) = 1.8 (< 2), padding 1
    # row 1: exp(ln 2 + ln 3 + ln 0.5) = 3 -> truncated to 2
    # row 2: 0.25
    expected = torch.tensor([[1.8, 1.8, 1.0], [2.0, 2.0, 2.0], [0.25, 1.0, 1.0]])
    torch.testing.assert_close(out.weight, expected)
    torch.testing.assert_close(out.mask, mask)


def test_sequence_is_sums_the_log_ratios_before_clamping() -> None:
    # token log ratios +25 and -30: verl sums first (-5) and clamps the sum, weight e^-5;
    # clamping each token first (+20, -20) would cancel them to a weight of 1.
    prox = torch.zeros(1, 3)
    behav = torch.tensor([[-25.0, 30.0, -40.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # off the response: never summed
    out = off_policy_correction(prox, behav, mask, RolloutCorrectionConfig(rollout_is="sequence"))
    torch.testing.assert_close(out.weight, torch.tensor([[math.exp(-5.0)] * 2 + [1.0]]))
    # the per-token log ratio reported stays clamped
    torch.testing.assert_close(out.log_ratio, torch.tensor([[20.0, -20.0, 0.0]]))


def test_sequence_log_ratio_is_clamped_before_exp() -> None:
    prox = torch.zeros(1, 2)
    behav = torch.full((1, 2), 30.0)
    out = off_policy_correction(prox, behav, torch.ones(1, 2),
                                RolloutCorrectionConfig(rollout_is="sequence"))
    # per token -30 (reported clamped to -20); sum -60 -> clamped to -20; weight exp(-20)
    torch.testing.assert_close(out.log_ratio, torch.full((1, 2), -20.0))
    torch.testing.assert_close(out.weight, torch.full((1, 2), math.exp(-20.0)))


def test_token_rejection_masks_tokens_outside_the_interval() -> None:
    prox, behav, mask = logprobs([[3.0, 1.5, 0.25, 1.0, None]])
    params = RolloutCorrectionConfig(**NO_IS, rollout_rs="token", rollout_rs_threshold=2.0,
                                     rollout_rs_threshold_lower=0.5)
    out = off_policy_correction(prox, behav, mask, params)
    # 3 > 2 rejected, 1.5 kept, 0.25 < 0.5 rejected, 1 kept; padding stays 0
    torch.testing.assert_close(out.mask, torch.tensor([[0.0, 1.0, 0.0, 1.0, 0.0]]))
    torch.testing.assert_close(out.weight, torch.ones(1, 5))


def test_lower_rejection_bound_defaults_to_one_over_the_upper() -> None:
    # rollout_rs_threshold = 4 and no lower bound: verl's 1 / 4. Ratio 0.4 is kept (a fixed
    # lower default of 0.5 would reject it), 0.2 < 0.25 rejected, 3 kept.
    prox, behav, mask = logprobs([[0.4, 0.2, 3.0]])
    config = RolloutCorrectionConfig(**NO_IS, rollout_rs="token", rollout_rs_threshold=4.0)
    assert config.rs_bounds == (0.25, 4.0)
    out = off_policy_correction(prox, behav, mask, config)
    torch.testing.assert_close(out.mask, torch.tensor([[1.0, 0.0, 1.0]]))


def test_a_lower_rejection_bound_of_zero_means_none() -> None:
    # 0 is a bound (verl: ``lower if lower is not None else 1 / upper``), not "absent": every
    # ratio up to the upper bound is kept, 0.01 included; 5 > 4 is still rejected.
    prox, behav, mask = logprobs([[0.4, 0.01, 3.0, 5.0]])
    config = RolloutCorrectionConfig(**NO_IS, rollout_rs="token", rollout_rs_threshold=4.0,
                                     rollout_rs_threshold_lower=0.0)
    assert config.rs_bounds == (0.0, 4.0)
    out = off_policy_correction(prox, behav, mask, config)
    torch.testing.assert_close(out.mask, torch.tensor([[1.0, 1.0, 1.0, 0.0]]))


def test_token_mask_keeps_the_unclipped_weight_below_the_cap_and_masks_above_it() -> None:
    # AReaL's decoupled PPO (behav_imp_weight_cap = 5): r = 4.9 kept at 4.9 (token IS would
    # give min(4.9, 2) = 2), r = 5 kept (<= cap), r = 5.1 masked with weight 0, r = 0.01
    # kept at 0.01 (no lower bound); off the response: weight 1, mask 0.
    prox, behav, mask = logprobs([[4.9, 5.0, 5.1, 0.01, None]])
    config = RolloutCorrectionConfig(rollout_is="token_mask")
    assert config.is_cap == 5.0
    out = off_policy_correction(prox, behav, mask, config)
    torch.testing.assert_close(out.weight, torch.tensor([[4.9, 5.0, 0.0, 0.01, 1.0]]))
    torch.testing.assert_close(out.mask, torch.tensor([[1.0, 1.0, 0.0, 1.0, 0.0]]))
    metrics = out.metrics(mask)
    assert metrics["masked_fraction"] == pytest.approx(1 / 4)
    assert metrics["is_weight_max"] == pytest.approx(5.0)


def test_token_mask_takes_an_explicit_cap_and_combines_with_rejection() -> None:
    # cap 2: 3 masked, 1.5 kept at 1.5; rollout_rs = token in [0.5, 4] rejects 0.25 too
    prox, behav, mask = logprobs([[3.0, 1.5, 0.25, 1.0]])
    config = RolloutCorrectionConfig(rollout_is="token_mask", rollout_is_threshold=2.0,
                                     rollout_rs="token", rollout_rs_threshold=4.0,
                                     rollout_rs_threshold_lower=0.5)
    out = off_policy_correction(prox, behav, mask, config)
    torch.testing.assert_close(out.weight, torch.tensor([[0.0, 1.5, 0.25, 1.0]]))
    torch.testing.assert_close(out.mask, torch.tensor([[0.0, 1.0, 0.0, 1.0]]))


def test_the_default_cap_is_verls_for_truncation_and_areals_for_the_token_mask() -> None:
    assert RolloutCorrectionConfig().is_cap == 2.0
    assert RolloutCorrectionConfig(rollout_is="sequence").is_cap == 2.0
    assert RolloutCorrectionConfig(rollout_is="token_mask").is_cap == 5.0
    assert RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=3.0).is_cap == 3.0


def test_sequence_rejection_masks_whole_sequences_by_the_product() -> None:
    prox, behav, mask = logprobs([[1.5, 1.5, None], [1.5, 0.8, None], [0.5, 0.5, 1.0]])
    params = RolloutCorrectionConfig(**NO_IS, rollout_rs="sequence", rollout_rs_threshold=2.0,
                                     rollout_rs_threshold_lower=0.5)
    out = off_policy_correction(prox, behav, mask, params)
    # row 0: 1.5 * 1.5 = 2.25 > 2 -> rejected, though each token is inside [0.5, 2]
    # row 1: 1.5 * 0.8 = 1.2 -> kept (padding stays 0)
    # row 2: 0.5 * 0.5 * 1 = 0.25 < 0.5 -> rejected
    torch.testing.assert_close(out.mask, torch.tensor([[0.0, 0, 0], [1, 1, 0], [0, 0, 0]]))


def test_geometric_rejection_uses_the_mean_log_ratio_over_the_response() -> None:
    prox, behav, mask = logprobs([[1.5, 1.5, None], [3.0, 1 / 3, None], [1.3, 1.3, None]])
    params = RolloutCorrectionConfig(**NO_IS, rollout_rs="geometric", rollout_rs_threshold=1.25,
                                     rollout_rs_threshold_lower=0.8)
    out = off_policy_correction(prox, behav, mask, params)
    # row 0: geometric mean sqrt(1.5 * 1.5) = 1.5 > 1.25 -> rejected
    # row 1: sqrt(3 * 1/3) = 1 -> kept, though each token is far from 1
    # row 2: sqrt(1.3 * 1.3) = 1.3 > 1.25 -> rejected (averaging over the padding too would
    #        give 1.3^(2/3) = 1.19 and wrongly keep it)
    torch.testing.assert_close(out.mask, torch.tensor([[0.0, 0, 0], [1, 1, 0], [0, 0, 0]]))


M2PO_LOG_RATIOS = [[0.5, 0.1, 0.0, None], [-0.1, -0.4, 0.1, None]]


def m2po_inputs() -> tuple[torch.Tensor, ...]:
    ratios = [[None if x is None else math.exp(x) for x in row] for row in M2PO_LOG_RATIOS]
    return logprobs(ratios)


def test_m2po_masks_the_largest_squared_log_ratios_until_within_tau() -> None:
    prox, behav, mask = m2po_inputs()
    out = off_policy_correction(prox, behav, mask,
                                RolloutCorrectionConfig(**NO_IS, m2po=True, m2po_tau=0.03))
    # (log r)^2 over the 6 response tokens: 0.25, 0.01, 0, 0.01, 0.16, 0.01 (sum 0.44)
    # keep all:           0.44 / 6 = 0.0733 > 0.03
    # mask 0.25 (0.5):    0.19 / 5 = 0.038  > 0.03
    # mask 0.16 (-0.4):   0.03 / 4 = 0.0075 <= 0.03 -> stop
    # (counting the 2 padding positions as zeros would stop after one: 0.19 / 7 = 0.027)
    torch.testing.assert_close(out.mask, torch.tensor([[0.0, 1, 1, 0], [1, 0, 1, 0]]))


def test_m2po_masks_nothing_when_the_second_moment_is_within_tau() -> None:
    prox, behav, mask = m2po_inputs()
    out = off_policy_correction(prox, behav, mask,
                                RolloutCorrectionConfig(**NO_IS, m2po=True, m2po_tau=0.08))
    # 0.44 / 6 = 0.0733 <= 0.08
    torch.testing.assert_close(out.mask, mask)


def test_every_rejection_mask_multiplies_into_the_mask() -> None:
    prox, behav, mask = m2po_inputs()
    params = RolloutCorrectionConfig(**NO_IS, rollout_rs="token", rollout_rs_threshold=1.2,
                                     rollout_rs_threshold_lower=0.5, m2po=True, m2po_tau=0.03)
    out = off_policy_correction(prox, behav, mask, params)
    # token RS rejects e^0.5 = 1.65 > 1.2 only; M2PO (independently) rejects 0.5 and -0.4
    torch.testing.assert_close(out.mask, torch.tensor([[0.0, 1, 1, 0], [1, 0, 1, 0]]))


def test_none_mode_gives_unit_weight_and_the_response_mask() -> None:
    prox, behav, mask = logprobs([[3.0, 0.01, None], [100.0, 1.0, 1.0]])
    out = off_policy_correction(prox, behav, mask, RolloutCorrectionConfig(**NO_IS))
    torch.testing.assert_close(out.weight, torch.ones(2, 3))
    torch.testing.assert_close(out.mask, mask)


def test_outputs_are_detached_fp32() -> None:
    prox = torch.zeros(1, 2, dtype=torch.bfloat16, requires_grad=True)
    out = off_policy_correction(prox, torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.long),
                                RolloutCorrectionConfig(rollout_rs="token", m2po=True))
    for tensor in (out.weight, out.mask, out.log_ratio):
        assert tensor.dtype == torch.float32 and not tensor.requires_grad


def test_metrics_count_only_response_tokens() -> None:
    prox, behav, mask = logprobs([[3.0, 1.5, None], [1.0, 0.25, None], [1.0, None, None],
                                  [None, None, None]])
    params = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0,
                                     rollout_rs="token", rollout_rs_threshold=2.0,
                                     rollout_rs_threshold_lower=0.5)
    metrics = off_policy_correction(prox, behav, mask, params).metrics(mask)
    # weights on the 5 response tokens: 2 (3 truncated), 1.5, 1, 0.25, 1
    assert metrics["is_weight_mean"] == pytest.approx((2 + 1.5 + 1 + 0.25 + 1) / 5)  # 1.15
    assert metrics["is_weight_max"] == pytest.approx(2.0)
    # (ln 3)^2 + (ln 1.5)^2 + 0 + (ln 4)^2 + 0 over 5 tokens
    assert metrics["log_ratio_m2"] == pytest.approx((LN(3) ** 2 + LN(1.5) ** 2 + LN(4) ** 2) / 5)
    # rejected: r = 3 and r = 0.25 -> 2 of 5 tokens, in 2 of the 3 non-empty sequences
    assert metrics["masked_fraction"] == pytest.approx(0.4)
    assert metrics["seq_masked_fraction"] == pytest.approx(2 / 3)


def test_metrics_of_an_empty_response_are_zero() -> None:
    out = off_policy_correction(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2),
                                RolloutCorrectionConfig())
    assert set(out.metrics(torch.zeros(1, 2)).values()) == {0.0}


@pytest.mark.parametrize(("key", "value"), [
    ("rollout_is_threshold", 0.0),
    ("rollout_rs_threshold", -1.0),
    ("rollout_rs_threshold_lower", -0.5),
    ("m2po_tau", 0.0),
    ("rollout_is", "seq"),
    ("rollout_rs", "geo"),
])
def test_invalid_values_are_refused_when_decoded_naming_the_key(key: str, value: object) -> None:
    with pytest.raises(msgspec.ValidationError, match=f"`\\$.{key}`"):
        msgspec.convert({key: value}, RolloutCorrectionConfig)


def a3po(versions: list[int], proximal_version: int, current_version: int) -> torch.Tensor:
    # behavior log-probs -2, current -1 on the response; off the response (-1) behavior -7
    behavior = torch.tensor([[-7.0 if v < 0 else -2.0 for v in versions]])
    current = torch.tensor([[-3.0 if v < 0 else -1.0 for v in versions]], requires_grad=True)
    mask = torch.tensor([[0.0 if v < 0 else 1.0 for v in versions]])
    return a3po_proximal_logprobs(behavior, current, torch.tensor([versions]),
                                  proximal_version, current_version, mask)


def test_a3po_interpolates_log_linearly_by_version() -> None:
    result = a3po([3, 1, 4, -1], proximal_version=4, current_version=5)
    # v_b = 3: alpha = (4 - 3) / (5 - 3) = 0.5  -> -2 + 0.5 * (-1 + 2) = -1.5
    # v_b = 1: alpha = (4 - 1) / (5 - 1) = 0.75 -> -2 + 0.75 = -1.25
    # v_b = 4: alpha = 0 / 1 = 0 (the proximal weights sampled it) -> -2
    # off the response: the behavior log-prob -7
    torch.testing.assert_close(result, torch.tensor([[-1.5, -1.25, -2.0, -7.0]]))
    assert result.dtype == torch.float32 and not result.requires_grad


def test_a3po_equal_versions_use_the_current_logprobs() -> None:
    # v_b = 5 = current version (alpha would be 0/0), and v_b = 6 past it: current -1
    torch.testing.assert_close(a3po([5, 6], proximal_version=4, current_version=5),
                               torch.tensor([[-1.0, -1.0]]))
    # proximal = current = behavior version: the current log-prob too
    torch.testing.assert_close(a3po([5], proximal_version=5, current_version=5),
                               torch.tensor([[-1.0]]))


def test_a3po_alpha_is_clamped_to_the_unit_interval() -> None:
    # v_b = 3, proximal 2, current 5: alpha = (2 - 3) / (5 - 3) = -0.5 -> 0 -> behavior -2
    torch.testing.assert_close(a3po([3], proximal_version=2, current_version=5),
                               torch.tensor([[-2.0]]))


def test_a3po_rejects_a_proximal_version_after_the_current_one() -> None:
    with pytest.raises(ValueError, match="proximal_version"):
        a3po([3], proximal_version=6, current_version=5)
