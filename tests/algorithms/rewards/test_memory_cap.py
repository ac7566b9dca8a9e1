"""The reward worker's memory cap, ``custom_reward_function.worker_memory_gb``.

A reward function that asks for 20 GiB scores 0 with a reason naming the key, and scoring
goes on in a fresh worker. Before the cap, the same call was granted (this machine
overcommits untouched pages), and one that touched its pages took the host's memory.
The allocations here are never touched, so even uncapped they cost no RSS.
"""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

from relay.algorithms.rewards import RewardConfig, RewardItem, RewardLoadError, RewardScorer
from relay.algorithms.rewards.memory_cap import is_out_of_memory

FNS = Path(__file__).with_name("reward_fns.py")
ASYNC_FNS = Path(__file__).with_name("async_reward_fns.py")
SOURCE = "test/custom"
OVER_CAP = "reward worker exceeded custom_reward_function.worker_memory_gb = 1 (GiB; 0: no cap): "

pytestmark = pytest.mark.skipif(not Path("/proc/self/limits").exists(),
                                reason="needs Linux /proc")


def items(*completions: str) -> list[RewardItem]:
    return [RewardItem(SOURCE, completion, "") for completion in completions]


def data_limit(pid: int) -> str:
    """The soft "Max data size" of process ``pid`` (bytes, or "unlimited")."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max data size"):
            return line.split()[3]
    raise AssertionError(f"no data limit in /proc/{pid}/limits")


def test_the_cap_is_the_workers_data_limit_and_zero_means_none() -> None:
    with RewardScorer(RewardConfig(path=str(FNS), worker_memory_gb=0.5)) as capped:
        assert capped.worker_pid is not None
        assert data_limit(capped.worker_pid) == str(2**29)
    soft, _ = resource.getrlimit(resource.RLIMIT_DATA)
    inherited = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
    with RewardScorer(RewardConfig(path=str(FNS), worker_memory_gb=0)) as uncapped:
        assert uncapped.worker_pid is not None
        assert data_limit(uncapped.worker_pid) == inherited


@pytest.mark.parametrize("fns", [FNS, ASYNC_FNS], ids=["plain", "async"])
def test_a_reward_asking_for_20_gib_scores_zero_and_scoring_goes_on(fns: Path) -> None:
    config = RewardConfig(path=str(fns), worker_memory_gb=1.0, timeout_s=30.0)
    with RewardScorer(config) as scorer:
        (first,) = scorer.score(items("pid:"))
        results = scorer.score(items("alloc:0.25", "alloc:20", "alloc:0.25", "pid:"))
        assert [r.score for r in results[:3]] == [1.0, 0.0, 1.0]
        assert results[1].error == OVER_CAP + "MemoryError"
        assert results[3].score != first.score  # the items after it ran in a fresh worker
        assert scorer.score(items("alloc:0.25"))[0].score == 1.0


def test_an_import_that_exceeds_the_cap_is_a_load_error_naming_it(tmp_path: Path) -> None:
    module = tmp_path / "greedy_reward.py"
    module.write_text("TABLE = bytearray(20 * 2**30)\n\n"
                      "def compute_score(**kwargs):\n    return 1.0\n")
    with pytest.raises(RewardLoadError, match=r"MemoryError.*worker_memory_gb = 1\b"):
        RewardScorer(RewardConfig(path=str(module), worker_memory_gb=1.0))


@pytest.mark.parametrize(("exc", "expected"), [
    (MemoryError(), True),
    # torch's CPU allocator, as it reports an allocation refused under RLIMIT_DATA
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                  "allocate memory: you tried to allocate 3221225472 bytes. Error code 12 "
                  "(Cannot allocate memory)"), True),
    (OSError(12, "Cannot allocate memory"), True),
    (RuntimeError("shape mismatch"), False),
    (ValueError("no answer"), False),
])
def test_out_of_memory_is_recognized_by_type_and_by_the_allocators_text(
        exc: BaseException, expected: bool) -> None:
    assert is_out_of_memory(exc) is expected
