"""RewardScorer: order, isolation, time limits, loading errors and process hygiene.

Real worker processes throughout. The custom function (``reward_fns.py``) returns a score
derived from each completion (``ok:<n>`` -> n), so a reward landing on the wrong sample
fails the checks. Time limits are short (``LIMIT_S``) to keep the file fast.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from relay.algorithms.rewards import (
    RewardConfig,
    RewardItem,
    RewardLoadError,
    RewardResult,
    RewardScorer,
    UnknownDataSourceError,
    load_score_fn,
)

FNS = Path(__file__).with_name("reward_fns.py")
LIMIT_S = 1.0
SOURCE = "test/custom"

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


def items(*completions: str) -> list[RewardItem]:
    return [RewardItem(SOURCE, completion, "") for completion in completions]


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_dead(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not alive(pid)


def read_when_written(path: Path, within_s: float = 10.0) -> int:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return int(path.read_text())
        time.sleep(0.01)
    raise AssertionError(f"{path} was never written")


def live_pid(scorer: RewardScorer) -> int:
    """The pid of a worker known to be serving (earlier tests may have killed the last)."""
    assert scorer.score(items("ok:0"))[0].score == 0.0
    assert scorer.worker_pid is not None
    return scorer.worker_pid


@pytest.fixture(scope="module")
def scorer() -> Iterator[RewardScorer]:
    with RewardScorer(RewardConfig(path=str(FNS), timeout_s=LIMIT_S)) as shared:
        yield shared


# --- results and their order -----------------------------------------------------------


def test_results_follow_item_order_and_keep_numeric_info(scorer: RewardScorer) -> None:
    results = scorer.score(items(*(f"ok:{n}" for n in (5, -2, 0.5, 9))))
    assert results == [RewardResult(score=n, info={"echo": n}) for n in (5, -2, 0.5, 9)]
    assert scorer.score([]) == []


def test_raising_function_gives_zero_and_names_the_exception(scorer: RewardScorer) -> None:
    pid = live_pid(scorer)
    results = scorer.score(items("ok:1", "raise:2", "ok:3"))
    assert [r.score for r in results] == [1.0, 0.0, 3.0]
    assert results[1].error == "ValueError: bad sample 2"
    assert results[0].error == results[2].error == ""
    assert scorer.worker_pid == pid  # an exception needs no new worker


@pytest.mark.parametrize(
    ("completion", "error"),
    [
        ("nan:", "bad return: non-finite score nan"),
        ("inf:", "bad return: non-finite score inf"),
        ("str:", "bad return: str, expected a float or a dict with 'score'"),
        ("none:", "bad return: NoneType, expected a float or a dict with 'score'"),
        ("noscore:", "bad return: dict without 'score' (keys: 'value')"),
        ("exit:", "SystemExit: 3"),
    ],
)
def test_bad_returns_are_error_results(scorer: RewardScorer, completion: str, error: str) -> None:
    pid = live_pid(scorer)
    results = scorer.score(items("ok:1", completion, "ok:2"))
    assert results == [
        RewardResult(score=1.0, info={"echo": 1.0}),
        RewardResult(score=0.0, error=error),
        RewardResult(score=2.0, info={"echo": 2.0}),
    ]
    assert scorer.worker_pid == pid


def test_printing_to_stdout_does_not_disturb_results(scorer: RewardScorer) -> None:
    assert [r.score for r in scorer.score(items("print:4", "ok:5", "print:6"))] == [4, 5, 6]


def test_extra_info_reaches_the_function_and_unsendable_items_fail_alone(
    scorer: RewardScorer,
) -> None:
    results = scorer.score([
        RewardItem(SOURCE, "extra:", "", {"value": np.int64(4)}),  # numpy goes via tolist()
        RewardItem(SOURCE, "extra:", "", {"value": object()}),
        RewardItem(SOURCE, "ok:6", ""),
    ])
    assert [r.score for r in results] == [4.0, 0.0, 6.0]
    assert results[1].error.startswith("cannot send the item: TypeError")


def test_reward_functions_are_called_with_keywords_like_verl() -> None:
    with RewardScorer(RewardConfig(path=str(FNS), name="reordered")) as custom:
        results = custom.score([RewardItem(SOURCE, "42", "42"), RewardItem(SOURCE, "4", "42")])
    assert [r.score for r in results] == [1.0, 0.0]


# --- time limits and dead workers ------------------------------------------------------


@pytest.mark.parametrize("kind", ["hang", "spin"])
def test_timeout_gives_zero_and_replaces_the_worker(scorer: RewardScorer, kind: str) -> None:
    old_pid = live_pid(scorer)
    results = scorer.score(items("ok:1", f"{kind}:", "ok:3"))
    assert [r.score for r in results] == [1.0, 0.0, 3.0]
    assert results[1].error.startswith("timeout")
    assert not alive(old_pid)  # the hung call was really stopped
    assert scorer.worker_pid not in (None, old_pid)
    assert scorer.score(items("ok:7"))[0].score == 7.0  # and the new worker serves


def test_raise_and_hang_in_one_group_leave_every_other_reward_in_place(
    scorer: RewardScorer,
) -> None:
    completions = [f"ok:{10 + i}" for i in range(8)]
    completions[2] = "raise:2"
    completions[5] = "hang:"
    results = scorer.score(items(*completions))
    for i, result in enumerate(results):
        if i == 2:
            assert (result.score, result.error) == (0.0, "ValueError: bad sample 2")
        elif i == 5:
            assert result.score == 0.0 and result.error.startswith("timeout")
        else:
            assert result == RewardResult(score=10.0 + i, info={"echo": 10.0 + i}), i


def test_replies_are_checked_against_the_sample_they_answer(scorer: RewardScorer) -> None:
    # Item 1 writes a fake, well-formed reply "item 2 scored 999" before its own reply.
    results = scorer.score(items("ok:1", "forge:999", "ok:3", "ok:4"))
    assert [r.score for r in results] == [1.0, 0.0, 3.0, 4.0]
    assert results[1].error.startswith("protocol error: expected the result of item 1")


def test_worker_killed_from_outside_mid_group(tmp_path: Path) -> None:
    marker = tmp_path / "pid"
    killer = threading.Thread(
        target=lambda: os.kill(read_when_written(marker), signal.SIGKILL), daemon=True
    )
    killer.start()
    # a limit the kill always beats, however slow the machine: the death is what is tested
    with RewardScorer(RewardConfig(path=str(FNS), timeout_s=30.0)) as scorer:
        results = scorer.score(items("ok:1", f"pid_then_hang:{marker}", "ok:3", "ok:4"))
        killer.join()
        assert [r.score for r in results] == [1.0, 0.0, 3.0, 4.0]
        assert results[1].error == "worker died while scoring this sample (exit code -9)"
        assert scorer.worker_pid not in (None, int(marker.read_text()))


def test_function_that_exits_the_process_costs_only_its_sample(scorer: RewardScorer) -> None:
    results = scorer.score(items("ok:1", "die:", "ok:3"))
    assert [r.score for r in results] == [1.0, 0.0, 3.0]
    assert results[1].error == "worker died while scoring this sample (exit code 7)"


def test_worker_dead_while_idle_is_replaced_without_losing_a_sample(
    scorer: RewardScorer,
) -> None:
    pid = live_pid(scorer)
    os.kill(pid, signal.SIGKILL)
    assert wait_dead(pid)
    assert [r.score for r in scorer.score(items("ok:1", "ok:2"))] == [1.0, 2.0]


# --- routing: built-in rules, in-process and in the worker -----------------------------


MIXED = [
    RewardItem("relay/arithmetic", "<answer>12</answer>", "12"),
    RewardItem("lighteval/MATH", "\\boxed{\\frac{1}{2}}", "0.5"),
    RewardItem("openai/gsm8k", "#### 3", "4"),
    RewardItem("relay/arithmetic", "<answer>-3</answer>", "-3"),
    RewardItem("aime2024", "\\boxed{3}", "4"),
    RewardItem("relay/arithmetic", "no answer", "5"),
]
MIXED_SCORES = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("in_process", [True, False])
def test_builtin_routes_agree_and_keep_order(in_process: bool) -> None:
    with RewardScorer(RewardConfig(in_process_builtins=in_process)) as builtin:
        assert [r.score for r in builtin.score(MIXED)] == MIXED_SCORES
        assert [r.info["format_ok"] for r in builtin.score(MIXED)] == [1, 1, 1, 1, 1, 0]


def test_builtin_only_scorer_starts_no_worker_for_in_process_rules() -> None:
    with RewardScorer() as builtin:
        builtin.check_data_sources(["relay/arithmetic", "openai/gsm8k"])
        builtin.score(MIXED[:1])
        assert builtin.worker_pid is None


def test_unknown_data_source_raises_at_check_and_at_score() -> None:
    with RewardScorer() as builtin:
        with pytest.raises(UnknownDataSourceError, match="'my/set'"):
            builtin.check_data_sources(["relay/arithmetic", "my/set"])
        with pytest.raises(UnknownDataSourceError, match="'my/set'"):
            builtin.score([MIXED[0], RewardItem("my/set", "x", "1")])


def test_custom_function_by_module_name_scores_every_source() -> None:
    config = RewardConfig(path="relay.algorithms.rewards.registry", name="default_compute_score")
    with RewardScorer(config) as custom:
        custom.check_data_sources(["any/name"])  # a custom function accepts all sources
        assert [r.score for r in custom.score(MIXED)] == MIXED_SCORES


@pytest.mark.parametrize(
    ("field", "value"), [("timeout_s", 0.0), ("startup_timeout_s", -1.0), ("gsm8k_method", "loose")]
)
def test_config_rejects_bad_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"RewardConfig.{field}"):
        RewardConfig(**{field: value})


# --- loading errors --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("compute_score", "expected 'module:function' or 'path/to/file.py:function'"),
        ("missing/reward.py:compute_score", "file not found: "),
        (f"{FNS}:nope", "has no attribute 'nope'; functions it defines: compute_score"),
        (f"{FNS}:NOT_A_FUNCTION", "reward_fns.py:NOT_A_FUNCTION is a int, not a function"),
        ("no_such_module_xyz:f", "module 'no_such_module_xyz' not found"),
        ("json:nope", "json has no attribute 'nope'"),
        ("json:__doc__", "json:__doc__ is a str, not a function"),
    ],
)
def test_load_errors_name_what_was_asked_for(spec: str, message: str) -> None:
    with pytest.raises(RewardLoadError) as caught:
        load_score_fn(spec)
    assert repr(spec) in str(caught.value) and message in str(caught.value)


def test_load_error_from_an_import_that_raises(tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('no GPU here')\n")
    expected = r"importing .*broken\.py raised RuntimeError: no GPU here"
    with pytest.raises(RewardLoadError, match=expected):
        load_score_fn(f"{broken}:compute_score")


def test_scorer_raises_load_errors_at_construction_and_leaves_no_worker() -> None:
    before = set(_children())
    with pytest.raises(RewardLoadError, match="has no attribute 'nope'"):
        RewardScorer(RewardConfig(path=str(FNS), name="nope"))
    assert set(_children()) <= before


def _children() -> list[int]:
    """Pids of this process's live children."""
    me = str(os.getpid())
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields[1] == me and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


