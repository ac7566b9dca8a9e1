"""Reward of Relay's embedded arithmetic task (``relay.algorithms.tasks.arithmetic``).

Rule: take the FIRST ``<answer>...</answer>`` span of the completion (from the first
``<answer>`` to the first ``</answer>`` after it). The completion is well formed iff the
span's content, stripped of surrounding whitespace, is an ASCII integer (``-?[0-9]+``) and
the completion ends with the span (only whitespace after its ``</answer>``); it is correct
iff it is well formed and the integer equals the ground truth (a decimal string)::

    format_ok = 1.0 if the span exists, holds an integer and ends the completion else 0.0
    score     = 1.0 if format_ok and int(content) == int(ground_truth) else 0.0

The answer ends the completion, so the model can neither hedge by writing several answers
nor pad a right answer with tokens the reward ignores: under a rule blind to what follows
the answer, runs of both TRL and Relay drifted into repeating ``</answer>`` up to the
length limit (2.5x the tokens of a step, and lower held-out accuracy). The scan is two
``str.find`` calls: linear in the completion's length, which is why the scorer may run it
in the caller's process.
"""

from __future__ import annotations

import re

OPEN_TAG = "<answer>"
CLOSE_TAG = "</answer>"
_INTEGER = re.compile(r"-?[0-9]+")  # ASCII digits only: int() would also accept "٣"


def first_answer(solution_str: str) -> str | None:
    """The stripped content of the first ``<answer>...</answer>`` span, or None when there
    is none or anything but whitespace follows it."""
    start = solution_str.find(OPEN_TAG)
    if start < 0:
        return None
    start += len(OPEN_TAG)
    end = solution_str.find(CLOSE_TAG, start)
    if end < 0 or solution_str[end + len(CLOSE_TAG):].strip():
        return None
    return solution_str[start:end].strip()


def compute_score(solution_str: str, ground_truth: str) -> dict[str, float]:
    """``{"score", "format_ok"}`` of one completion; see the module docstring for the rule.

    Raises ValueError when ``ground_truth`` is not an integer (a data bug, not a wrong
    answer: the scorer reports it as the sample's error).
    """
    expected = int(str(ground_truth).strip())
    content = first_answer(solution_str)
    if content is None or _INTEGER.fullmatch(content) is None:
        return {"score": 0.0, "format_ok": 0.0}
    return {"score": float(int(content) == expected), "format_ok": 1.0}
