"""Prioritized replay: priorities, probabilities and importance weights against hand-computed
numbers; reuse, age eviction and the learner's TD-error priorities; the hub's wiring."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from buffer.prioritized import (
    PrioritizedStore,
    advantage_priority,
    importance_weights,
    pass_rate_priority,
    sampling_probabilities,
)
from configs.run_schema import ReplayConfig
from transport.messages import ErrorReply, Prompt, SampleBatch, SampleRequest

from .conftest import make_group
from .test_hub import lease


def group(name: str, rewards: list[float], version: int = 0):
    prompt = Prompt(prompt_id=name, messages=[], data_source="test")
    return make_group("lease", prompt, len(rewards), version, rewards=rewards)


def store(priority: str = "uniform", **overrides: float) -> PrioritizedStore:
    settings = dict(alpha=1.0, beta=1.0, epsilon=1e-3, max_reuse=1, max_age=10,
                    pass_threshold=0.5, seed=0)
    settings.update(overrides)
    return PrioritizedStore(ReplayConfig(priority=priority, **settings), max_staleness=10)


def test_advantage_priority_is_the_mean_absolute_centered_reward() -> None:
    # mean 0.25: |0.75| + 3 * |-0.25| = 1.5, over 4
    assert advantage_priority([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.375)
    assert advantage_priority([1.0, 1.0]) == 0.0


def test_pass_rate_priority_peaks_at_half() -> None:
    assert pass_rate_priority([1.0, 0.0, 0.0, 0.0], 0.5) == pytest.approx(4 * 0.25 * 0.75)
    assert pass_rate_priority([1.0, 0.0], 0.5) == pytest.approx(1.0)
    assert pass_rate_priority([1.0, 1.0, 1.0], 0.5) == 0.0
    assert pass_rate_priority([0.4, 0.4, 1.0, 1.0], 0.5) == pytest.approx(1.0)  # 0.4 fails


def test_sampling_probabilities_by_hand() -> None:
    # (p + 1)^0.5 = 1, sqrt 2, 2; their sum is 3 + sqrt 2
    probabilities = sampling_probabilities(torch.tensor([0.0, 1.0, 3.0]), alpha=0.5, epsilon=1.0)
    total = 3 + math.sqrt(2)
    torch.testing.assert_close(probabilities, torch.tensor([1 / total, math.sqrt(2) / total,
                                                            2 / total], dtype=torch.float64))
    uniform = sampling_probabilities(torch.tensor([0.0, 5.0]), alpha=0.0, epsilon=1e-3)
    torch.testing.assert_close(uniform, torch.tensor([0.5, 0.5], dtype=torch.float64))


def test_importance_weights_by_hand() -> None:
    # drawn P = 0.5, 0.25 from a store of 3: N P = 1.5, 0.75; beta 1 inverts them: 2/3, 4/3;
    # over the batch's largest, 4/3
    drawn = torch.tensor([0.5, 0.25], dtype=torch.float64)
    weights = importance_weights(drawn, store_size=3, beta=1.0)
    torch.testing.assert_close(weights, torch.tensor([0.5, 1.0], dtype=torch.float64))
    half = importance_weights(drawn, store_size=3, beta=0.5)  # square roots of those ratios
    torch.testing.assert_close(half, torch.tensor([math.sqrt(0.5), 1.0], dtype=torch.float64))
    flat = importance_weights(drawn, store_size=3, beta=0.0)  # no correction
    torch.testing.assert_close(flat, torch.tensor([1.0, 1.0], dtype=torch.float64))


def test_draws_follow_the_priorities_and_carry_their_weights() -> None:
    replay = store("advantage", max_reuse=10_000, epsilon=1e-6)
    replay.add(group("signal", [1.0, 0.0]))  # priority 0.5
    replay.add(group("flat", [1.0, 1.0]))  # priority 0: drawn with probability ~2e-6
    counts: Counter[str] = Counter()
    for _ in range(200):
        taken = replay.take(1, learner_version=0, max_staleness=10)
        counts[taken.groups[0].prompt_id] += 1
    assert counts["signal"] == 200
    taken = replay.take(2, learner_version=0, max_staleness=10)
    assert sorted(g.prompt_id for g in taken.groups) == ["flat", "signal"]
    by_name = dict(zip((g.prompt_id for g in taken.groups), taken.weights))
    # beta 1: N P(flat) ~ 4e-6 gives the batch's largest weight (1); N P(signal) ~ 2, 2e-6
    assert by_name["flat"] == pytest.approx(1.0)
    assert by_name["signal"] == pytest.approx(2e-6, rel=1e-2)


def test_draws_are_reproducible_by_seed() -> None:
    def draws(seed: int) -> list[str]:
        replay = store("uniform", max_reuse=100, seed=seed)
        for i in range(8):
            replay.add(group(f"p{i}", [1.0, 0.0]))
        return [g.prompt_id for _ in range(10) for g in replay.take(3, 0, 10).groups]
    assert draws(1) == draws(1)
    assert draws(1) != draws(2)


def test_a_group_is_trained_at_most_max_reuse_times() -> None:
    replay = store("uniform", max_reuse=3)
    replay.add(group("only", [1.0, 0.0]))
    for _ in range(3):
        assert [g.prompt_id for g in replay.take(1, 0, 10).groups] == ["only"]
    assert len(replay) == 0 and replay.take(1, 0, 10).groups == []
    stats = replay.stats()
    assert stats["replay/draws"] == 3 and stats["replay/redraws"] == 2
    assert stats["replay/retired_max_reuse"] == 1


def test_eviction_by_age_reports_only_groups_never_trained_on() -> None:
    replay = store("uniform", max_reuse=5, max_age=1)
    replay.add(group("used", [1.0, 0.0], version=0))
    assert replay.take(1, learner_version=0, max_staleness=3).groups[0].prompt_id == "used"
    replay.add(group("unused", [1.0, 0.0], version=0))
    replay.add(group("fresh", [1.0, 0.0], version=2))
    taken = replay.take(1, learner_version=2, max_staleness=3)  # max_age 1 < max_staleness
    assert [g.prompt_id for g in taken.dropped_stale] == ["unused"]
    assert [g.prompt_id for g in taken.groups] == ["fresh"]
    assert replay.stats()["replay/evicted_after_use"] == 1


def test_td_error_priorities_start_at_the_max_and_follow_the_learner() -> None:
    replay = store("td_error", max_reuse=100, epsilon=1e-6)
    first, second = group("a", [1.0, 0.0]), group("b", [1.0, 0.0])
    replay.add(first)
    replay.update_priorities({first.rollout_id: 4.0, "gone/already": 9.0})
    replay.add(second)  # new: the largest priority seen so far, 9
    assert replay.initial_priority(second) == 9.0
    replay.update_priorities({first.rollout_id: 0.0})
    assert {g.prompt_id for _ in range(50) for g in replay.take(1, 0, 10).groups} == {"b"}
    with pytest.raises(ValueError, match="priority of a/b must be >= 0, got nan"):
        replay.update_priorities({"a/b": float("nan")})


def test_unknown_priority_is_refused() -> None:
    for priority in ("loss", "fifo"):
        with pytest.raises(ValueError, match=f"buffer.replay.priority = '{priority}' is not"):
            store(priority)


def test_max_age_defaults_to_the_staleness_bound() -> None:
    assert PrioritizedStore(ReplayConfig(priority="uniform"), max_staleness=3).max_age == 3
    assert PrioritizedStore(ReplayConfig(priority="uniform", max_age=1),
                            max_staleness=3).max_age == 1


def test_hub_serves_weights_takes_priorities_and_reports_the_store(make_hub) -> None:
    replay = store("td_error", max_reuse=2)
    hub = make_hub(batch_size=2, n=2, per_lease=2, max_staleness=0, store=replay)
    granted = lease(hub)
    for prompt in granted.prompts:
        assert hub.handle(make_group(granted.lease_id, prompt, 2, rewards=[1.0, 0.0])).accepted
    batch = hub.handle(SampleRequest(num_groups=2))
    assert isinstance(batch, SampleBatch) and len(batch.groups) == 2
    assert batch.weights == [1.0, 1.0]  # equal priorities: uniform
    ids = [g.rollout_id for g in batch.groups]
    again = hub.handle(SampleRequest(num_groups=1, priorities={ids[0]: 3.0, ids[1]: 1.0}))
    assert isinstance(again, SampleBatch) and len(again.groups) == 1
    assert again.buffer_stats["buffer/replay/redraws"] == 1.0
    assert again.buffer_stats["buffer/replay/priority_mean"] in (3.0, 1.0)
    served = hub.counts["groups/served"]
    refused = hub.handle(SampleRequest(num_groups=1, priorities={ids[0]: -1.0}))
    assert isinstance(refused, ErrorReply) and refused.code == "bad_priorities"
    assert f"priority of {ids[0]} must be >= 0" in refused.detail
    assert hub.counts["groups/served"] == served  # refused whole: no batch either
    assert hub.counts["rejected/malformed"] == 0  # no rollout was refused
