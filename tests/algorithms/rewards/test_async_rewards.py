"""``async def`` reward functions: awaited in the worker, a group's samples at once, each
within the per-sample time limit; a broken function is a warning in the log.

Before the worker awaited them, every sample of an async function scored 0 with
"bad return: coroutine".
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from relay.algorithms.rewards import (
    RewardConfig,
    RewardItem,
    RewardResult,
    RewardScorer,
    load_score_fn,
)
from relay.algorithms.rewards.calls import is_async
from relay.algorithms.rewards.scorer import FailureAlarm

FNS = Path(__file__).with_name("async_reward_fns.py")
LIMIT_S = 1.0
SOURCE = "test/async"

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


def items(*completions: str) -> list[RewardItem]:
    return [RewardItem(SOURCE, completion, "") for completion in completions]


def async_scorer(**overrides) -> RewardScorer:
    return RewardScorer(RewardConfig(path=str(FNS), timeout_s=LIMIT_S, **overrides))


@pytest.fixture(scope="module")
def scorer() -> Iterator[RewardScorer]:
    with async_scorer() as shared:
        yield shared


def test_an_async_function_scores_each_sample_in_order() -> None:
    with async_scorer() as scorer:
        results = scorer.score(items(*(f"ok:{k}" for k in range(8))))
    assert [r.score for r in results] == [float(k) for k in range(8)]
    assert all(not r.error for r in results)
    assert max(r.info["peak"] for r in results) == 8.0  # the whole group was in flight


def test_max_concurrent_bounds_the_samples_in_flight() -> None:
    with async_scorer(max_concurrent=3) as scorer:
        results = scorer.score(items(*(f"ok:{k}" for k in range(8))))
    assert [r.score for r in results] == [float(k) for k in range(8)]
    assert max(r.info["peak"] for r in results) == 3.0


def test_an_async_sample_past_the_limit_scores_zero_and_the_worker_stays(
        scorer: RewardScorer) -> None:
    (before,) = scorer.score(items("pid:"))
    results = scorer.score(items("ok:1", "sleep:60", "ok:3", "pid:"))
    assert [r.score for r in results[:3]] == [1.0, 0.0, 3.0]
    assert results[1].error == f"timeout: no result within {LIMIT_S:g} s (coroutine cancelled)"
    assert results[3].score == before.score  # cancelled in the worker, which goes on


def test_a_coroutine_that_blocks_the_event_loop_is_killed(scorer: RewardScorer) -> None:
    """(It stalls the samples in flight with it too: the first late one is blamed.)"""
    (before,) = scorer.score(items("pid:"))
    results = scorer.score(items("block:60", "ok:2", "pid:"))
    assert [r.score for r in results[:2]] == [0.0, 2.0]
    assert results[0].error == f"timeout: no result within {LIMIT_S:g} s (worker killed)"
    assert results[2].score != before.score  # a fresh worker scored the rest


@pytest.mark.parametrize(("completion", "error"), [("raise:7", "ValueError: bad sample 7"),
                                                   ("exit:", "SystemExit: 3")])
def test_an_async_failure_costs_only_its_sample(scorer: RewardScorer, completion: str,
                                                error: str) -> None:
    results = scorer.score(items("ok:1", completion, "ok:3"))
    assert [(r.score, r.error) for r in results] == [(1.0, ""), (0.0, error), (3.0, "")]


@pytest.mark.parametrize("name", ["wrapped", "as_object"])
def test_a_function_returning_a_coroutine_and_an_async_callable_object_score(name: str) -> None:
    with RewardScorer(RewardConfig(path=str(FNS), name=name, timeout_s=LIMIT_S)) as scorer:
        results = scorer.score(items("ok:2", "sleep:60", "ok:4"))
    assert [r.score for r in results] == [2.0, 0.0, 4.0]
    assert results[1].error.startswith("timeout: no result within")


def test_which_callables_are_async() -> None:
    compute_score = load_score_fn(f"{FNS}:compute_score")
    assert is_async(compute_score)
    assert is_async(functools.partial(compute_score, data_source=SOURCE))
    assert is_async(load_score_fn(f"{FNS}:as_object"))
    assert not is_async(load_score_fn(f"{FNS}:wrapped"))  # awaited all the same, alone
    assert not is_async(load_score_fn(f"{FNS.with_name('reward_fns.py')}:compute_score"))


def failing(fraction_failed: float, size: int = 8) -> list[RewardResult]:
    bad = round(fraction_failed * size)
    return [RewardResult(score=0.0, error="ValueError: no answer")] * bad + \
        [RewardResult(score=1.0)] * (size - bad)


def test_a_function_failing_on_more_than_half_of_a_call_is_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    alarm = FailureAlarm(every_s=3600.0)
    with caplog.at_level(logging.WARNING, logger="relay.algorithms.rewards.scorer"):
        alarm.check(failing(0.5))  # half is not more than half
        assert not caplog.records
        alarm.check(failing(5 / 8))
        alarm.check(failing(1.0))  # within every_s of the first: counted, not logged
        alarm.every_s = 0.0
        alarm.check(failing(7 / 8))
    assert [r.getMessage() for r in caplog.records] == [
        "REWARD FUNCTION FAILING: 5 of 8 samples scored 0 with an error (1 such calls since "
        "the last warning); the most common error (5 times): ValueError: no answer",
        "REWARD FUNCTION FAILING: 7 of 8 samples scored 0 with an error (2 such calls since "
        "the last warning); the most common error (7 times): ValueError: no answer"]


def test_the_scorer_warns_when_most_of_a_group_fails(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="relay.algorithms.rewards.scorer"), \
            async_scorer() as scorer:
        scorer.score(items("raise:1", "raise:2", "ok:3"))
    (record,) = caplog.records
    assert record.getMessage().startswith("REWARD FUNCTION FAILING: 2 of 3 samples")
