"""DAPO's overlong penalty against hand-computed values."""

import pytest
import torch

from relay.algorithms.reward_shaping import overlong_penalty


def test_overlong_penalty_ramp() -> None:
    got = overlong_penalty(torch.tensor([10, 16, 18, 20, 21]), max_length=20, buffer_length=4,
                           penalty_factor=1.0)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))


def test_overlong_penalty_factor_scales() -> None:
    got = overlong_penalty(torch.tensor([18]), max_length=20, buffer_length=4, penalty_factor=2.0)
    torch.testing.assert_close(got, torch.tensor([-1.0]))


def test_bad_buffer_is_refused() -> None:
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(torch.tensor([1]), max_length=4, buffer_length=5)
