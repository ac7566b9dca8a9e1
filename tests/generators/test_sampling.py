"""The processed sampling distribution (temperature, top-k, top-p) against hand values, and
the behavior log-prob: the temperature-only one, whatever the filters."""

import math

import pytest
import torch

from relay.generators.sampling import SamplingParams, draw, processed_logprobs, sample_next

LOGITS = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]])


def probs(**kwargs) -> list[float]:
    params = SamplingParams(max_new_tokens=1, **kwargs)
    return processed_logprobs(LOGITS, params).exp()[0].tolist()


def test_plain_softmax() -> None:
    assert probs() == pytest.approx([0.5, 0.3, 0.15, 0.05])


def test_temperature_two_flattens() -> None:
    root = [math.sqrt(p) for p in (0.5, 0.3, 0.15, 0.05)]
    assert probs(temperature=2.0) == pytest.approx([r / sum(root) for r in root])


def test_top_k_renormalizes_the_k_best() -> None:
    assert probs(top_k=2) == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    # cumulative 0.5, 0.8, 0.95: p = 0.75 needs the first two tokens
    assert probs(top_p=0.75) == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])
    assert probs(top_p=0.4) == pytest.approx([1.0, 0.0, 0.0, 0.0])


@pytest.mark.parametrize("filters", [dict(top_k=2), dict(top_p=0.75), dict(top_k=3, top_p=0.75)])
def test_sampled_logprob_is_the_temperature_only_one_under_filters(filters: dict) -> None:
    """Drawn from the filtered distribution (tokens 0 and 1 only), recorded as
    log softmax(logits)[token]: log 0.5 and log 0.3, not log(0.5 / 0.8) and log(0.3 / 0.8)."""
    params = SamplingParams(max_new_tokens=1, **filters)
    tokens, logprobs = sample_next(LOGITS.repeat(200, 1), params, torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {0, 1}
    expected = torch.where(tokens == 0, math.log(0.5), math.log(0.3))
    torch.testing.assert_close(logprobs, expected.float())
    assert logprobs.dtype == torch.float32


def test_sampled_logprob_applies_the_temperature() -> None:
    params = SamplingParams(max_new_tokens=1, temperature=2.0, top_p=0.5)
    tokens, logprobs = sample_next(LOGITS.repeat(50, 1), params, torch.Generator().manual_seed(0))
    root = [math.sqrt(p) for p in (0.5, 0.3, 0.15, 0.05)]
    assert set(tokens.tolist()) == {0, 1}  # the flattened 0.33, 0.26 reach 0.5 together
    expected = torch.tensor([math.log(root[t] / sum(root)) for t in tokens.tolist()])
    torch.testing.assert_close(logprobs, expected)


def test_greedy_takes_the_argmax_with_logprob_zero() -> None:
    tokens, logprobs = sample_next(LOGITS, SamplingParams(max_new_tokens=1, temperature=0.0))
    assert tokens.tolist() == [0] and logprobs.tolist() == [0.0]


def test_draws_follow_the_processed_distribution() -> None:
    """40,000 draws by inverse CDF: a chi-square test against the processed probabilities
    (df = 2 after top-p drops the last token; 13.8 is the 0.1% critical value), and a token
    of probability 0 is never drawn."""
    params = SamplingParams(max_new_tokens=1, temperature=1.3, top_p=0.9)
    expected = processed_logprobs(LOGITS, params).exp()[0]
    assert expected[3] == 0
    tokens, _ = sample_next(LOGITS.repeat(40_000, 1), params, torch.Generator().manual_seed(1))
    counts = torch.bincount(tokens, minlength=4).float()
    assert counts[3] == 0
    kept = expected > 0
    chi2 = ((counts[kept] - 40_000 * expected[kept]) ** 2 / (40_000 * expected[kept])).sum()
    assert chi2 < 13.8


def test_a_point_mass_in_the_middle_is_always_drawn() -> None:
    logprobs = torch.full((1000, 5), float("-inf"))
    logprobs[:, 2] = 0.0
    assert set(draw(logprobs, torch.Generator().manual_seed(0)).tolist()) == {2}
