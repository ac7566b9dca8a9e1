"""PRIME's implicit process rewards, PRM loss and leave-one-out advantages, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from relay.algorithms.prime import (
    implicit_prm_loss,
    implicit_process_rewards,
    last_token_mask,
    leave_one_out,
    prime_advantages,
)

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


def test_process_rewards_are_beta_times_the_log_ratio_but_not_on_the_last_token() -> None:
    # beta * q on the response, except each row's last response token (row 0: t1, row 1: t2),
    # as verl's prime_dp_rm: row 0 [0.1 * 0.5, (last: 0), pad], row 1 [0, 0.1 * 1, (last: 0)]
    prm = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, -1.0], [-0.5, -1.5, 0.0]])
    rewards = implicit_process_rewards(prm, ref, MASK, beta=0.1)
    torch.testing.assert_close(rewards, torch.tensor([[0.05, 0.0, 0.0], [0.0, 0.1, 0.0]]))


def test_prm_loss_is_the_bce_of_the_summed_implicit_reward() -> None:
    prm = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -1.0], [-0.5, -1.5, 0.0]])
    # beta * sum q: 0.5 * (0.5 - 1) = -0.25;  0.5 * (0 + 1 - 0.5) = 0.25
    loss = implicit_prm_loss(prm, ref, MASK, torch.tensor([1.0, 0.0]), beta=0.5)
    sigmoid = 1 / (1 + math.exp(-0.25))
    # label 1 at logit -0.25: -log sigmoid(-0.25); label 0 at 0.25: -log(1 - sigmoid(0.25))
    expected = [-math.log(1 - sigmoid), -math.log(1 - sigmoid)]
    torch.testing.assert_close(loss, torch.tensor(expected))
    loss.sum().backward()
    assert prm.grad[0, 2] == 0.0 and prm.grad[0, 0] < 0  # label 1: push log pi_phi up
    assert prm.grad[1, 0] > 0  # label 0: push it down


def test_prm_loss_refuses_labels_outside_zero_one() -> None:
    with pytest.raises(ValueError, match=r"outcome labels in \[0, 1\]; got rewards \[-1.0, 1.0\]"):
        implicit_prm_loss(torch.zeros(2, 3), torch.zeros(2, 3), MASK, torch.tensor([-1.0, 1.0]),
                          beta=0.05)


def test_leave_one_out_by_hand() -> None:
    # one group of K = 2; per-sample means over the mask: 3 and 2; sum 5
    values = torch.tensor([[2.0, 4.0, 7.0], [1.0, 2.0, 3.0]])
    out = leave_one_out(values, MASK, torch.tensor([0, 0]))
    # x * 2 / 1 - 5 / 1
    expected = torch.tensor([[-1.0, 3.0, 0.0], [-3.0, -1.0, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match="at least 2 samples per prompt"):
        leave_one_out(values, MASK, torch.tensor([0, 1]))


def test_last_token_mask() -> None:
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert last_token_mask(mask).tolist() == [[0, 0, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]


def test_outcome_only_advantages_are_whitened_rloo_returns() -> None:
    # K = 3, outcome rewards 1, 0, 0: RLOO r_i - mean of the others = 1, -0.5, -0.5
    mask = torch.ones(3, 2)
    advantages, returns = prime_advantages(torch.zeros(3, 2), torch.tensor([1.0, 0.0, 0.0]),
                                           mask, torch.tensor([0, 0, 0]), reward_dpo_coef=0.0,
                                           reward_gt_coef=2.0)
    # the outcome sits on the last token, so the return is the same at both tokens
    torch.testing.assert_close(returns, torch.tensor([[2.0, 2.0], [-1.0, -1.0], [-1.0, -1.0]]))
    flat = returns.flatten().double()
    expected = (flat - flat.mean()) / torch.sqrt(flat.var() + 1e-8)
    torch.testing.assert_close(advantages.flatten(), expected.float())


def test_process_rewards_enter_as_reverse_cumulative_sums() -> None:
    process = torch.tensor([[2.0, 4.0, 0.0], [1.0, 2.0, 3.0]])
    _, returns = prime_advantages(process, torch.zeros(2), MASK, torch.tensor([0, 0]),
                                  reward_dpo_coef=0.5, reward_gt_coef=1.0)
    # loo: [[-1, 3, 0], [-3, -1, 1]] times 0.5, then summed from each token to the end
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.5, 0.0], [-1.5, 0.0, 0.5]]))
