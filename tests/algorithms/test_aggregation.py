"""Loss aggregation modes against hand-computed values, and micro-batch invariance."""

import pytest
import torch

from relay.algorithms.aggregation import LOSS_AGG_MODES, aggregate_loss, masked_mean

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", (6 + 4) / 4),
    ("seq-mean-token-sum", (6 + 4) / 2),
    ("seq-mean-token-mean", (6 / 3 + 4 / 1) / 2),
    ("seq-mean-token-sum-norm", (6 + 4) / (2 * 3)),
])
def test_modes(mode: str, expected: float) -> None:
    assert aggregate_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode, expected", [
    ("seq-mean-token-sum", 6 / 1),
    ("seq-mean-token-mean", (6 / 3) / 1),
    ("seq-mean-token-sum-norm", 6 / (1 * 3)),
])
def test_rows_without_response_tokens_are_not_sequences(mode: str, expected: float) -> None:
    # row 1 has no response token: B = 1, not 2
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]])
    assert aggregate_loss(LOSS, mask, mode).item() == pytest.approx(expected)


def test_seq_mean_token_sum_norm_divides_by_sequences_and_horizon_not_verls_horizon_only() -> None:
    # Relay (Dr.GRPO paper, TRL): sum / (B * L) = 10 / (2 * 3); verl's agg_loss: sum / L =
    # 10 / 3 (before its per-micro-batch gradient-accumulation scaling). See the module
    # docstring for why Relay keeps B * L.
    got = aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm").item()
    assert got == pytest.approx(10 / 6)
    assert got != pytest.approx(10 / 3)


def test_horizon_is_a_constant_for_dr_grpo() -> None:
    got = aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", horizon=10)
    assert got.item() == pytest.approx(10 / 20)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_with_global_counts_sum_to_the_full_batch(mode: str) -> None:
    full = aggregate_loss(LOSS, MASK, mode)
    parts = sum(aggregate_loss(LOSS[i:i + 1], MASK[i:i + 1], mode, num_tokens=4, num_seqs=2,
                               horizon=3) for i in range(2))
    assert parts.item() == pytest.approx(full.item())


KEPT = torch.tensor([[1, 0, 1], [1, 0, 0]])  # row 0's middle token rejected


@pytest.mark.parametrize("mode, expected, verl_counts, old_lengths", [
    # AReaL's token count: the 4 response tokens, not the 3 kept (verl: 8 / 3)
    ("token-mean", (1 + 3 + 4) / 4, (1 + 3 + 4) / 3, None),
    ("seq-mean-token-sum", (4 + 4) / 2, None, None),
    # verl's per-sequence mean over the kept tokens, 4 / 2; over the response's 3 tokens
    # (the convention before issue 30) row 0 would count 4 / 3
    ("seq-mean-token-mean", ((1 + 3) / 2 + 4 / 1) / 2, None, (4 / 3 + 4 / 1) / 2),
    ("seq-mean-token-sum-norm", (4 + 4) / (2 * 3), None, None),
])
def test_kept_tokens_are_averaged_per_sequence_but_counted_as_the_response(
        mode: str, expected: float, verl_counts: float | None,
        old_lengths: float | None) -> None:
    got = aggregate_loss(LOSS, KEPT, mode, num_tokens=4, num_seqs=2).item()
    assert got == pytest.approx(expected)
    if verl_counts is not None:  # the kept mask's own counts: verl's
        assert aggregate_loss(LOSS, KEPT, mode).item() == pytest.approx(verl_counts)
    if old_lengths is not None:
        assert got != pytest.approx(old_lengths)


def test_a_wholly_rejected_sequence_still_counts_as_a_sequence() -> None:
    # row 1 rejected: B stays 2 (verl would take 1 and double row 0's weight)
    kept = torch.tensor([[1, 1, 1], [0, 0, 0]])
    got = aggregate_loss(LOSS, kept, "seq-mean-token-mean", num_tokens=4, num_seqs=2).item()
    assert got == pytest.approx((6 / 3 + 0) / 2)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_of_kept_tokens_with_the_responses_counts_sum_to_the_batch(
        mode: str) -> None:
    full = aggregate_loss(LOSS, KEPT, mode, num_tokens=4, num_seqs=2)
    parts = sum(aggregate_loss(LOSS[i:i + 1], KEPT[i:i + 1], mode, num_tokens=4, num_seqs=2,
                               horizon=3) for i in range(2))
    assert parts.item() == pytest.approx(full.item())


def test_unknown_mode_is_named() -> None:
    with pytest.raises(ValueError, match="'mean'"):
        aggregate_loss(LOSS, MASK, "mean")  # type: ignore[arg-type]


def test_masked_mean() -> None:
    assert masked_mean(LOSS, MASK).item() == pytest.approx(2.5)
    assert masked_mean(LOSS, torch.zeros_like(MASK)).item() == 0.0
