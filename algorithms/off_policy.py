"""Off-policy corrections between the behavior and the proximal policy.

In asynchronous training the tokens were sampled by the behavior policy pi_b (stale
generator weights), while the learner's policy loss is taken against the proximal policy
pi_prox (the learner's weights before this update; see ``algorithms/policy_loss.py``). Per
response token the log ratio is

    log r_t = clamp(log pi_prox(t) - log pi_b(t), -20, 20)

and this module turns it into a detached importance weight w (B, T) and a rejection mask
m (B, T). The learner multiplies its per-token policy loss by w and aggregates under m.
The parameter names follow verl's ``algorithm.rollout_correction`` (Liu, Li et al., 2025,
"When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference
Mismatch"):

    rollout_is = token       w_t = min(r_t, C)                          (truncated IS, TIS)
    rollout_is = sequence    w_t = min(exp(clamp(sum_s log r_s, -20, 20)), C)   for all t
    rollout_rs = token       m_t = [lo <= r_t <= hi]                    (MIS / IcePop)
    rollout_rs = sequence    m_t = [lo <= exp(clamp(sum_s log r_s)) <= hi]      for all t
    rollout_rs = geometric   m_t = [lo <= exp(clamp(mean_s log r_s)) <= hi]     for all t
    m2po                     mask the tokens of largest (log r)^2 until the batch's
                             mean (log r)^2 over the kept tokens is <= tau (Zheng et al.,
                             2025, "Prosperity before Collapse", M2PO)

with C = ``rollout_is_threshold``, [lo, hi] = [``rollout_rs_threshold_lower``,
``rollout_rs_threshold``], and sums / means over the sequence's response tokens. The final
mask is the response mask times every enabled rejection mask; each rejection test reads the
log ratios of the whole response, independently of the others. Off the response the log
ratio is 0 and the weight 1 (the mask is 0 there). All arithmetic is fp32.

``a3po_proximal_logprobs`` approximates pi_prox without a forward pass (A-3PO; AReaL's
``prox_logp_method = "loglinear"``) by interpolating, per token, between pi_b and the
current policy pi_theta according to policy versions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LOG_RATIO_CLAMP = 20.0

RolloutIS = Literal["none", "token", "sequence"]
RolloutRS = Literal["none", "token", "sequence", "geometric"]
ROLLOUT_IS_MODES: tuple[str, ...] = RolloutIS.__args__  # type: ignore[attr-defined]
ROLLOUT_RS_MODES: tuple[str, ...] = RolloutRS.__args__  # type: ignore[attr-defined]


@dataclass(frozen=True)
class CorrectionParams:
    """Which corrections to apply (see the module docstring for the formulas).

    ``rollout_is``: importance-weight level (``none``: w = 1); ``rollout_is_threshold``: its
    truncation cap C. ``rollout_rs``: rejection level (``none``: no rejection), with the
    accepted ratio interval [``rollout_rs_threshold_lower``, ``rollout_rs_threshold``].
    ``m2po``: M2PO second-moment masking with bound ``m2po_tau``.
    """

    rollout_is: RolloutIS = "token"
    rollout_is_threshold: float = 2.0
    rollout_rs: RolloutRS = "none"
    rollout_rs_threshold: float = 2.0
    rollout_rs_threshold_lower: float = 0.5
    m2po: bool = False
    m2po_tau: float = 0.04

    def __post_init__(self) -> None:
        if self.rollout_is not in ROLLOUT_IS_MODES:
            raise ValueError(f"rollout_is must be one of {ROLLOUT_IS_MODES}, "
                             f"got {self.rollout_is!r}")
        if self.rollout_rs not in ROLLOUT_RS_MODES:
            raise ValueError(f"rollout_rs must be one of {ROLLOUT_RS_MODES}, "
                             f"got {self.rollout_rs!r}")
        for name in ("rollout_is_threshold", "rollout_rs_threshold",
                     "rollout_rs_threshold_lower", "m2po_tau"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.rollout_rs_threshold_lower > self.rollout_rs_threshold:
            raise ValueError(
                f"rollout_rs_threshold_lower ({self.rollout_rs_threshold_lower}) must be <= "
                f"rollout_rs_threshold ({self.rollout_rs_threshold})")


@dataclass(frozen=True)
class Correction:
    """Detached per-token results, all (B, T) fp32.

    ``weight``: importance weight (1 where IS is off and off the response); ``mask``: the
    response mask times every rejection mask; ``log_ratio``: clamped log pi_prox - log pi_b
    (0 off the response).
    """

    weight: torch.Tensor
    mask: torch.Tensor
    log_ratio: torch.Tensor

    def metrics(self, response_mask: torch.Tensor) -> dict[str, float]:
        """Scalar diagnostics over the response tokens (every value 0.0 if there are none).

        ``is_weight_mean`` / ``is_weight_max``: of w over response tokens;
        ``log_ratio_m2``: mean (log r)^2 over response tokens, before any masking;
        ``masked_fraction``: rejected response tokens / response tokens;
        ``seq_masked_fraction``: sequences with a rejected response token / sequences with
        a response token.
        """
        response = response_mask.bool()
        if not response.any():
            return dict.fromkeys(("is_weight_mean", "is_weight_max", "log_ratio_m2",
                                  "masked_fraction", "seq_masked_fraction"), 0.0)
        weights = self.weight[response]
        rejected = response & (self.mask == 0)
        has_response = response.any(dim=-1)
        return {
            "is_weight_mean": weights.mean().item(),
            "is_weight_max": weights.max().item(),
            "log_ratio_m2": self.log_ratio[response].square().mean().item(),
            "masked_fraction": rejected.sum().item() / response.sum().item(),
            "seq_masked_fraction": rejected.any(dim=-1).sum().item() / has_response.sum().item(),
        }


def off_policy_correction(
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    params: CorrectionParams,
) -> Correction:
    """Importance weight and rejection mask for pi_prox / pi_b (formulas: module docstring).

    Shapes: every input (B, T); ``response_mask`` is 1 on response tokens. The results are
    detached and fp32.
    """
    response = response_mask.detach().float()
    log_ratio = _clamped_log_ratio(proximal_logprobs, behavior_logprobs, response)
    weight = _importance_weight(log_ratio, response, params)
    mask = response * _rejection_mask(log_ratio, response, params)
    if params.m2po:
        mask = mask * m2po_mask(log_ratio, response, params.m2po_tau)
    return Correction(weight=weight, mask=mask, log_ratio=log_ratio)


def m2po_mask(log_ratio: torch.Tensor, response_mask: torch.Tensor, tau: float) -> torch.Tensor:
    """M2PO second-moment mask (Zheng et al., 2025, "Prosperity before Collapse").

    With M2_t = (log r_t)^2 over the N response tokens of the batch sorted in decreasing
    order, mask the k largest for the smallest k such that the mean of the remaining N - k
    values is <= ``tau`` (k = 0 when the batch's second moment is already within the
    bound). Shapes: (B, T) in, (B, T) float mask out (1 = kept; 1 off the response).
    """
    flat_m2 = log_ratio.detach().float().square().flatten()
    positions = response_mask.flatten().nonzero().squeeze(-1)
    sorted_m2, order = flat_m2[positions].sort(descending=True)
    kept_sums = sorted_m2.flip(0).cumsum(0).flip(0)  # kept_sums[k] = sum of sorted_m2[k:]
    kept_counts = torch.arange(len(sorted_m2), 0, -1, device=flat_m2.device)
    within = kept_sums / kept_counts <= tau  # non-decreasing in k: drops the largest first
    num_masked = int(within.float().argmax()) if within.any() else len(sorted_m2)
    keep = torch.ones_like(flat_m2)
    keep[positions[order[:num_masked]]] = 0.0
    return keep.view_as(log_ratio)


def a3po_proximal_logprobs(
    behavior_logprobs: torch.Tensor,
    current_logprobs: torch.Tensor,
    behavior_versions: torch.Tensor,
    proximal_version: int,
    current_version: int,
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """Approximate proximal log-probs by log-linear interpolation in policy version (A-3PO).

    Per response token, with v_b its behavior version, v_prox = ``proximal_version`` and
    v_theta = ``current_version`` (AReaL, "Proximal Log-Probability Approximation",
    ``prox_logp_method = "loglinear"``):

        alpha = clamp((v_prox - v_b) / (v_theta - v_b), 0, 1)
        log pi_prox ~= log pi_b + alpha * (log pi_theta - log pi_b)

    A token with v_b >= v_theta (sampled by the current weights) takes alpha = 1, the
    current log-prob. Off the response the result is log pi_b. Shapes: log-probs and
    ``behavior_versions`` (B, T) (versions long, -1 off the response). The result is
    detached and fp32.
    """
    if proximal_version > current_version:
        raise ValueError(f"proximal_version ({proximal_version}) must be <= current_version "
                         f"({current_version})")
    behavior = behavior_logprobs.detach().float()
    current = current_logprobs.detach().float()
    gap = (current_version - behavior_versions).float()
    alpha = torch.where(gap > 0, (proximal_version - behavior_versions).float()
                        / gap.clamp(min=1.0), torch.ones_like(gap)).clamp(0.0, 1.0)
    approx = behavior + alpha * (current - behavior)
    return torch.where(response_mask.bool(), approx, behavior)


def _clamped_log_ratio(
    proximal_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, response: torch.Tensor
) -> torch.Tensor:
    """log pi_prox - log pi_b clamped to [-20, 20], 0 off the response; (B, T) fp32."""
    log_ratio = proximal_logprobs.detach().float() - behavior_logprobs.detach().float()
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) * response


def _sequence_log_ratio(log_ratio: torch.Tensor, response: torch.Tensor,
                        geometric: bool) -> torch.Tensor:
    """Per-sequence sum (or mean, if ``geometric``) of log r over the response, clamped to
    [-20, 20] and broadcast to (B, T)."""
    total = log_ratio.sum(dim=-1, keepdim=True)
    if geometric:
        total = total / response.sum(dim=-1, keepdim=True).clamp(min=1.0)
    return total.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).expand_as(log_ratio)


def _importance_weight(log_ratio: torch.Tensor, response: torch.Tensor,
                       params: CorrectionParams) -> torch.Tensor:
    """Truncated IS weight (B, T): min(r, C) per token or per sequence; 1 off the response."""
    if params.rollout_is == "none":
        return torch.ones_like(log_ratio)
    if params.rollout_is == "sequence":
        log_ratio = _sequence_log_ratio(log_ratio, response, geometric=False)
    weight = log_ratio.exp().clamp(max=params.rollout_is_threshold)
    return torch.where(response > 0, weight, torch.ones_like(weight))


def _rejection_mask(log_ratio: torch.Tensor, response: torch.Tensor,
                    params: CorrectionParams) -> torch.Tensor:
    """Rejection mask (B, T): 1 where the token / sequence / geometric ratio lies in
    [lower, upper], else 0; all ones when ``rollout_rs`` is ``none``."""
    if params.rollout_rs == "none":
        return torch.ones_like(log_ratio)
    if params.rollout_rs != "token":
        log_ratio = _sequence_log_ratio(log_ratio, response,
                                        geometric=params.rollout_rs == "geometric")
    ratio = log_ratio.exp()
    accepted = (ratio >= params.rollout_rs_threshold_lower) & (ratio <= params.rollout_rs_threshold)
    return accepted.float()
