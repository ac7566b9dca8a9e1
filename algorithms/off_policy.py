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
    rollout_is = sequence    w_t = min(exp(clamp(sum_s log r'_s, -20, 20)), C)  for all t
    rollout_is = token_mask  w_t = r_t [r_t <= C],  m_t = [r_t <= C]     (AReaL's decoupled
                             PPO: unclipped below the cap, the token masked above it)
    rollout_rs = token       m_t = [lo <= r_t <= hi]                    (MIS / IcePop)
    rollout_rs = sequence    m_t = [lo <= exp(clamp(sum_s log r_s)) <= hi]      for all t
    rollout_rs = geometric   m_t = [lo <= exp(clamp(mean_s log r_s)) <= hi]     for all t
    m2po                     mask the tokens of largest (log r)^2 until the batch's
                             mean (log r)^2 over the kept tokens is <= tau (Zheng et al.,
                             2025, "Prosperity before Collapse", M2PO)

with C = ``rollout_is_threshold`` (default 2, verl's; 5 for ``token_mask``, AReaL's
``behav_imp_weight_cap``), [lo, hi] = [``rollout_rs_threshold_lower``,
``rollout_rs_threshold``] (lo absent: 1 / hi, as verl; lo = 0: no lower bound), and sums /
means over the sequence's response tokens. log r' is the log ratio before the per-token
clamp: sequence IS sums first and clamps the sum, as verl does (two opposite extreme tokens
cancel); rejection reads the clamped per-token values, as verl's rejection does. The final
mask is the response mask times every enabled mask (``token_mask``'s included); each test
reads the log ratios of the whole response, independently of the others. Off the response
the log ratio is 0 and the weight 1 (the mask is 0 there). All arithmetic is fp32.

``token_mask`` is AReaL's ``ppo_actor_loss_fn`` with ``behav_imp_weight_cap`` (its
``rejection_sampling`` with level token, action mask, metric ratio, upper C and no lower
bound): no truncation, so the weights stay unbiased where they are kept, and a token whose
proximal policy moved past C times its behavior probability is dropped instead of
counted at C.

``a3po_proximal_logprobs`` approximates pi_prox without a forward pass (A-3PO; AReaL's
``prox_logp_method = "loglinear"``) by interpolating, per token, between pi_b and the
current policy pi_theta according to policy versions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec
import torch

LOG_RATIO_CLAMP = 20.0

RolloutIS = Literal["none", "token", "sequence", "token_mask"]
RolloutRS = Literal["none", "token", "sequence", "geometric"]
VERL_IS_CAP = 2.0  # verl's rollout_is_threshold
AREAL_IS_CAP = 5.0  # AReaL's behav_imp_weight_cap, the cap of its token mask


class RolloutCorrectionConfig(msgspec.Struct, kw_only=True, frozen=True,
                              forbid_unknown_fields=True):
    """verl's ``algorithm.rollout_correction``: which corrections to apply (formulas: the
    module docstring).

    ``rollout_is``: importance-weight level (``none``: w = 1; ``token_mask``: AReaL's
    decoupled PPO, the weight unclipped up to the cap and the token masked past it);
    ``rollout_is_threshold``: its cap C (absent: ``is_cap``, 2 as verl, or 5 for
    ``token_mask`` as AReaL). ``rollout_rs``: rejection level (``none``: no rejection),
    accepting ratios in [``rollout_rs_threshold_lower``, ``rollout_rs_threshold``]; an absent
    lower bound means 1 / ``rollout_rs_threshold`` (verl's default), 0 means none.
    ``m2po`` (*Relay*): M2PO second-moment masking with bound ``m2po_tau``.
    ``relay.configs.checks`` refuses a lower bound above the upper one.
    """

    rollout_is: RolloutIS = "token"
    rollout_is_threshold: Annotated[float, msgspec.Meta(gt=0)] | None = None
    rollout_rs: RolloutRS = "none"
    rollout_rs_threshold: Annotated[float, msgspec.Meta(gt=0)] = 2.0
    rollout_rs_threshold_lower: Annotated[float, msgspec.Meta(ge=0)] | None = None
    m2po: bool = False
    m2po_tau: Annotated[float, msgspec.Meta(gt=0)] = 0.04

    @property
    def rejects(self) -> bool:
        """Whether a rejection that enters the advantages (``rollout_rs`` or M2PO) is on.
        ``token_mask`` alone does not count: AReaL masks in the loss only, so its mask
        needs no proximal log-probs before the advantages."""
        return self.rollout_rs != "none" or self.m2po

    @property
    def is_cap(self) -> float:
        """C: ``rollout_is_threshold``, or absent, 5 for ``token_mask`` (AReaL), else 2
        (verl)."""
        if self.rollout_is_threshold is not None:
            return self.rollout_is_threshold
        return AREAL_IS_CAP if self.rollout_is == "token_mask" else VERL_IS_CAP

    @property
    def rs_bounds(self) -> tuple[float, float]:
        """The accepted ratio interval [lower, upper] of ``rollout_rs``: an absent lower
        bound is 1 / upper (verl), 0 accepts every ratio up to the upper bound."""
        upper, lower = self.rollout_rs_threshold, self.rollout_rs_threshold_lower
        return (1.0 / upper if lower is None else lower), upper


@dataclass(frozen=True)
class Correction:
    """Detached per-token results, all (B, T) fp32.

    ``weight``: importance weight (1 where IS is off and off the response, 0 where
    ``token_mask`` masks); ``mask``: the response mask times every rejection mask;
    ``log_ratio``: clamped log pi_prox - log pi_b (0 off the response).
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
    config: RolloutCorrectionConfig,
) -> Correction:
    """Importance weight and rejection mask for pi_prox / pi_b (formulas: module docstring).

    Shapes: every input (B, T); ``response_mask`` is 1 on response tokens. The results are
    detached and fp32.
    """
    response = response_mask.detach().float()
    raw = _raw_log_ratio(proximal_logprobs, behavior_logprobs, response)
    log_ratio = raw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    weight = _importance_weight(raw, response, config)
    mask = response * _rejection_mask(log_ratio, response, config)
    if config.rollout_is == "token_mask":
        mask = mask * (log_ratio.exp() <= config.is_cap).float()
    if config.m2po:
        mask = mask * m2po_mask(log_ratio, response, config.m2po_tau)
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


def _raw_log_ratio(
    proximal_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, response: torch.Tensor
) -> torch.Tensor:
    """log pi_prox - log pi_b, 0 off the response (whatever is there); (B, T) fp32."""
    log_ratio = proximal_logprobs.detach().float() - behavior_logprobs.detach().float()
    return torch.where(response > 0, log_ratio, torch.zeros_like(log_ratio))


def _sequence_log_ratio(log_ratio: torch.Tensor, response: torch.Tensor,
                        geometric: bool) -> torch.Tensor:
    """Per-sequence sum (or mean, if ``geometric``) of log r over the response, clamped to
    [-20, 20] and broadcast to (B, T)."""
    total = log_ratio.sum(dim=-1, keepdim=True)
    if geometric:
        total = total / response.sum(dim=-1, keepdim=True).clamp(min=1.0)
    return total.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).expand_as(log_ratio)


def _importance_weight(raw_log_ratio: torch.Tensor, response: torch.Tensor,
                       config: RolloutCorrectionConfig) -> torch.Tensor:
    """IS weight (B, T): min(r, C) per token or per sequence, or for ``token_mask``
    r [r <= C] per token (0 past the cap: ``off_policy_correction`` masks those tokens); 1 off
    the response. ``raw_log_ratio`` is unclamped: a sequence's sum is clamped once, after
    summing."""
    if config.rollout_is == "none":
        return torch.ones_like(raw_log_ratio)
    if config.rollout_is == "sequence":
        log_ratio = _sequence_log_ratio(raw_log_ratio, response, geometric=False)
    else:
        log_ratio = raw_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    if config.rollout_is == "token_mask":
        weight = torch.where(ratio <= config.is_cap, ratio, torch.zeros_like(ratio))
    else:
        weight = ratio.clamp(max=config.is_cap)
    return torch.where(response > 0, weight, torch.ones_like(weight))


def _rejection_mask(log_ratio: torch.Tensor, response: torch.Tensor,
                    config: RolloutCorrectionConfig) -> torch.Tensor:
    """Rejection mask (B, T): 1 where the token / sequence / geometric ratio lies in
    [lower, upper], else 0; all ones when ``rollout_rs`` is ``none``."""
    if config.rollout_rs == "none":
        return torch.ones_like(log_ratio)
    if config.rollout_rs != "token":
        log_ratio = _sequence_log_ratio(log_ratio, response,
                                        geometric=config.rollout_rs == "geometric")
    lower, upper = config.rs_bounds
    ratio = log_ratio.exp()
    return ((ratio >= lower) & (ratio <= upper)).float()
