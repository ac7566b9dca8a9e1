"""Math reward: the last ``\\boxed{...}`` of the completion, checked with Math-Verify.

Rule (verl's ``math_verify.compute_score`` in spirit, with an explicit extraction step)::

    answer    = content of the LAST \\boxed{...} (braces balanced), else none
    score     = 1.0 if verify(parse(\\boxed{ground_truth}), parse(\\boxed{answer})) else 0.0
    format_ok = 1.0 if a complete \\boxed{...} was found else 0.0

``parse`` / ``verify`` are ``math_verify``'s: LaTeX and plain expressions become SymPy
objects and are compared numerically and symbolically, so ``\\frac{1}{2}`` matches
``0.5`` and ``(x+1)^2`` matches ``x^2+2x+1``. A truncated ``\\boxed{`` without its closing
brace is no answer (as verl's ``last_boxed_only_string``).

Math-Verify's own signal-based time limits are turned off: they only work in a main
thread, and ``RewardScorer`` already bounds each call by killing its worker process. SymPy
can take unbounded time on adversarial input, so this scorer is never run in-process
(``registry.runs_in_process``). ``math_verify`` (and SymPy) are imported on first use, so
importing this package stays cheap for callers that never score math.

Note for DAPO / AIME data: verl's ``math_dapo`` scorer reads ``Answer: ...`` lines and
pays +1 / -1; this scorer pays 1 / 0 for a boxed answer, so prompts must ask for
``\\boxed{}`` (or use a custom reward function for verl's exact rule).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

BOXED = "\\boxed{"


class _DropTimeoutNotice(logging.Filter):
    """Math-Verify warns once per process that its time limits are off; here they are off
    on purpose (see the module docstring), and every worker restart would repeat it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


@functools.cache
def _math_verify() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``math_verify``'s ``(parse, verify)``, imported on first use (SymPy: ~1 s)."""
    from math_verify import parse, verify

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_DropTimeoutNotice())
    return parse, verify


def last_boxed(solution_str: str) -> str | None:
    """The content of the last complete ``\\boxed{...}`` (nested braces allowed), or None."""
    start = solution_str.rfind(BOXED)
    if start < 0:
        return None
    depth = 1
    begin = start + len(BOXED)
    for index in range(begin, len(solution_str)):
        char = solution_str[index]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return solution_str[begin:index]
    return None


def compute_score(solution_str: str, ground_truth: str) -> dict[str, float]:
    """``{"score", "format_ok"}`` of one completion; see the module docstring for the rule.

    Raises ValueError when the ground truth itself cannot be parsed (a data bug).
    """
    parse, verify = _math_verify()
    gold = parse(BOXED + str(ground_truth) + "}", parsing_timeout=None)
    if not gold:
        raise ValueError(f"math_verify cannot parse the ground truth {ground_truth!r}")
    answer = last_boxed(solution_str)
    if answer is None:
        return {"score": 0.0, "format_ok": 0.0}
    predicted = parse(BOXED + answer + "}", parsing_timeout=None)
    return {"score": float(verify(gold, predicted, timeout_seconds=None)), "format_ok": 1.0}
