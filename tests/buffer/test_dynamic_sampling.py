"""DAPO dynamic sampling: the zero-variance rule, the metric, and verl's generation cap."""

from __future__ import annotations

import pytest

from relay.buffer.dynamic_sampling import (
    DynamicSampling,
    ReplayFilterError,
    has_zero_variance,
    sample_metric,
)
from relay.transport.messages import Prompt

from .conftest import make_group, make_sample

PROMPT = Prompt(prompt_id="p0", messages=[], data_source="d")


def group(rewards: list[float], rollout: str = "L1"):
    return make_group(rollout, PROMPT, len(rewards), rewards=rewards)


@pytest.mark.parametrize(("values", "zero"), [
    ([1.0, 1.0, 1.0, 1.0], True),  # all right
    ([0.0, 0.0], True),  # all wrong
    ([1.0, 0.0, 1.0, 1.0], False),  # variance 3/16
    ([0.5, 0.5, 0.25], False),
    ([1.0], False),  # one sample: kept, as verl keeps it
])
def test_zero_variance_means_all_equal(values: list[float], zero: bool) -> None:
    assert has_zero_variance(values) is zero


def test_metric_is_the_reward_or_a_reward_info_entry() -> None:
    sample = make_sample(reward=0.25)
    sample.reward_info = {"acc": 1.0}
    assert sample_metric(sample, "score") == 0.25
    assert sample_metric(sample, "acc") == 1.0
    failed = make_sample(reward=0.0)
    failed.reward_error = "TimeoutError"
    assert sample_metric(failed, "acc") == 0.0  # no info after a failure: its reward counts


def test_a_missing_metric_names_the_setting_and_the_entries() -> None:
    sample = make_sample()
    sample.reward_info = {"format_ok": 1.0}
    with pytest.raises(ReplayFilterError, match="filter_groups.metric is 'acc'.*format_ok"):
        sample_metric(sample, "acc")


def test_metric_from_reward_info_decides_the_drop() -> None:
    rewards_differ = group([1.0, 0.0])
    for s in rewards_differ.samples:
        s.reward_info = {"acc": 1.0}  # same accuracy, different scores
    assert DynamicSampling("acc", batch_size=4, max_num_gen_batches=0)(rewards_differ) == \
        "zero_variance"
    assert DynamicSampling("score", 4, 0)(rewards_differ) is rewards_differ


def test_drops_zero_variance_groups_and_keeps_the_rest() -> None:
    dynamic = DynamicSampling("score", batch_size=4, max_num_gen_batches=0)
    verdicts = [dynamic(group(r)) != "zero_variance"
                for r in ([1, 1, 1], [0, 1, 0], [0, 0, 0], [0.5, 0.5, 0.7])]
    assert verdicts == [False, True, False, True]
    assert (dynamic.judged, dynamic.kept) == (4, 2)


def test_cap_counts_groups_judged_while_one_batch_fills() -> None:
    # batch 2, cap 2 batches: at most 4 groups judged per 2 kept.
    dynamic = DynamicSampling("score", batch_size=2, max_num_gen_batches=2)
    for rewards in ([1, 1], [0, 1], [0, 0], [1, 0]):  # 4th judged, 2nd kept: batch full
        dynamic(group(rewards))
    assert (dynamic.judged, dynamic.kept) == (0, 0)  # a new batch starts afresh
    dynamic(group([1, 1]))
    dynamic(group([1, 0]))
    dynamic(group([0, 0]))
    with pytest.raises(ReplayFilterError, match=r"judged 4 groups .*max_num_gen_batches = 2 "
                                                r"batches of 2\) and kept only 1 of the 2"):
        dynamic(group([1, 1]))


def test_no_cap_when_max_num_gen_batches_is_zero() -> None:
    dynamic = DynamicSampling("score", batch_size=1, max_num_gen_batches=0)
    for _ in range(1000):
        assert dynamic(group([0, 0])) == "zero_variance"
