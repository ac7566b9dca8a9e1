"""Per-token estimators of KL(pi_theta || pi_ref) from log-probs of the sampled tokens.

With log-ratio d = log pi_theta(x) - log pi_ref(x) and x ~ pi_theta (Schulman, 2020,
"Approximating KL divergence"):

    k1  ("kl")          d                          unbiased, high variance, can be negative
    abs                 |d|
    k2  ("mse")         d^2 / 2                    biased, low variance
    k3  ("low_var_kl")  exp(-d) - 1 + d            unbiased, non-negative, low variance

For k3, d is clamped to [-20, 20] before exp(-d) and the result to [-10, 10], as verl
does: without the first clamp exp(-d) overflows fp32 for d < -88.7 (a padded position, or
a token the reference finds near impossible) and its gradient is NaN, even where the mask
later multiplies it by 0. A ``+`` after a name (``k3+``, ``low_var_kl+``, ...)
is verl's straight-through form: the value of that estimator with the gradient of k2,

    k+ = k2 - stopgrad(k2) + stopgrad(k)          value k, gradient d * grad(log pi_theta)

which is the unbiased gradient of KL(pi_theta || pi_ref) for on-policy samples. Names follow
verl's ``kl_loss_type``/``kl_penalty``. Computed in fp32; gradient flows through
``logprobs`` only.

KL in the reward (verl's ``algorithm.use_kl_in_reward``): ``kl_reward_penalty`` turns the
estimator named by ``algorithm.kl_penalty`` into per-token rewards -beta * kl_t, and the
coefficient beta comes from a controller built by ``make_kl_controller`` from
``KLControlConfig`` (verl's ``algorithm.kl_ctrl``). ``KLType`` names the estimators for
both ``actor.kl_loss_type`` and ``algorithm.kl_penalty``.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

import msgspec
import torch

KLType = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
                 "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"]
K3_CLAMP = 10.0
LOG_RATIO_CLAMP = 20.0  # |d| bound before exp(-d) in k3 (verl's)
KLControllerType = Literal["fixed", "adaptive"]


class KLControlConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """verl's ``algorithm.kl_ctrl``: the coefficient beta of KL in the reward.

    ``type = "fixed"`` keeps ``kl_coef``; ``"adaptive"`` (Ziegler et al., 2019; see
    ``AdaptiveKLController``) starts at ``kl_coef`` and moves it toward ``target_kl`` over
    ``horizon`` samples.
    """

    type: KLControllerType = "fixed"
    kl_coef: Annotated[float, msgspec.Meta(ge=0)] = 0.001
    horizon: Annotated[int, msgspec.Meta(gt=0)] = 10000
    target_kl: Annotated[float, msgspec.Meta(gt=0)] = 0.1


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLType) -> torch.Tensor:
    """Per-token KL estimate (B, T) of the kind named (see the module docstring)."""
    d = logprobs.float() - ref_logprobs.detach().float()
    if kind.endswith("+") and kind[:-1] in get_args(KLType):
        value = kl_penalty(logprobs, ref_logprobs, kind[:-1])  # type: ignore[arg-type]
        k2 = 0.5 * d.square()
        return k2 - k2.detach() + value.detach()
    if kind in ("kl", "k1"):
        return d
    if kind == "abs":
        return d.abs()
    if kind in ("mse", "k2"):
        return 0.5 * d.square()
    if kind in ("low_var_kl", "k3"):
        d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # before exp: finite value and gradient
        return (torch.exp(-d) - 1.0 + d).clamp(-K3_CLAMP, K3_CLAMP)
    raise ValueError(f"unknown KL estimator {kind!r}; valid: kl/k1, abs, mse/k2, low_var_kl/k3, "
                     "each optionally with a trailing '+'")


class FixedKLController:
    """Constant KL coefficient: ``value`` stays ``kl_coef`` and ``update`` does nothing."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op; present so both controllers share one interface."""


class AdaptiveKLController:
    """Proportional controller steering the measured KL towards ``target_kl``.

    Ziegler et al., 2019, "Fine-Tuning Language Models from Human Preferences", sec. 2.2
    (arXiv:1909.08593). After each batch of ``n_steps`` samples with mean KL ``current_kl``:

        error  = clip(current_kl / target_kl - 1, -0.2, 0.2)
        value *= 1 + error * n_steps / horizon
    """

    ERROR_CLIP = 0.2

    def __init__(self, kl_coef: float, target_kl: float, horizon: int) -> None:
        self.value = kl_coef
        self.target_kl = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Scale ``value`` up when KL is above target, down when below (see class docstring)."""
        error = min(max(current_kl / self.target_kl - 1.0, -self.ERROR_CLIP), self.ERROR_CLIP)
        self.value *= 1.0 + error * n_steps / self.horizon


def make_kl_controller(config: KLControlConfig) -> FixedKLController | AdaptiveKLController:
    """Build the controller ``config.type`` names ("fixed" or "adaptive")."""
    if config.type == "fixed":
        return FixedKLController(config.kl_coef)
    if config.type == "adaptive":
        if config.target_kl <= 0:
            raise ValueError(f"kl_ctrl.target_kl must be > 0 for adaptive, got {config.target_kl}")
        if config.horizon <= 0:
            raise ValueError(f"kl_ctrl.horizon must be > 0 for adaptive, got {config.horizon}")
        return AdaptiveKLController(config.kl_coef, config.target_kl, config.horizon)
    known = ", ".join(get_args(KLControllerType))
    raise ValueError(f"unknown kl_ctrl.type {config.type!r}; valid: {known}")


def kl_reward_penalty(
    logprobs: torch.Tensor,
    reference_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float,
    kl_type: KLType,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL penalty folded into the reward, as verl's ``apply_kl_penalty``.

    With kl_t the per-token estimate of ``kl_type`` (see the module docstring) and m_t the
    response mask, returns (both detached, fp32):

        token_rewards  (B, T)  -coef * kl_t * m_t        added to the outcome rewards
        sequence_kl    (B,)    sum_t kl_t m_t / sum_t m_t  (0 for an empty response)

    The caller averages ``sequence_kl`` over the batch and passes it to the controller's
    ``update(current_kl, n_steps=batch_size)``.
    """
    mask = response_mask.float()
    kl = kl_penalty(logprobs.detach(), reference_logprobs, kl_type) * mask
    sequence_kl = kl.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
    return -coef * kl, sequence_kl
