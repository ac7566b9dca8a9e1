"""GSM8K reward, following verl's ``verl/utils/reward_score/gsm8k.py`` (ReFT's rule).

Extraction looks only at the last ``CLIP_CHARS`` characters of the completion (verl does
the same to bound regex cost; the final answer is at the end):

- ``strict``: every ``#### <number>`` match, where a number is ``-?[0-9.,]+``; the LAST
  one is the answer. This also checks the format the GSM8K prompt asks for.
- ``flexible``: the last ``-?[0-9.,]+`` anywhere in the clipped text.

The extracted number is normalized by removing thousands separators (``1,000`` ->
``1000``, as verl does) and trailing dots. Departure from verl: verl keeps a trailing dot,
so ``#### 72.`` or "... is 72." scores 0 against ``72``; a sentence's full stop is not part
of the answer, so Relay drops it. Comparison is then exact string equality with the ground
truth (verl's data preparation stores it without commas)::

    score = 1.0            if answer == ground_truth
            format_score   if an answer was extracted but differs   (verl; default 0.0)
            0.0            if nothing was extracted
    format_ok = 1.0 if an answer was extracted else 0.0
"""

from __future__ import annotations

import re
from typing import Literal

CLIP_CHARS = 300
_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_NUMBER = re.compile(r"-?[0-9.,]+")

Method = Literal["strict", "flexible"]


def _normalize(number: str) -> str:
    return number.replace(",", "").rstrip(".")


def extract_answer(solution_str: str, method: Method = "strict") -> str | None:
    """The normalized final answer of a completion, or None when there is none."""
    tail = solution_str[-CLIP_CHARS:]
    if method == "strict":
        matches = _STRICT.findall(tail)
    elif method == "flexible":
        matches = _NUMBER.findall(tail)
    else:
        raise ValueError(f"unknown GSM8K extraction method {method!r}; use 'strict' or 'flexible'")
    for match in reversed(matches):
        answer = _normalize(match)
        if answer:  # "." or "," alone are punctuation, not numbers
            return answer
    return None


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: Method = "strict",
    format_score: float = 0.0,
) -> dict[str, float]:
    """``{"score", "format_ok"}`` of one completion; see the module docstring for the rule."""
    answer = extract_answer(solution_str, method)
    if answer is None:
        return {"score": 0.0, "format_ok": 0.0}
    return {"score": 1.0 if answer == str(ground_truth) else format_score, "format_ok": 1.0}
