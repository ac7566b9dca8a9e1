"""The critic's clipped value loss against hand-computed numbers."""

from __future__ import annotations

import pytest
import torch

from relay.algorithms.value_loss import clipped_value_loss


def test_clipped_value_loss_takes_the_larger_error() -> None:
    values = torch.tensor([[1.0, 0.0, 2.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 1.0]])
    returns = torch.tensor([[2.0, 1.0, 0.0]])
    terms = clipped_value_loss(values, old, returns, cliprange_value=0.5)
    # token 0: V=1, V_clip=0+clip(1,-.5,.5)=0.5; errors (1-2)^2=1, (0.5-2)^2=2.25 -> 0.5*2.25
    # token 1: V=0=V_old: both errors (0-1)^2=1 -> 0.5
    # token 2: V=2, V_clip=1.5; errors (2-0)^2=4, (1.5-0)^2=2.25 -> 0.5*4 = 2
    torch.testing.assert_close(terms.loss, torch.tensor([[1.125, 0.5, 2.0]]))
    assert terms.clipped.tolist() == [[True, False, False]]
    (grad,) = torch.autograd.grad(terms.loss.sum(), values)
    # token 0 takes the clipped branch, whose V_clip is flat in V: gradient 0
    # token 1: d/dV 0.5 (V-1)^2 = V - 1 = -1;  token 2: V - 0 = 2
    torch.testing.assert_close(grad, torch.tensor([[0.0, -1.0, 2.0]]))


def test_cliprange_must_be_positive() -> None:
    with pytest.raises(ValueError, match="cliprange_value"):
        clipped_value_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), 0.0)
