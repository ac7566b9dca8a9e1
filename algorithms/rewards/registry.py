"""Which built-in reward scores which ``data_source`` (verl's names where verl has them).

``default_compute_score`` has verl's signature, ``(data_source, solution_str, ground_truth,
extra_info)``, so a custom reward function can fall back to it for the sources it does not
handle, as verl users do with ``verl.utils.reward_score.default_compute_score``.

This module knows names and routing; each rule lives in its own module (``arithmetic``,
``gsm8k``, ``boxed_math``, ``code``). It knows nothing of processes or time limits
(``scorer``); the code rules are handed their sandbox and time budget.
"""

from __future__ import annotations

import atexit
import functools
from collections.abc import Iterable
from typing import Any, Literal

from relay.algorithms.rewards import arithmetic, boxed_math, gsm8k
from relay.algorithms.rewards.code import (
    CodeRewardConfig,
    SandboxHandle,
    score_code,
    score_humaneval,
)

Family = Literal["arithmetic", "gsm8k", "math", "code", "humaneval"]

_EXACT: dict[str, Family] = {
    "relay/arithmetic": "arithmetic",
    "relay/arithmetic-tools": "arithmetic",  # the same <answer>N</answer> rule, after a tool call
    "openai/gsm8k": "gsm8k",
    "gsm8k": "gsm8k",
    # verl's MATH sources (verl/utils/reward_score/__init__.py) and common MATH sets
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "math_dapo": "math",
    # verl scores these with prime_math, also a last-\boxed rule
    "numina_aops_forum": "math",
    "numina_synthetic_math": "math",
    "numina_amc_aime": "math",
    "numina_synthetic_amc": "math",
    "numina_cn_k12": "math",
    "numina_olympiads": "math",
    # tests run in the sandbox: verl's default_compute_score names (prime_code's scorer),
    # PRIME's and DeepCoder's sources
    "codecontests": "code",
    "apps": "code",
    "taco": "code",
    "codeforces": "code",
    "prime_code": "code",
    "primeintellect": "code",
    "livecodebench": "code",
    # a check(candidate) program (OpenAI's HumanEval form)
    "humaneval": "humaneval",
    "openai_humaneval": "humaneval",
    "openai/openai_humaneval": "humaneval",
}
_PREFIXES: dict[str, Family] = {"aime": "math"}  # verl: data_source.startswith("aime")

# Linear-time string scans: safe to run without a time limit in the caller's process.
_IN_PROCESS_FAMILIES: frozenset[Family] = frozenset({"arithmetic", "gsm8k"})


class UnknownDataSourceError(ValueError):
    """No built-in reward for a data_source, and no custom reward function configured."""


def known_data_sources() -> list[str]:
    """Every built-in data_source name; prefixes are shown as ``aime*``."""
    return [*_EXACT, *(f"{prefix}*" for prefix in _PREFIXES)]


def family_of(data_source: str) -> Family | None:
    """The built-in rule that scores ``data_source``, or None when there is none."""
    family = _EXACT.get(data_source)
    if family is not None:
        return family
    for prefix, prefixed_family in _PREFIXES.items():
        if data_source.startswith(prefix):
            return prefixed_family
    return None


def runs_in_process(data_source: str) -> bool:
    """Whether the built-in rule for ``data_source`` is cheap and bounded (regex/find only)."""
    return family_of(data_source) in _IN_PROCESS_FAMILIES


def preload_builtins() -> None:
    """Import and warm the built-in rules' heavy dependencies now (Math-Verify, SymPy:
    about a second), so that no sample's time limit is spent on them."""
    boxed_math.compute_score("\\boxed{1}", "1")


def check_data_sources(sources: Iterable[str]) -> None:
    """Raise ``UnknownDataSourceError`` naming every source without a built-in reward.

    Call it at start-up with the dataset's data_source values, so a typo fails the run
    before any generation instead of turning into errors on every sample.
    """
    unknown = sorted({source for source in sources if family_of(source) is None})
    if unknown:
        raise _unknown(unknown)


def _unknown(sources: list[str]) -> UnknownDataSourceError:
    return UnknownDataSourceError(
        f"no built-in reward function for data_source {', '.join(map(repr, sources))}; "
        f"built-in: {', '.join(known_data_sources())}. For another source, configure a "
        "custom reward function ('module:function' or 'path/to/file.py:function' with "
        "verl's compute_score(data_source, solution_str, ground_truth, extra_info))"
    )


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    *,
    gsm8k_method: gsm8k.Method = "strict",
    gsm8k_format_score: float = 0.0,
    code: CodeRewardConfig | None = None,
    sandbox: SandboxHandle | None = None,
    budget_s: float | None = None,
) -> dict[str, float]:
    """Score one completion with the built-in rule for its data_source.

    Returns ``{"score", ...}`` (the rule's other entries: ``format_ok``; for code the counts
    and failure kinds of ``code.CodeVerdict.as_reward``); ``extra_info`` is accepted for
    verl's signature and unused by the built-in rules. Code sources run in ``sandbox``
    (default: this process's shared one, local with default settings) under ``code``'s
    limits, as many at once as the sandbox runs, all of a sample's tests within
    ``budget_s`` seconds (None: no overall limit).
    Raises ``UnknownDataSourceError`` for an unknown source; a code source raises
    ``code.SandboxFailure`` or ``code_tests.BadGroundTruth`` when the sample cannot be judged.
    """
    family = family_of(data_source)
    if family == "arithmetic":
        return arithmetic.compute_score(solution_str, ground_truth)
    if family == "gsm8k":
        return gsm8k.compute_score(
            solution_str, ground_truth, method=gsm8k_method, format_score=gsm8k_format_score
        )
    if family == "math":
        return boxed_math.compute_score(solution_str, ground_truth)
    if family in ("code", "humaneval"):
        handle = sandbox if sandbox is not None else _shared_sandbox()
        config = code if code is not None else CodeRewardConfig()
        if family == "code":
            verdict = score_code(handle.get(), solution_str, ground_truth, config, budget_s,
                                 handle.limits, parallel=handle.concurrency)
        else:
            verdict = score_humaneval(handle.get(), solution_str, ground_truth, config,
                                      budget_s, handle.limits)
        return verdict.as_reward()
    raise _unknown([data_source])


@functools.cache
def _shared_sandbox() -> SandboxHandle:
    """The sandbox of code rewards scored without one (a custom function falling back to
    ``default_compute_score``): one per process, default settings, closed at exit."""
    handle = SandboxHandle()
    atexit.register(handle.close)
    return handle
