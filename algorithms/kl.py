"""Per-token estimators of KL(pi_theta || pi_ref) from log-probs of the sampled tokens.

With log-ratio d = log pi_theta(x) - log pi_ref(x) and x ~ pi_theta (Schulman, 2020,
"Approximating KL divergence"):

    k1  ("kl")          d                          unbiased, high variance, can be negative
    abs                 |d|
    k2  ("mse")         d^2 / 2                    biased, low variance
    k3  ("low_var_kl")  exp(-d) - 1 + d            unbiased, non-negative, low variance

k3 is clamped to [-10, 10] as verl does. Names follow verl's ``kl_loss_type``/``kl_penalty``.
Computed in fp32; gradient flows through ``logprobs`` only.
"""

from __future__ import annotations

from typing import Literal

import torch

KLType = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]
K3_CLAMP = 10.0


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLType) -> torch.Tensor:
    """Per-token KL estimate (B, T) of the kind named (see the module docstring)."""
    d = logprobs.float() - ref_logprobs.detach().float()
    if kind in ("kl", "k1"):
        return d
    if kind == "abs":
        return d.abs()
    if kind in ("mse", "k2"):
        return 0.5 * d.square()
    if kind in ("low_var_kl", "k3"):
        return (torch.exp(-d) - 1.0 + d).clamp(-K3_CLAMP, K3_CLAMP)
    raise ValueError(f"unknown KL estimator {kind!r}; valid: kl/k1, abs, mse/k2, low_var_kl/k3")
