"""GRPO / Dr.GRPO advantages against hand-computed values."""

import math

import torch

from algorithms.advantages import grpo_advantages


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
