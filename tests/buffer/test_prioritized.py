"""Prioritized replay: priorities, probabilities and importance weights against hand-computed
numbers, beta's annealing; reuse, age eviction and the learner's TD-error priorities
(refused whole when one is bad); the hub's wiring, and where evicted prompts go."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from relay.buffer.prioritized import (
    PrioritizedStore,
    advantage_priority,
    annealed_beta,
    importance_weights,
    pass_rate_priority,
    sampling_probabilities,
)
from relay.buffer.store import PriorityError, Taken
from relay.configs.run_schema import ReplayConfig
from relay.transport.messages import ErrorReply, Prompt, SampleBatch, SampleRequest, VersionUpdate

from .conftest import TOTAL_STEPS, make_group
from .test_hub import lease


def group(name: str, rewards: list[float], version: int = 0):
    prompt = Prompt(prompt_id=name, messages=[], data_source="test")
    return make_group("lease", prompt, len(rewards), version, rewards=rewards)


def store(priority: str = "uniform", **overrides: float) -> PrioritizedStore:
    settings = dict(alpha=1.0, beta=1.0, beta_final=1.0, epsilon=1e-3, max_reuse=1,
                    max_age=10, pass_threshold=0.5, seed=0)
    settings.update(overrides)
    return PrioritizedStore(ReplayConfig(priority=priority, **settings), max_staleness=10)


def take(replay: PrioritizedStore, num_groups: int, learner_version: int = 0,
         max_staleness: int = 10, run_fraction: float = 0.0) -> Taken:
    return replay.take(num_groups, learner_version, max_staleness, run_fraction=run_fraction)


def test_advantage_priority_is_the_mean_absolute_centered_reward() -> None:
    # mean 0.25: |0.75| + 3 * |-0.25| = 1.5, over 4
    assert advantage_priority([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.375)
    assert advantage_priority([1.0, 1.0]) == 0.0
    assert advantage_priority([0.1] * 8) == 0.0  # although sum([0.1] * 8) / 8 != 0.1


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


def test_sampling_probabilities_of_huge_priorities_stay_finite() -> None:
    # (1e308 + eps)^1 summed twice overflowed to inf: P was inf / inf = NaN
    probabilities = sampling_probabilities(torch.tensor([1e308, 1e308, 0.0], dtype=torch.float64),
                                           alpha=1.0, epsilon=1e-3)
    torch.testing.assert_close(probabilities, torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64))


def test_importance_weights_by_hand() -> None:
    # drawn P = 0.5, 0.25 (priority > 0) and 0.05 (priority 0). N cancels: (N P_i)^-beta /
    # (N P_ref)^-beta = (P_ref / P_i)^beta, P_ref = 0.25, the least likely group with
    # priority > 0: beta 1 gives 0.5 and 1; the zero-priority group's 5 is capped at 1
    drawn = torch.tensor([0.5, 0.25, 0.05], dtype=torch.float64)
    signal = torch.tensor([True, True, False])
    weights = importance_weights(drawn, signal, beta=1.0)
    torch.testing.assert_close(weights, torch.tensor([0.5, 1.0, 1.0], dtype=torch.float64))
    half = importance_weights(drawn, signal, beta=0.5)  # square roots of those ratios
    torch.testing.assert_close(half, torch.tensor([math.sqrt(0.5), 1.0, 1.0],
                                                  dtype=torch.float64))
    flat = importance_weights(drawn, signal, beta=0.0)  # no correction
    torch.testing.assert_close(flat, torch.ones(3, dtype=torch.float64))
    # no group with priority > 0: the least likely of all is the reference, 0.05 / P
    none = importance_weights(drawn, torch.zeros(3, dtype=torch.bool), beta=1.0)
    torch.testing.assert_close(none, torch.tensor([0.1, 0.2, 1.0], dtype=torch.float64))


def test_beta_anneals_linearly_to_beta_final_over_the_run() -> None:
    assert annealed_beta(0.4, 1.0, 0.0) == 0.4
    assert annealed_beta(0.4, 1.0, 0.5) == pytest.approx(0.7)
    assert annealed_beta(0.4, 1.0, 1.0) == pytest.approx(1.0)
    assert annealed_beta(0.4, 1.0, 2.0) == pytest.approx(1.0)  # never past beta_final
    assert annealed_beta(0.4, 1.0, -1.0) == 0.4
    assert annealed_beta(0.5, 0.5, 0.3) == 0.5  # equal: constant


def pass_rate_batch(run_fraction: float) -> dict[str, float]:
    """The defaults (alpha 0.6, beta 0.4 to 1, epsilon 1e-3) by pass rate, a store of three
    groups drawn whole: priorities 1 (half pass), 0.75 (a quarter) and 0 (all pass)."""
    replay = store("pass_rate", alpha=0.6, beta=0.4, beta_final=1.0, epsilon=1e-3)
    replay.add(group("half", [1.0, 0.0, 1.0, 0.0]))
    replay.add(group("quarter", [1.0, 0.0, 0.0, 0.0]))
    replay.add(group("all", [1.0, 1.0, 1.0, 1.0]))
    taken = take(replay, 3, run_fraction=run_fraction)
    return dict(zip((g.prompt_id for g in taken.groups), taken.weights))


def test_a_zero_priority_group_does_not_shrink_the_others() -> None:
    """The batch's largest weight was the zero-priority group's: it scaled the others by
    ((1e-3 / 1.001)^0.6)^0.4 = 0.19 at the defaults. Now the least likely group with
    priority > 0 (P ~ 0.751^0.6) is the reference: w = (P_quarter / P_i)^beta, and the
    zero-priority group gets 1."""
    weights = pass_rate_batch(run_fraction=0.0)
    assert weights["half"] == pytest.approx((0.751 / 1.001) ** (0.6 * 0.4))  # 0.933
    assert weights["quarter"] == pytest.approx(1.0)
    assert weights["all"] == pytest.approx(1.0)
    halfway = pass_rate_batch(run_fraction=0.5)  # beta 0.7
    assert halfway["half"] == pytest.approx((0.751 / 1.001) ** (0.6 * 0.7))
    last = pass_rate_batch(run_fraction=1.0)  # beta 1
    assert last["half"] == pytest.approx((0.751 / 1.001) ** 0.6)


def test_draws_follow_the_priorities_and_carry_their_weights() -> None:
    replay = store("advantage", max_reuse=10_000, epsilon=1e-6)
    replay.add(group("signal", [1.0, 0.0]))  # priority 0.5
    replay.add(group("flat", [1.0, 1.0]))  # priority 0: drawn with probability ~2e-6
    counts: Counter[str] = Counter()
    for _ in range(200):
        taken = take(replay, 1)
        counts[taken.groups[0].prompt_id] += 1
    assert counts["signal"] == 200
    taken = take(replay, 2)
    assert sorted(g.prompt_id for g in taken.groups) == ["flat", "signal"]
    by_name = dict(zip((g.prompt_id for g in taken.groups), taken.weights))
    # beta 1: the flat group's (N P)^-1 ~ 1 / 4e-6 was the batch's largest weight and put
    # the signal group's at 2e-6; now the signal group is the reference (1), flat capped at 1
    assert by_name == {"flat": 1.0, "signal": 1.0}
    stats = replay.stats()
    assert stats["replay/is_weight_signal_mean"] == 1.0 and stats["replay/beta"] == 1.0


def test_draws_are_reproducible_by_seed() -> None:
    def draws(seed: int) -> list[str]:
        replay = store("uniform", max_reuse=100, seed=seed)
        for i in range(8):
            replay.add(group(f"p{i}", [1.0, 0.0]))
        return [g.prompt_id for _ in range(10) for g in take(replay, 3).groups]
    assert draws(1) == draws(1)
    assert draws(1) != draws(2)


def test_a_group_is_trained_at_most_max_reuse_times() -> None:
    replay = store("uniform", max_reuse=3)
    replay.add(group("only", [1.0, 0.0]))
    for _ in range(3):
        assert [g.prompt_id for g in take(replay, 1).groups] == ["only"]
    assert len(replay) == 0 and take(replay, 1).groups == []
    stats = replay.stats()
    assert stats["replay/draws"] == 3 and stats["replay/redraws"] == 2
    assert stats["replay/retired_max_reuse"] == 1


def test_eviction_by_age_reports_only_groups_never_trained_on() -> None:
    replay = store("uniform", max_reuse=5, max_age=1)
    replay.add(group("used", [1.0, 0.0], version=0))
    assert take(replay, 1, learner_version=0, max_staleness=3).groups[0].prompt_id == "used"
    replay.add(group("unused", [1.0, 0.0], version=0))
    replay.add(group("fresh", [1.0, 0.0], version=2))
    taken = take(replay, 1, learner_version=2, max_staleness=3)  # max_age 1 < max_staleness
    assert [g.prompt_id for g in taken.evicted] == ["unused"] and taken.dropped_stale == []
    assert [g.prompt_id for g in taken.groups] == ["fresh"]
    stats = replay.stats()
    assert stats["replay/evicted_after_use"] == 1 and stats["replay/evicted_unused"] == 1


def test_td_error_priorities_start_at_the_max_and_follow_the_learner() -> None:
    replay = store("td_error", max_reuse=100, epsilon=1e-6)
    first, second = group("a", [1.0, 0.0]), group("b", [1.0, 0.0])
    replay.add(first)
    replay.update_priorities({first.rollout_id: 4.0, "gone/already": 9.0})
    replay.add(second)  # new: the largest priority seen so far, 9
    assert replay.initial_priority(second) == 9.0
    replay.update_priorities({first.rollout_id: 0.0})
    assert {g.prompt_id for _ in range(50) for g in take(replay, 1).groups} == {"b"}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_priorities_with_one_bad_value_are_refused_whole(bad: float) -> None:
    """The learner's priorities were applied one by one until a bad one raised: the ones
    before it stayed, and a huge one had raised the priority of every later group."""
    replay = store("td_error", max_reuse=100, epsilon=1e-6)
    first, second = group("a", [1.0, 0.0]), group("b", [1.0, 0.0])
    replay.add(first)
    replay.add(second)
    with pytest.raises(PriorityError, match=f"got lease/b = {bad}; none of the 2 was applied"):
        replay.update_priorities({first.rollout_id: 50.0, second.rollout_id: bad})
    assert [replay.initial_priority(g) for g in (first, second)] == [1.0, 1.0]  # max still 1
    assert replay.stats()["replay/priority_mean"] == 1.0  # neither changed
    many = {f"x/{i}": bad for i in range(5)}
    with pytest.raises(PriorityError, match="x/0 = .*x/2 = .* and 2 more; none of the 5"):
        replay.update_priorities(many)


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
    mean_before = hub.stats()["buffer/replay/priority_mean"]
    refused = hub.handle(SampleRequest(num_groups=1, priorities={ids[0]: 7.0,
                                                                 ids[1]: float("nan")}))
    assert isinstance(refused, ErrorReply) and refused.code == "bad_priorities"
    assert f"got {ids[1]} = nan; none of the 2 was applied" in refused.detail
    assert hub.counts["requests/bad_priorities"] == 1
    assert hub.stats()["buffer/replay/priority_mean"] == mean_before  # 7.0 was not applied
    assert hub.counts["groups/served"] == served  # refused whole: no batch either
    assert hub.counts["rejected/malformed"] == 0  # no rollout was refused
    assert hub.accounting_problems() == []


def test_the_hub_anneals_beta_by_the_learners_step(make_hub) -> None:
    replay = store("uniform", beta=0.4, beta_final=1.0, max_reuse=10)
    hub = make_hub(batch_size=2, n=2, per_lease=2, max_staleness=0, store=replay)
    granted = lease(hub)
    for prompt in granted.prompts:
        assert hub.handle(make_group(granted.lease_id, prompt, 2, rewards=[1.0, 0.0])).accepted
    for step, beta in ((1, 0.4 + 0.6 / TOTAL_STEPS), (TOTAL_STEPS // 2, 0.7),
                       (TOTAL_STEPS, 1.0)):
        batch = hub.handle(SampleRequest(num_groups=1, step=step))
        assert isinstance(batch, SampleBatch) and len(batch.groups) == 1
        assert batch.buffer_stats["buffer/replay/beta"] == pytest.approx(beta)


ALL_PASS_EVERY = 3  # rows 0, 3, 6, ... pass on every sample: priority 0 by pass rate


def simulated_rewards(prompt: Prompt, n: int) -> list[float]:
    row = int(prompt.prompt_id.split("-")[1])
    return [1.0] * n if row % ALL_PASS_EVERY == 0 else [1.0, 0.0] * (n // 2)


def test_evicted_prompts_are_not_generated_again_at_once(make_hub) -> None:
    """A hub-level run: a generator as fast as the staleness gate lets it be, a learner that
    takes 8 groups by pass-rate priority each step and publishes. A third of the rows pass
    on every sample; the draws pass their groups over, and age evicts them. Their prompts
    came back first, to be generated and passed over again (one prompt was generated 9
    times in 60 steps); now they wait for the epoch's end, and are done with when evicted
    there again. Generated groups per trained group stay bounded by the share of rows
    with signal: 1 / (1 - 1/3) = 1.5 (what prioritization costs: the passed-over groups
    were generated), and the evicted fraction is reported."""
    batch_size, n, steps = 8, 4, 60
    replay = PrioritizedStore(ReplayConfig(priority="pass_rate"), max_staleness=2)
    hub = make_hub(batch_size=batch_size, n=n, per_lease=batch_size, max_staleness=2,
                   rows=300, store=replay)
    generations: Counter[str] = Counter()
    for step in range(1, steps + 1):
        while (granted := lease(hub, max_prompts=batch_size)).prompts:
            for prompt in granted.prompts:
                generations[prompt.prompt_id] += 1
                assert hub.handle(make_group(granted.lease_id, prompt, n,
                                             version=hub.learner_version,
                                             rewards=simulated_rewards(prompt, n))).accepted
        batch = hub.handle(SampleRequest(num_groups=batch_size, step=step))
        assert isinstance(batch, SampleBatch) and len(batch.groups) == batch_size, step
        hub.handle(VersionUpdate(version=step, step=step))
    assert hub.source.epoch >= 1  # the deferred prompts of epoch 0 came at its end
    assert max(generations.values()) <= 2, generations.most_common(3)
    trained = hub.counts["groups/trained"]
    assert trained == steps * batch_size
    assert sum(generations.values()) / trained <= 1 / (1 - 1 / ALL_PASS_EVERY)
    evicted, accepted = hub.counts["dropped/evicted"], hub.counts["groups/accepted"]
    assert evicted > 0 and hub.counts["dropped/stale"] == evicted  # all by the draws
    assert hub.stats()["buffer/evicted_frac"] == evicted / accepted
    assert hub.accounting_problems() == []
