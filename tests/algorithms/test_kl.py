"""KL estimators, KL-in-reward penalty and KL controllers against hand-computed values."""

import math

import pytest
import torch

from relay.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    KLControlConfig,
    kl_penalty,
    kl_reward_penalty,
    make_kl_controller,
)

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


@pytest.mark.parametrize("kind", ["k3+", "low_var_kl+"])
def test_straight_through_has_k3s_value_and_k2s_gradient(kind: str) -> None:
    logp = LOGP.clone().requires_grad_()
    value = kl_penalty(logp, REF, kind)
    # value: k3 at d = 0.5, -0.5; gradient of k2 = d^2 / 2 is d
    torch.testing.assert_close(value.detach(),
                               torch.tensor([math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5]))
    value.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([0.5, -0.5]))


def test_k3_is_clamped() -> None:
    assert kl_penalty(torch.tensor([-30.0]), torch.zeros(1), "k3").item() == 10.0


@pytest.mark.parametrize("kind", ["k3", "low_var_kl", "k3+"])
def test_k3_gradient_is_finite_past_fp32_overflow(kind: str) -> None:
    # d = logp - ref = [-0.1, -99.9 (masked), 94.9]: exp(-d) overflows fp32 at d < -88.7
    # unless d is first clamped to [-20, 20]. Clamped, the masked token and the +94.9 token
    # sit on the clamp (k3 there: exp(20) - 21 -> 10, and exp(-20) + 19 -> 10): gradient 0.
    # The first token: k3 = exp(0.1) - 1.1, gradient d k3 / d logp = 1 - exp(-d) = 1 - e^0.1
    # (k3+ takes k2's gradient d = -0.1 there, and 0 on the masked token).
    logprobs = torch.tensor([[-0.5, -100.0, -0.1]], requires_grad=True)
    ref = torch.tensor([[-0.4, -0.1, -95.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    kl = kl_penalty(logprobs, ref, kind)
    (grad,) = torch.autograd.grad((kl * mask).sum(), logprobs)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(kl.detach()[:, 0], torch.tensor([math.exp(0.1) - 1.1]))
    first = -0.1 if kind == "k3+" else 1.0 - math.exp(0.1)
    third = 94.9 if kind == "k3+" else 0.0
    torch.testing.assert_close(grad, torch.tensor([[first, 0.0, third]]))


def test_unknown_estimator_is_named() -> None:
    with pytest.raises(ValueError, match="'k9'"):
        kl_penalty(LOGP, REF, "k9")  # type: ignore[arg-type]


# --- KL in the reward: 2x3 batch, row 0 has 2 response tokens, row 1 has 1 -------------
# d = logp - ref: row 0 = [1.0, 0.5, (2.0 masked)], row 1 = [-0.5, (3.0, 3.0 masked)]
PEN_LOGP = torch.tensor([[1.0, 0.5, 2.0], [0.0, 3.0, 3.0]])
PEN_REF = torch.tensor([[0.0, 0.0, 0.0], [0.5, 0.0, 0.0]])
PEN_MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_reward_penalty_k1() -> None:
    rewards, seq_kl = kl_reward_penalty(PEN_LOGP, PEN_REF, PEN_MASK, 0.1, "kl")
    # -0.1 * [1.0, 0.5, 0] and -0.1 * [-0.5, 0, 0]
    torch.testing.assert_close(rewards, torch.tensor([[-0.1, -0.05, 0.0], [0.05, 0.0, 0.0]]))
    # (1.0 + 0.5) / 2 = 0.75 ; -0.5 / 1 = -0.5
    torch.testing.assert_close(seq_kl, torch.tensor([0.75, -0.5]))


def test_reward_penalty_k3() -> None:
    rewards, seq_kl = kl_reward_penalty(PEN_LOGP, PEN_REF, PEN_MASK, 0.1, "low_var_kl")
    # k3(d) = exp(-d) - 1 + d: k3(1) = e^-1 ~ 0.3679, k3(0.5) = e^-0.5 - 0.5 ~ 0.1065,
    # k3(-0.5) = e^0.5 - 1.5 ~ 0.1487
    k3_a, k3_b, k3_c = math.exp(-1.0), math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5
    expected = torch.tensor([[-0.1 * k3_a, -0.1 * k3_b, 0.0], [-0.1 * k3_c, 0.0, 0.0]])
    torch.testing.assert_close(rewards, expected)
    torch.testing.assert_close(seq_kl, torch.tensor([(k3_a + k3_b) / 2, k3_c]))


def test_reward_penalty_is_detached_and_handles_empty_rows() -> None:
    logp = PEN_LOGP.clone().requires_grad_()
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    rewards, seq_kl = kl_reward_penalty(logp, PEN_REF, mask, 0.1, "kl")
    assert not rewards.requires_grad and not seq_kl.requires_grad
    # row 1 has no response tokens: no penalty and a KL of 0 rather than 0/0
    torch.testing.assert_close(rewards[1], torch.zeros(3))
    assert seq_kl[1].item() == 0.0


def test_reward_penalty_unknown_estimator() -> None:
    with pytest.raises(ValueError, match="'k9'"):
        kl_reward_penalty(PEN_LOGP, PEN_REF, PEN_MASK, 0.1, "k9")  # type: ignore[arg-type]


# --- controllers: kl_coef 0.1, target_kl 1.0, horizon 100, n_steps 10 ------------------
@pytest.mark.parametrize("current_kl, expected", [
    (1.1, 0.101),    # error 0.1: 0.1 * (1 + 0.1 * 10 / 100) = 0.1 * 1.01
    (0.95, 0.0995),  # error -0.05: 0.1 * (1 - 0.05 * 10 / 100) = 0.1 * 0.995
    (5.0, 0.102),    # error 4 clipped to 0.2: 0.1 * (1 + 0.2 * 0.1) = 0.1 * 1.02
    (0.0, 0.098),    # error -1 clipped to -0.2: 0.1 * (1 - 0.2 * 0.1) = 0.1 * 0.98
    (1.0, 0.1),      # at target: error 0, unchanged
])
def test_adaptive_controller_step(current_kl: float, expected: float) -> None:
    ctrl = AdaptiveKLController(kl_coef=0.1, target_kl=1.0, horizon=100)
    ctrl.update(current_kl, n_steps=10)
    assert ctrl.value == pytest.approx(expected)


def test_adaptive_controller_compounds() -> None:
    ctrl = AdaptiveKLController(kl_coef=0.1, target_kl=1.0, horizon=100)
    ctrl.update(2.0, n_steps=10)  # error 1 clipped to 0.2 -> 0.1 * 1.02 = 0.102
    ctrl.update(2.0, n_steps=10)  # again -> 0.102 * 1.02 = 0.10404
    assert ctrl.value == pytest.approx(0.10404)


def test_fixed_controller_never_changes() -> None:
    ctrl = FixedKLController(kl_coef=0.1)
    for current_kl in (0.0, 1.0, 100.0):
        ctrl.update(current_kl, n_steps=1000)
    assert ctrl.value == 0.1


def test_make_kl_controller() -> None:
    fixed = make_kl_controller(KLControlConfig(kl_coef=0.1, target_kl=0.0, horizon=0))
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.1
    adaptive = make_kl_controller(KLControlConfig(type="adaptive", kl_coef=0.1, target_kl=1.0,
                                                  horizon=100))
    assert isinstance(adaptive, AdaptiveKLController) and adaptive.value == 0.1


@pytest.mark.parametrize("kind, target_kl, horizon, match", [
    ("pid", 1.0, 100, r"'pid'.*fixed, adaptive"),
    ("adaptive", 0.0, 100, "target_kl"),
    ("adaptive", 1.0, 0, "horizon"),
])
def test_make_kl_controller_errors(kind: str, target_kl: float, horizon: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_kl_controller(KLControlConfig(type=kind, kl_coef=0.1,  # type: ignore[arg-type]
                                           target_kl=target_kl, horizon=horizon))
