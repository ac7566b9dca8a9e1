"""PF-PPO per prompt group: which samples each mode keeps, and that choices are seeded."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from relay.buffer.pf_ppo import PolicyFiltration, kept_indices
from relay.transport.messages import Prompt

from .conftest import make_group

REWARDS = [0.2, 0.9, 0.1, 0.5]  # best: 1, worst: 2


class LastChoice(random.Random):
    """An rng whose 'random' pick is the last candidate, to hand-compute best_random."""

    def choice(self, seq: Sequence):  # type: ignore[override]
        return seq[-1]


@pytest.mark.parametrize(("mode", "expected"), [
    ("best", [1]),
    ("best_worst", [1, 2]),
    ("best_random", [1, 3]),  # the candidates are 0, 2, 3; LastChoice takes 3
])
def test_each_mode_keeps_exactly_its_samples(mode: str, expected: list[int]) -> None:
    assert kept_indices(REWARDS, mode, LastChoice()) == expected


def test_ties_go_to_the_lowest_index_and_best_worst_keeps_two_samples() -> None:
    assert kept_indices([1.0, 1.0, 0.0, 0.0], "best_worst", LastChoice()) == [0, 2]
    assert kept_indices([0.5, 0.5, 0.5], "best_worst", LastChoice()) == [0, 1]
    assert kept_indices([0.5, 0.5, 0.5], "best_random", LastChoice()) == [0, 2]
    assert kept_indices([0.3], "best_worst", LastChoice()) == [0]


def test_random_partner_is_never_the_best_and_covers_the_others() -> None:
    partners = set()
    for seed in range(200):
        best, *rest = kept_indices(REWARDS, "best_random", random.Random(seed))
        assert best == 1 or rest == [1]
        partners.update(i for i in (best, *rest) if i != 1)
    assert partners == {0, 2, 3}


def group(rollout_id: str, rewards: list[float]):
    prompt = Prompt(prompt_id=rollout_id, messages=[], data_source="d")
    return make_group("L1", prompt, len(rewards), rewards=rewards)


def test_filtered_group_keeps_its_rollout_id_and_sample_objects() -> None:
    original = group("p7", REWARDS)
    kept = PolicyFiltration("best_worst", seed=0)(original)
    assert kept.rollout_id == original.rollout_id == "L1/p7"
    assert kept.samples == [original.samples[1], original.samples[2]]
    assert kept.samples[0] is original.samples[1]
    assert len(original.samples) == 4  # the received group itself is untouched


def test_random_choice_depends_on_seed_and_rollout_id_only() -> None:
    ids = [f"p{i}" for i in range(40)]

    def choices(seed: int, order: list[str]) -> dict[str, list[float]]:
        pf = PolicyFiltration("best_random", seed=seed)
        return {i: [s.reward for s in pf(group(i, REWARDS)).samples] for i in order}

    first = choices(0, ids)
    assert first == choices(0, list(reversed(ids)))  # arrival order does not matter
    assert first != choices(1, ids)  # the seed does
    assert len({tuple(v) for v in first.values()}) == 3  # best + each of the 3 others
