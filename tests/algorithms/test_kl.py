"""KL estimators k1, abs, k2, k3 against hand-computed values."""

import math

import pytest
import torch

from algorithms.kl import kl_penalty

LOGP = torch.tensor([0.5, -0.5])
REF = torch.zeros(2)


@pytest.mark.parametrize("kind, expected", [
    ("kl", [0.5, -0.5]),
    ("k1", [0.5, -0.5]),
    ("abs", [0.5, 0.5]),
    ("mse", [0.125, 0.125]),
    ("k2", [0.125, 0.125]),
    ("low_var_kl", [math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5]),
    ("k3", [math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5]),
])
def test_estimators(kind: str, expected: list[float]) -> None:
    torch.testing.assert_close(kl_penalty(LOGP, REF, kind), torch.tensor(expected))


def test_k3_is_clamped() -> None:
    assert kl_penalty(torch.tensor([-30.0]), torch.zeros(1), "k3").item() == 10.0


def test_unknown_estimator_is_named() -> None:
    with pytest.raises(ValueError, match="'k9'"):
        kl_penalty(LOGP, REF, "k9")  # type: ignore[arg-type]
