"""Code rewards: run a response's solution on its problem's tests in the sandbox.

Data sources ``codecontests``, ``apps``, ``taco``, ``codeforces``, ``prime_code``,
``primeintellect``, ``livecodebench`` (tests: ``code_tests.parse_tests``) and ``humaneval``
(a check program: ``code_tests.parse_check``). Each test is one sandbox execution under
``CodeRewardConfig``'s limits; the reward is::

    score = 1.0 if every test run passes else 0.0            (default; stops at a failure)
    score = passed / tests_total                              (partial_credit = true)

with ``tests_total = min(len(tests), max_tests)``. verl scores these sources with partial
credit (``prime_code``'s ``continuous=True``, its first 10 tests); Relay's default is
all-or-nothing, so a half-working solution does not look half right.

What the policy got wrong is an outcome, not an error of the reward function: the score is
0 and ``info`` says which (``no_code``, ``syntax_error``, ``runtime_error``, ``timeout``,
``memory``, ``wrong_answer``: 1.0 for the first failure's kind, else 0.0; ``tests_passed``,
``tests_run``, ``tests_total``); ``CodeVerdict.reason`` has the words. A sandbox that fails
(``sandbox_error``) or a malformed ground truth raises (``SandboxFailure``,
``BadGroundTruth``): the reward worker turns that into the sample's ``error``, counted as a
failing reward function, since the 0 is not the policy's.

A sample's tests stop when its time budget (the reward worker's per-sample limit, less a
margin) is spent; the tests left count as not passed, with kind ``timeout``.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Literal, get_args

import msgspec

from relay.algorithms.rewards.code_output import stdout_matches, value_matches
from relay.algorithms.rewards.code_programs import (
    call_program,
    call_result,
    call_stdin,
    Extracted,
    extract_code,
    humaneval_program,
    stdio_program,
    syntax_error,
)
from relay.algorithms.rewards.code_tests import (
    Case,
    CheckProgram,
    CodeTests,
    parse_check,
    parse_tests,
)
from relay.algorithms.sandbox import Execution, Limits, Sandbox, SandboxSettings, make_sandbox
from relay.algorithms.user_code import describe

Kind = Literal["pass", "no_code", "syntax_error", "runtime_error", "timeout", "memory",
               "wrong_answer"]
FAILURE_KINDS: tuple[Kind, ...] = get_args(Kind)[1:]
_SHOWN_CHARS = 120  # of an output or an error line, in a reason
_MIN_TEST_S = 0.05  # a test is not started with less budget than this left


class SandboxFailure(RuntimeError):
    """The sandbox could not run a test (its ``sandbox_error``); not the policy's fault."""


class CodeRewardConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How code responses are tested (*Relay*; ``custom_reward_function.code``).

    - ``partial_credit``: score the fraction of tests passed instead of all-or-nothing
      (verl's ``continuous``); then every test runs, not only those up to the first failure.
    - ``test_timeout_s``: CPU and wall-clock limit of one test's execution; its other
      limits (memory, processes, output) are the sandbox's (``sandbox.limits``, or
      ``sandbox.sandbox_fusion.memory_limit_mb`` for SandboxFusion).
    - ``max_tests``: at most this many of a problem's tests run (the first ones).
    """

    partial_credit: bool = False
    test_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    max_tests: Annotated[int, msgspec.Meta(gt=0)] = 32

    def __post_init__(self) -> None:
        if not 0 < self.test_timeout_s < float("inf"):
            raise ValueError("custom_reward_function.code.test_timeout_s must be a finite "
                             f"number of seconds > 0, got {self.test_timeout_s!r}")
        if self.max_tests < 1:
            raise ValueError(f"custom_reward_function.code.max_tests must be >= 1, "
                             f"got {self.max_tests!r}")

    def limits(self, wall_s: float, base: Limits) -> Limits:
        """One test's sandbox limits: ``base`` with CPU and wall clock ``test_timeout_s``,
        cut to ``wall_s``."""
        seconds = min(self.test_timeout_s, wall_s)
        return msgspec.structs.replace(base, cpu_s=seconds, wall_s=seconds)


class CodeVerdict(msgspec.Struct, frozen=True):
    """A response's result on a problem's tests; ``kind`` is the first failure's, or
    ``"pass"``; ``reason`` says what happened, for people."""

    score: float
    kind: Kind
    reason: str
    tests_passed: int = 0
    tests_run: int = 0
    tests_total: int = 0

    def as_reward(self) -> dict[str, float]:
        """verl's dict return: ``score`` plus the counts and one 0/1 entry per failure kind."""
        reward = {"score": self.score, "tests_passed": float(self.tests_passed),
                  "tests_run": float(self.tests_run), "tests_total": float(self.tests_total)}
        reward.update({kind: float(kind == self.kind) for kind in FAILURE_KINDS})
        return reward


