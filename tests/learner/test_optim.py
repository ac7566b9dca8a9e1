"""The learning-rate schedules (transformers' own), against hand-computed rates."""

import math

import pytest
import torch

from configs.run_schema import OptimConfig
from learner.optim import build_scheduler


def rates(optim: OptimConfig, total_steps: int, steps: int) -> list[float]:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=optim.lr)
    scheduler = build_scheduler(optimizer, total_steps=total_steps, optim=optim)
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return out


def test_constant_after_a_linear_warm_up_from_zero_as_verl() -> None:
    assert rates(OptimConfig(lr=1.0, lr_warmup_steps=4), 10, 6) == \
        pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0, 1.0])


def test_warm_up_ratio_counts_steps_of_the_run() -> None:
    # -1 steps: 0.2 of 10 = 2 warm-up steps
    assert rates(OptimConfig(lr=1.0, lr_warmup_steps_ratio=0.2), 10, 3) == \
        pytest.approx([0.0, 0.5, 1.0])


def test_cosine_decays_to_the_min_lr_ratio_at_the_last_step() -> None:
    optim = OptimConfig(lr=2.0, lr_warmup_steps=2, warmup_style="cosine", min_lr_ratio=0.1)
    got = rates(optim, 10, 11)
    # s >= 2: 2 * (0.1 + 0.9 * (1 + cos(pi * (s - 2) / 8)) / 2)
    expected = [0.0, 1.0] + [2 * (0.1 + 0.9 * (1 + math.cos(math.pi * (s - 2) / 8)) / 2)
                             for s in range(2, 11)]
    assert got == pytest.approx(expected)
    assert got[-1] == pytest.approx(0.2)
