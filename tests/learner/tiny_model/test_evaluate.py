"""The pass@k estimator used by the held-out evaluation."""

from __future__ import annotations

import pytest

from relay.learner.tiny_model.evaluate import pass_at


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (8, 0, 1, 0.0),
        (8, 0, 8, 0.0),
        (8, 2, 1, 0.25),
        (8, 1, 8, 1.0),
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (8, 3, 4, 1 - 5 / 70),  # 1 - C(5,4)/C(8,4)
    ],
)
def test_pass_at_matches_the_unbiased_estimator(n, c, k, expected):
    assert pass_at(n, c, k) == pytest.approx(expected)