# --- process hygiene -------------------------------------------------------------------


def test_close_leaves_no_process_behind(tmp_path: Path) -> None:
    marker = tmp_path / "grandchild"
    config = RewardConfig(path=str(FNS), timeout_s=LIMIT_S)
    with RewardScorer(config) as own:
        first = own.worker_pid
        result = own.score(items(f"spawn_then_hang:{marker}"))[0]
        assert result.error.startswith("timeout")
        grandchild = int(marker.read_text())
        assert wait_dead(grandchild)  # the kill took the worker's process group
        assert own.worker_pid is None  # replaced on next use
        assert own.score(items("ok:1"))[0].score == 1.0
        second = own.worker_pid
    assert own.worker_pid is None
    assert first is not None and second is not None
    assert not alive(first) and not alive(second)
    with pytest.raises(RuntimeError, match="closed"):
        own.score(items("ok:1"))


def test_worker_dies_with_its_parent(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        from relay.algorithms.rewards import RewardConfig, RewardItem, RewardScorer
        scorer = RewardScorer(RewardConfig(path={str(FNS)!r}, timeout_s=600))
        print(scorer.worker_pid, flush=True)
        scorer.score([RewardItem("s", "hang:", "")])
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(parent.stdout.readline())
        assert alive(worker)
        parent.kill()  # no chance to clean up
        parent.wait()
        assert wait_dead(worker), "the worker outlived its killed parent"
    finally:
        parent.kill()
        parent.stdout.close()
