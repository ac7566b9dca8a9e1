"""Code rewards scored in the local sandbox: hand-written stdin/stdout and call-based
problems (``data/code_problems.jsonl``), partial credit, the caps, every failure's kind and
reason, and the reward worker's route for ``data_source = "codecontests"``."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from relay.algorithms.rewards import RewardConfig, RewardItem, RewardScorer, code
from relay.algorithms.rewards.code import (
    FAILURE_KINDS,
    CodeRewardConfig,
    SandboxFailure,
    SandboxHandle,
    score_code,
)
from relay.algorithms.rewards.registry import check_data_sources, family_of
from relay.algorithms.sandbox import Execution, Limits, SandboxFusionConfig, SandboxSettings

PROBLEMS = Path(__file__).parent / "data" / "code_problems.jsonl"
FAST = CodeRewardConfig(test_timeout_s=1.0)
ADD = {"inputs": ["1 2", "2 2", "5 5", "0 0"], "outputs": ["3", "4", "10", "0"]}


def fenced(code_text: str) -> str:
    return f"```python\n{code_text}\n```"


def labelled() -> list[tuple[str, str, Any, dict[str, Any]]]:
    rows = [json.loads(line) for line in PROBLEMS.read_text().splitlines() if line.strip()]
    return [(row["name"], row["data_source"], row["ground_truth"], response)
            for row in rows for response in row["responses"]]


@pytest.fixture(scope="module")
def sandbox() -> Iterator[SandboxHandle]:
    handle = SandboxHandle(SandboxSettings(workers=2))
    yield handle
    handle.close()


@pytest.mark.parametrize(("name", "data_source", "truth", "response"), labelled(),
                         ids=lambda value: value if isinstance(value, str) and len(value) < 40
                         else None)
def test_hand_written_problems_score_as_labelled(sandbox: SandboxHandle, name: str,
                                                 data_source: str, truth: Any,
                                                 response: dict[str, Any]) -> None:
    assert family_of(data_source) == "code"
    verdict = score_code(sandbox.get(), response["text"], truth, FAST, budget_s=10.0,
                         base=sandbox.limits, parallel=sandbox.concurrency)
    assert (verdict.score, verdict.kind) == (response["score"], response["kind"]), (name, verdict)


def test_all_or_nothing_stops_at_the_first_failure_and_partial_credit_runs_every_test(
        sandbox: SandboxHandle) -> None:
    right_on_three = fenced("a, b = map(int, input().split())\nprint(a * b if a == 5 else a + b)")
    verdict = score_code(sandbox.get(), right_on_three, ADD, FAST)
    assert (verdict.score, verdict.kind, verdict.tests_passed, verdict.tests_run,
            verdict.tests_total) == (0.0, "wrong_answer", 2, 3, 4)
    assert verdict.reason == "test 2: expected '10', got '25'"
    partial = score_code(sandbox.get(), right_on_three, ADD,
                         CodeRewardConfig(partial_credit=True, test_timeout_s=1.0))
    assert (partial.score, partial.tests_passed, partial.tests_run) == (0.75, 3, 4)


def test_only_the_first_max_tests_run(sandbox: SandboxHandle) -> None:
    wrong_on_last = fenced("a, b = map(int, input().split())\nprint(a + b if a else 1)")
    assert score_code(sandbox.get(), wrong_on_last, ADD, FAST).score == 0.0
    capped = score_code(sandbox.get(), wrong_on_last, ADD,
                        CodeRewardConfig(max_tests=3, test_timeout_s=1.0))
    assert (capped.score, capped.tests_run, capped.tests_total) == (1.0, 3, 3)


def test_the_time_budget_ends_a_sample_and_the_tests_left_fail(sandbox: SandboxHandle) -> None:
    slow = fenced("import time\ntime.sleep(0.4)\nprint(sum(map(int, input().split())))")
    verdict = score_code(sandbox.get(), slow, ADD,
                         CodeRewardConfig(partial_credit=True, test_timeout_s=5.0), budget_s=1.0)
    assert verdict.kind == "timeout"
    assert 1 <= verdict.tests_passed <= 2 and verdict.score == verdict.tests_passed / 4


class ScriptedSandbox:
    """Answers every run with one canned ``Execution``; keeps the limits it was given."""

    def __init__(self, **execution: Any) -> None:
        self.execution = Execution(**{"exit_code": None, "stdout": "", "stderr": "",
                                      "wall_s": 0.0, **execution})
        self.calls: list[Limits | None] = []

    def run(self, program: str, *, stdin: str = "", limits: Limits | None = None,
            files: object = None) -> Execution:
        self.calls.append(limits)
        return self.execution

    async def arun(self, program: str, **kwargs: Any) -> Execution:
        return self.run(program, **kwargs)

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("execution", "kind", "reason"), [
    ({"status": "memory", "reason": "over 1024 MB"}, "memory", "test 0: over 1024 MB"),
    ({"status": "timeout", "reason": "wall 1 s"}, "timeout", "test 0: wall 1 s"),
    ({"status": "killed", "reason": "signal 9", "exit_code": -9}, "runtime_error",
     "test 0: killed: signal 9"),
    ({"status": "error", "exit_code": 1, "stderr": "Traceback...\nValueError: bad\n"},
     "runtime_error", "test 0: ValueError: bad"),
    ({"status": "ok", "exit_code": 0, "stdout": "4"}, "wrong_answer",
     "test 0: expected '3', got '4'"),
])
def test_each_sandbox_status_is_a_failure_kind_with_its_reason(
        execution: dict[str, Any], kind: str, reason: str) -> None:
    fake = ScriptedSandbox(**execution)
    verdict = score_code(fake, fenced("print(4)"), ADD, CodeRewardConfig(test_timeout_s=2.0),
                         base=Limits(memory_mb=64, processes=3))
    assert (verdict.score, verdict.kind, verdict.reason) == (0.0, kind, reason)
    assert fake.calls == [Limits(cpu_s=2.0, wall_s=2.0, memory_mb=64, processes=3)]


def test_no_test_starts_once_the_budget_is_spent() -> None:
    fake = ScriptedSandbox(status="ok", exit_code=0, stdout="3")
    verdict = score_code(fake, fenced("print(3)"), ADD, FAST, budget_s=0.0)
    assert (verdict.kind, verdict.tests_run, fake.calls) == ("timeout", 0, [])
    assert verdict.reason == "test 0: the sample's time budget (0 s) ran out after 0 of 4 tests"


def test_a_sandbox_error_raises_so_the_sample_gets_an_error_not_a_verdict() -> None:
    fake = ScriptedSandbox(status="sandbox_error", reason="server unreachable")
    with pytest.raises(SandboxFailure, match="server unreachable"):
        score_code(fake, fenced("print(3)"), ADD, FAST)


def test_a_sandbox_that_cannot_start_is_a_sandbox_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(settings: SandboxSettings) -> None:
        raise OSError("no /proc")

    monkeypatch.setattr(code, "make_sandbox", broken)
    with pytest.raises(SandboxFailure, match="cannot start the sandbox: OSError: no /proc"):
        SandboxHandle().get()


def test_a_verdict_as_a_reward_has_the_counts_and_one_flag_per_failure_kind() -> None:
    reward = code.CodeVerdict(0.5, "timeout", "why", 2, 3, 4).as_reward()
    assert reward == {"score": 0.5, "tests_passed": 2.0, "tests_run": 3.0, "tests_total": 4.0,
                      **{kind: float(kind == "timeout") for kind in FAILURE_KINDS}}
    assert set(FAILURE_KINDS) == {"no_code", "syntax_error", "runtime_error", "timeout",
                                  "memory", "wrong_answer"}


def test_code_sources_are_known() -> None:
    check_data_sources(["codecontests", "apps", "taco", "codeforces", "prime_code",
                        "primeintellect", "livecodebench", "humaneval"])


@pytest.mark.timeout(120)
def test_a_codecontests_run_scores_in_the_reward_worker_through_its_sandbox() -> None:
    right, wrong = fenced("print(sum(map(int, input().split())))"), fenced("print(0)")
    items = [RewardItem("codecontests", right, json.dumps(ADD)),
             RewardItem("codecontests", wrong, ADD),
             RewardItem("apps", right, {"inputs": ["1"]})]
    with RewardScorer(RewardConfig(timeout_s=20.0), SandboxSettings(workers=1)) as scorer:
        scorer.check_data_sources(["codecontests", "apps"])
        first, second, third = scorer.score(items)
    assert (first.score, first.error, first.info["tests_passed"]) == (1.0, "", 4.0)
    assert (second.score, second.error, second.info["wrong_answer"]) == (0.0, "", 1.0)
    assert third.score == 0.0 and "BadGroundTruth: code ground truth needs lists" in third.error


@pytest.mark.timeout(120)
def test_a_sandbox_that_fails_gives_the_sample_an_error_in_the_reward_worker() -> None:
    unreachable = SandboxSettings(sandbox_fusion=SandboxFusionConfig(
        url="http://127.0.0.1:9/run_code", retries=0))
    with RewardScorer(RewardConfig(timeout_s=20.0), unreachable) as scorer:
        (result,) = scorer.score([RewardItem("taco", fenced("print(3)"), ADD)])
    assert result.score == 0.0
    assert result.error.startswith("SandboxFailure: the sandbox failed to run a test")


def test_the_handle_knows_the_sandboxs_own_limits_sandbox_fusion_memory_included() -> None:
    fusion = SandboxSettings(sandbox_fusion=SandboxFusionConfig(
        url="http://127.0.0.1:9/run_code", memory_limit_mb=300))
    handle = SandboxHandle(fusion)
    assert handle.limits == fusion.limits  # nothing made yet
    handle.get()
    assert handle.limits.memory_mb == 300
    handle.close()


def test_the_code_section_of_the_reward_config() -> None:
    config = msgspec.convert({"code": {"partial_credit": True, "max_tests": 5}}, RewardConfig)
    assert config.code == CodeRewardConfig(partial_credit=True, max_tests=5)
    with pytest.raises(msgspec.ValidationError, match="test_timeout_s"):
        msgspec.convert({"code": {"test_timeout_s": 0}}, RewardConfig)
    with pytest.raises(ValueError, match="code.test_timeout_s must be a finite"):
        CodeRewardConfig(test_timeout_s=float("inf"))


class CountingSandbox(ScriptedSandbox):
    """Answers "3" after a short sleep, counting the most runs in flight at once."""

    def __init__(self) -> None:
        super().__init__(status="ok", exit_code=0, stdout="3")
        self.in_flight = self.most = 0
        self.lock = threading.Lock()

    def run(self, program: str, **kwargs: Any) -> Execution:
        with self.lock:
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
        time.sleep(0.05)
        with self.lock:
            self.in_flight -= 1
        return super().run(program, **kwargs)


def test_tests_run_in_waves_as_wide_as_the_sandbox() -> None:
    assert SandboxHandle(SandboxSettings(workers=3)).concurrency == 3
    assert SandboxHandle(SandboxSettings(sandbox_fusion=SandboxFusionConfig(
        url="http://h:1/run_code", max_concurrent=7))).concurrency == 7
    many = {"inputs": ["1 2"] * 10, "outputs": ["3"] * 10}
    fake = CountingSandbox()
    verdict = score_code(fake, fenced("print(3)"), many, FAST, parallel=4)
    assert (verdict.score, verdict.tests_run, len(fake.calls), fake.most) == (1.0, 10, 10, 4)


def test_all_or_nothing_stops_after_the_wave_with_the_first_failure(
        sandbox: SandboxHandle) -> None:
    cases = {"inputs": [str(n) for n in range(6)], "outputs": ["0", "1", "x", "3", "4", "5"]}
    verdict = score_code(sandbox.get(), fenced("print(input())"), cases, FAST, parallel=2)
    assert (verdict.score, verdict.kind, verdict.tests_passed, verdict.tests_run) == (
        0.0, "wrong_answer", 3, 4)
    assert verdict.reason == "test 2: expected 'x', got '2'"