class _Outcome(msgspec.Struct, frozen=True):
    kind: Kind
    reason: str = ""


_RunOne = Callable[[Sandbox, str, Case, Limits], _Outcome]  # one test's execution


def _cut(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return _cut(lines[-1]) if lines else ""


def _failed_run(execution: Execution) -> _Outcome | None:
    """The outcome of a run that did not finish cleanly; None when it exited 0."""
    status = execution.status
    if status == "ok":
        return None
    if status == "sandbox_error":
        raise SandboxFailure(f"the sandbox failed to run a test: {execution.reason}")
    if status in ("timeout", "memory"):
        return _Outcome(status, execution.reason or status)
    error = _last_line(execution.stderr) or execution.reason or f"exit code {execution.exit_code}"
    return _Outcome("runtime_error", error if status == "error" else f"{status}: {error}")


def _stdio_test(sandbox: Sandbox, program: str, case: Case, limits: Limits) -> _Outcome:
    execution = sandbox.run(program, stdin=case.given, limits=limits)
    failed = _failed_run(execution)
    if failed is not None:
        return failed
    if stdout_matches(execution.stdout, case.expected):
        return _Outcome("pass")
    return _Outcome("wrong_answer", f"expected {_cut(case.expected)!r}, "
                                    f"got {_cut(execution.stdout)!r}")


def _call_test(sandbox: Sandbox, program: str, case: Case, limits: Limits) -> _Outcome:
    nonce = secrets.token_hex(8)
    execution = sandbox.run(program, stdin=call_stdin(case.given, nonce), limits=limits)
    failed = _failed_run(execution)
    if failed is not None:
        return failed
    reported, value = call_result(execution.stdout, nonce)
    if not reported:
        return _Outcome("runtime_error", "the program ended before the call returned")
    if value_matches(value, case.expected):
        return _Outcome("pass")
    return _Outcome("wrong_answer", f"expected {_cut(repr(case.expected))}, "
                                    f"got {_cut(repr(value))}")


def _compile_verdict(solution: Extracted) -> CodeVerdict | None:
    """A zero verdict for a response without code or with code that does not compile (an
    unfenced response that does not compile is prose: no code)."""
    if not solution.code.strip():
        return CodeVerdict(0.0, "no_code", "the response holds no Python code")
    error = syntax_error(solution.code)
    if error is None:
        return None
    if not solution.fenced:
        return CodeVerdict(0.0, "no_code", f"no fenced Python block, and the text is not "
                                           f"Python ({error})")
    return CodeVerdict(0.0, "syntax_error", error)


def _wave(sandbox: Sandbox, program: str, run_one: _RunOne, cases: Sequence[Case],
          limits: Limits) -> list[_Outcome]:
    """The outcomes of ``cases``, run at once (each in a thread: ``Sandbox.run`` blocks)."""
    if len(cases) == 1:
        return [run_one(sandbox, program, cases[0], limits)]
    with ThreadPoolExecutor(max_workers=len(cases), thread_name_prefix="code-test") as pool:
        return list(pool.map(lambda case: run_one(sandbox, program, case, limits), cases))


def run_tests(sandbox: Sandbox, solution: Extracted, tests: CodeTests,
              config: CodeRewardConfig, budget_s: float | None = None,
              base: Limits | None = None, parallel: int = 1) -> CodeVerdict:
    """Run ``solution`` on ``tests`` (the first ``max_tests``), within ``budget_s`` s, each
    under ``config.limits`` over ``base`` (default: ``Limits()``), ``parallel`` at a time.

    Tests run in waves of ``parallel``; all-or-nothing scoring stops after the wave with the
    first failure (``tests_run`` counts the whole wave)."""
    not_runnable = _compile_verdict(solution)
    cases = tests.cases[: config.max_tests]
    if not_runnable is not None:
        return msgspec.structs.replace(not_runnable, tests_total=len(cases))
    run_one: _RunOne
    if tests.fn_name is None:
        program, run_one = stdio_program(solution.code), _stdio_test
    else:
        program, run_one = call_program(solution.code, tests.fn_name), _call_test
    deadline = None if budget_s is None else time.monotonic() + budget_s
    passed = run = 0
    first: _Outcome | None = None  # the first failure
    while run < len(cases) and (first is None or config.partial_credit):
        left = float("inf") if deadline is None else deadline - time.monotonic()
        if left < _MIN_TEST_S:
            first = first or _Outcome("timeout", f"test {run}: the sample's time budget "
                                                 f"({budget_s:g} s) ran out after {run} of "
                                                 f"{len(cases)} tests")
            break
        wave = cases[run: run + max(1, parallel)]
        outcomes = _wave(sandbox, program, run_one, wave, config.limits(left, base or Limits()))
        for index, outcome in enumerate(outcomes, start=run):
            if outcome.kind == "pass":
                passed += 1
            else:
                first = first or _Outcome(outcome.kind, f"test {index}: {outcome.reason}")
        run += len(wave)
    if first is None:
        return CodeVerdict(1.0, "pass", f"all {len(cases)} tests passed", passed, run,
                           len(cases))
    score = passed / len(cases) if config.partial_credit else 0.0
    return CodeVerdict(score, first.kind, first.reason, passed, run, len(cases))


def run_check(sandbox: Sandbox, completion: str, check: CheckProgram,
              config: CodeRewardConfig, budget_s: float | None = None,
              base: Limits | None = None) -> CodeVerdict:
    """Run HumanEval's check program on ``completion``: one test, passed when it exits 0."""
    program = humaneval_program(check.prompt, completion, check.test, check.entry_point)
    if not completion.strip():
        return CodeVerdict(0.0, "no_code", "the response holds no Python code", tests_total=1)
    error = syntax_error(program, "program.py")
    if error is not None:
        return CodeVerdict(0.0, "syntax_error", error, tests_total=1)
    wall_s = config.test_timeout_s if budget_s is None else budget_s
    outcome = _failed_run(sandbox.run(program, limits=config.limits(wall_s, base or Limits())))
    if outcome is None:
        return CodeVerdict(1.0, "pass", "check passed", 1, 1, 1)
    kind: Kind = "wrong_answer" if "AssertionError" in outcome.reason else outcome.kind
    return CodeVerdict(0.0, kind, outcome.reason, 0, 1, 1)


def score_code(sandbox: Sandbox, solution_str: str, ground_truth: Any,
               config: CodeRewardConfig, budget_s: float | None = None,
               base: Limits | None = None, parallel: int = 1) -> CodeVerdict:
    """The verdict on a response to a stdin/stdout or call-based problem."""
    return run_tests(sandbox, extract_code(solution_str), parse_tests(ground_truth), config,
                     budget_s, base, parallel)


def score_humaneval(sandbox: Sandbox, solution_str: str, ground_truth: Any,
                    config: CodeRewardConfig, budget_s: float | None = None,
                    base: Limits | None = None) -> CodeVerdict:
    """The verdict on a response to a HumanEval-style problem."""
    return run_check(sandbox, extract_code(solution_str).code, parse_check(ground_truth),
                     config, budget_s, base)


class SandboxHandle:
    """The sandbox of one process, made from ``settings`` on first use (so a process that
    never scores code never starts one) and closed by ``close``."""

    def __init__(self, settings: SandboxSettings | None = None) -> None:
        self.settings = settings if settings is not None else SandboxSettings()
        self._sandbox: Sandbox | None = None
        self._lock = threading.Lock()

    def get(self) -> Sandbox:
        """The sandbox; raises ``SandboxFailure`` when it cannot be made."""
        with self._lock:
            if self._sandbox is None:
                try:
                    self._sandbox = make_sandbox(self.settings)
                except Exception as exc:  # any failure to start is the sandbox's
                    raise SandboxFailure(f"cannot start the sandbox: {describe(exc)}") from exc
            return self._sandbox

    @property
    def limits(self) -> Limits:
        """The limits the sandbox applies to a call that passes none (SandboxFusion's memory
        included); the settings' own before the sandbox is made."""
        limits = getattr(self._sandbox, "limits", None)
        return limits if isinstance(limits, Limits) else self.settings.limits

    @property
    def concurrency(self) -> int:
        """How many programs the sandbox runs at once: the local pool's ``workers``, or
        SandboxFusion's ``max_concurrent``."""
        fusion = self.settings.sandbox_fusion
        return fusion.max_concurrent if fusion.url else self.settings.workers

    def close(self) -> None:
        """Close the sandbox if one was made; idempotent."""
        with self._lock:
            sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None:
            sandbox.close()
