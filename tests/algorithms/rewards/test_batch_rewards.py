"""``reward_manager = "batch"``: a batch reward function is called once per group."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.algorithms.rewards import RewardConfig, RewardItem, RewardScorer

FNS = Path(__file__).with_name("batch_reward_fns.py")


@pytest.fixture
def calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "calls.txt"
    monkeypatch.setenv("RELAY_TEST_BATCH_CALLS", str(path))
    return path


def group(*texts: str) -> list[RewardItem]:
    return [RewardItem("any/source", text, "7") for text in texts]


def scorer(name: str, timeout_s: float = 5.0, **kwargs: object) -> RewardScorer:
    return RewardScorer(RewardConfig(path=str(FNS), name=name, reward_manager="batch",
                                     timeout_s=timeout_s, reward_kwargs=kwargs))


def test_one_call_per_group_in_order(calls: Path) -> None:
    with scorer("compute_score") as s:
        first = s.score(group("7", "x", "7", "yy"))
        second = s.score(group("no", "7"))
    assert calls.read_text().split() == ["4", "2"]  # one call per group, whole groups
    assert [r.score for r in first] == [1.0, 0.0, 1.0, 0.0]
    assert first[3].info == {"len": 2.0} and not any(r.error for r in first)
    assert [r.score for r in second] == [0.0, 1.0]


def test_reward_kwargs_reach_every_batch_call(calls: Path) -> None:
    with scorer("scaled", scale=2.0, bonus=0.25) as s:
        results = s.score(group("7", "x"))
    assert [r.score for r in results] == [2.25, 0.25] and not any(r.error for r in results)


def test_a_wrong_length_fails_the_group_with_the_reason(calls: Path) -> None:
    with scorer("wrong_length") as s:
        results = s.score(group("7", "7"))
    assert [r.score for r in results] == [0.0, 0.0]
    assert all("list of 2 scores" in r.error for r in results)


def test_a_hanging_batch_times_out_once_for_the_whole_group(calls: Path) -> None:
    with scorer("hangs", timeout_s=0.5) as s:
        results = s.score(group("7", "7", "7"))
    assert calls.read_text().split() == ["3"]  # not resent sample by sample
    assert all(r.score == 0.0 and r.error.startswith("timeout") for r in results)


def test_batch_needs_a_custom_function() -> None:
    with pytest.raises(ValueError, match="custom_reward_function.path"):
        RewardScorer(RewardConfig(reward_manager="batch"))
