"""Reward of Relay's embedded arithmetic task (``algorithms.tasks.arithmetic``).

Rule: take the FIRST ``<answer>...</answer>`` span of the completion (from the first
``<answer>`` to the first ``</answer>`` after it). The completion is correct iff the span's
content, stripped of surrounding whitespace, is an ASCII integer (``-?[0-9]+``) whose value
equals the ground truth (a decimal string)::

    score     = 1.0 if int(content) == int(ground_truth) else 0.0
    format_ok = 1.0 if a span exists and its content is an integer else 0.0

A later span never rescues or spoils the first one, so the model cannot hedge by writing
several answers. The scan is two ``str.find`` calls: linear in the completion's length,
which is why the scorer may run it in the caller's process.
"""

from __future__ import annotations

import re

OPEN_TAG = "<answer>"
CLOSE_TAG = "</answer>"
_INTEGER = re.compile(r"-?[0-9]+")  # ASCII digits only: int() would also accept "٣"


def first_answer(solution_str: str) -> str | None:
    """The stripped content of the first ``<answer>...</answer>`` span, or None."""
    start = solution_str.find(OPEN_TAG)
    if start < 0:
        return None
    start += len(OPEN_TAG)
    end = solution_str.find(CLOSE_TAG, start)
    if end < 0:
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
