"""Token log-probs and entropy against hand-computed values."""

import math

import pytest
import torch

from algorithms.logprobs import entropy_from_logits, token_logprobs


def test_token_logprobs_with_temperature() -> None:
    logits = torch.tensor([[0.0, math.log(3.0)]])
    assert token_logprobs(logits, torch.tensor([1])).item() == pytest.approx(math.log(0.75))
    p = math.sqrt(3) / (1 + math.sqrt(3))  # softmax([0, ln3 / 2])[1]
    got = token_logprobs(logits, torch.tensor([1]), temperature=2.0).item()
    assert got == pytest.approx(math.log(p), rel=1e-6)


def test_entropy() -> None:
    got = entropy_from_logits(torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)]]))
    expected = [math.log(2), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]
    torch.testing.assert_close(got, torch.tensor(expected))


def test_bf16_logits_are_computed_in_fp32() -> None:
    logits = torch.randn(3, 7, dtype=torch.bfloat16)
    assert token_logprobs(logits, torch.tensor([0, 1, 2])).dtype == torch.float32
