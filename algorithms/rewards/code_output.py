"""Whether a program's output is the expected one, with the tolerance code judges use.

stdout (APPS / verl's ``prime_code``): lines are compared after stripping each and dropping
blank ones, so trailing spaces and a missing final newline do not matter; within a line,
tokens (split on whitespace) must be equal, or, where the expected token is not an integer,
numbers within ``|a - b| <= ATOL + RTOL * |b|`` of it (numpy's ``allclose`` rule, verl's),
so ``0.5`` and ``0.50000`` agree. An expected integer must be printed as that text: unlike
verl, ``3.0`` is not ``3``, and ``10**17 + 1`` is not ``10**17`` (their floats are equal).

Return values (call-based): equal after JSON (tuples are lists), floats within the same
tolerance at any depth, and APPS's wrapping: an expected ``[v]`` also accepts ``v``.
"""

from __future__ import annotations

import math
from typing import Any

RTOL = 1e-5
ATOL = 1e-8


def _close(actual: float, expected: float) -> bool:
    return abs(actual - expected) <= ATOL + RTOL * abs(expected)


def _number(token: str) -> float | None:
    try:
        value = float(token)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _is_int(token: str) -> bool:
    return token.lstrip("+-").isdigit()


def _tokens_match(actual: str, expected: str) -> bool:
    if actual == expected:
        return True
    if _is_int(expected):
        return False
    a, e = _number(actual), _number(expected)
    return a is not None and e is not None and _close(a, e)


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def stdout_matches(actual: str, expected: str) -> bool:
    """Whether stdout ``actual`` is ``expected`` up to whitespace and float formatting."""
    got, want = _lines(actual), _lines(expected)
    if got == want:
        return True
    if len(got) != len(want):
        return False
    for got_line, want_line in zip(got, want, strict=True):
        got_tokens, want_tokens = got_line.split(), want_line.split()
        if len(got_tokens) != len(want_tokens) or not all(
                _tokens_match(a, e) for a, e in zip(got_tokens, want_tokens, strict=True)):
            return False
    return True


def _values_match(actual: Any, expected: Any) -> bool:
    if isinstance(actual, bool) or isinstance(expected, bool):
        return actual is expected
    if isinstance(actual, (int, float)) and isinstance(expected, (int, float)):
        if isinstance(actual, int) and isinstance(expected, int):
            return actual == expected
        return math.isfinite(actual) and math.isfinite(expected) and _close(actual, expected)
    if isinstance(actual, list) and isinstance(expected, list):
        return len(actual) == len(expected) and all(
            _values_match(a, e) for a, e in zip(actual, expected, strict=True))
    if isinstance(actual, dict) and isinstance(expected, dict):
        return actual.keys() == expected.keys() and all(
            _values_match(actual[key], expected[key]) for key in actual)
    return bool(actual == expected)


def value_matches(actual: Any, expected: Any) -> bool:
    """Whether return value ``actual`` (decoded from JSON) is ``expected``."""
    if _values_match(actual, expected):
        return True
    return isinstance(expected, list) and len(expected) == 1 and _values_match(actual, expected[0])
