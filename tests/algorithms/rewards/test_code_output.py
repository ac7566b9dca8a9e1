"""Output comparison of code rewards: whitespace, float formatting, APPS's wrapping."""

from __future__ import annotations

import pytest

from relay.algorithms.rewards.code_output import stdout_matches, value_matches


@pytest.mark.parametrize(("actual", "expected", "matches"), [
    ("3\n", "3", True),
    ("3   \n\n\n", "3\n", True),  # trailing spaces and blank lines
    ("  1 2\n3", "1 2\n3\n", True),
    ("1  2", "1 2", True),  # tokens, not characters
    ("0.5", "0.500000", True),
    ("1.3333333", "1.333333333", True),  # within 1e-5 relative
    ("2", "2.0", True),  # the expected value is a float
    ("1.33", "1.333333333", False),
    ("3.0", "3", False),  # an expected integer must be printed as one (verl accepts this)
    ("100000000000000001", "100000000000000000", False),  # equal as floats
    ("1 2", "1\n2", False),
    ("1\n2", "2\n1", False),
    ("yes", "YES", False),
    ("", "0", False),
    ("nan", "nan", True),
    ("nan", "1.0", False),
])
def test_stdout_matching(actual: str, expected: str, matches: bool) -> None:
    assert stdout_matches(actual, expected) is matches


@pytest.mark.parametrize(("actual", "expected", "matches"), [
    ([0, 1], [0, 1], True),
    (6, [6], True),  # APPS wraps the return value in a list
    ([6], [6], True),
    (6, [6, 7], False),
    (2.0000000001, 2.0, True),
    ({"a": [1.0, 2]}, {"a": [1.0000000001, 2]}, True),
    ({"a": 1}, {"b": 1}, False),
    (True, 1, False),  # a bool is not a number here
    (1, True, False),
    (1, 1.0, True),
    ("6", 6, False),
    (None, None, True),
    ([1, 2], [1, 2, 3], False),
])
def test_return_value_matching(actual: object, expected: object, matches: bool) -> None:
    assert value_matches(actual, expected) is matches
