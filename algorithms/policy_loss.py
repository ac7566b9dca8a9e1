"""Policy-loss modes, as verl's ``actor.policy_loss.loss_mode``, on the proximal ratio.

Every mode is a pure function of the current log-probs ``logprobs`` (log pi_theta, the only
input that carries gradient), the proximal log-probs ``proximal_logprobs`` (log pi_prox: the
learner's weights before this update), the per-token ``advantages`` A and the float
``response_mask`` m, all (B, T), and returns a per-token loss (B, T) plus detached diagnostics.
The ratio is r = pi_theta / pi_prox. The off-policy correction between the behavior policy
and pi_prox is computed elsewhere (``relay.algorithms.off_policy``); its rejection mask is the
``response_mask`` given here (so a rejected token leaves GSPO's sequence ratio, GMPO's
geometric mean and the covariance statistics of Clip-Cov / KL-Cov, as in verl, where the
rejection rewrites the response mask), and its importance weights w are
``importance_weights``: each token's loss is multiplied by its w, except in geo_mean, whose
sequence loss is multiplied by the geometric mean of w over the sequence (as verl).

Log-prob arithmetic is in fp32 and token log ratios are clamped to [-20, 20] before
exponentiation. Masked tokens never influence the loss or gradient of unmasked tokens, but
their own entries are not zeroed: the learner masks them when it aggregates.

The ratio clip is verl's ``actor.clip_ratio_low`` / ``clip_ratio_high`` / ``clip_ratio_c``
(eps_l, eps_h, c), passed to ``policy_loss`` as arguments; the rest of a mode's knobs are
``PolicyLossConfig`` (verl's ``actor.policy_loss``).

    mode      per-token loss                                                aggregation
    vanilla   max(-A r, -A clip(r, 1-eps_l, 1+eps_h)), dual-clip min(., -A c) for A<0  configured
    gspo      the same clipped surrogate on s_i = exp(min(mean_t log r_it, 10))
                                                                            seq-mean-token-mean
    clip_cov  vanilla without dual-clip, random high-covariance tokens -> 0 configured
    kl_cov    -A r, plus ppo_kl_coef |log r| on the top-k covariance tokens configured
    gpg       -A log pi_theta                                               configured
    geo_mean  -A_i exp(mean_t clip_log(log r_it)) broadcast over the row    seq-mean-token-mean
    cispo     -sg(clip(r, 1-eps_l, 1+eps_h)) A log pi_theta                 configured
    sapo      -A (4 / tau) sigmoid(tau (r - 1)), tau = tau_pos/tau_neg by sign of A
                                                                            seq-mean-token-mean

Aggregation: verl aggregates gspo and sapo with ``seq-mean-token-mean`` and geo_mean with a
plain mean over sequences whatever ``actor.loss_agg_mode`` says, since their objectives are
per sequence (a token mean would weight each sequence by its length). ``policy_loss_agg_mode``
returns the same choice (seq-mean-token-mean of a loss broadcast over the row is the mean over
sequences); ``actor.loss_agg_mode`` still aggregates the entropy and KL-loss terms.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Literal, NamedTuple

import msgspec
import torch

from relay.algorithms.aggregation import LossAggMode, masked_mean
from relay.algorithms.registry import POLICY_LOSSES, policy_loss_mode, register_policy_loss

LOG_RATIO_CLAMP = 20.0
GSPO_LOG_RATIO_MAX = 10.0  # verl's bound on GSPO's log s_i, for numerical stability

LossMode = Literal["vanilla", "gspo", "clip_cov", "kl_cov", "gpg", "geo_mean", "cispo", "sapo"]
DEFAULT_LOSS_MODE: LossMode = "vanilla"

class PolicyLossConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """verl's ``actor.policy_loss``: which surrogate objective, and its own knobs.

    ``loss_mode``: a mode of ``relay.algorithms.registry`` (see the module docstring), or a
    user's function by path, ``"my_pkg.losses:my_loss"`` or ``"path/to/file.py:my_loss"``,
    with the modes' signature (``registry.PolicyLossEntry``). The other keys belong to the
    modes that name them:

    - ``clip_cov_ratio``: fraction of response tokens whose gradient clip_cov may detach;
      ``clip_cov_lb``, ``clip_cov_ub``: clip_cov picks tokens with covariance in (lb, ub).
    - ``kl_cov_ratio``: fraction of response tokens that kl_cov penalizes; ``ppo_kl_coef``:
      its coefficient on |log r|.
    - ``tau_pos``, ``tau_neg``: SAPO's gate temperatures for A > 0 and A <= 0 (tau_neg >
      tau_pos damps negative updates faster).

    The ratio clip (``actor.clip_ratio_low/high/c``) is verl's ``actor`` section's and is
    passed to ``policy_loss`` beside this config. DAPO's clip-higher sets eps_high > eps_low;
    GSPO's paper uses 3e-4 / 4e-4, GMPO's 0.4 / 0.4 (in log space).
    """

    loss_mode: str = DEFAULT_LOSS_MODE  # a LossMode, or a function by path
    clip_cov_ratio: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.0002
    ppo_kl_coef: Annotated[float, msgspec.Meta(ge=0)] = 0.1
    tau_pos: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    tau_neg: Annotated[float, msgspec.Meta(gt=0)] = 1.05


class Clip(NamedTuple):
    """verl's actor.clip_ratio_low / high / c, as every mode receives them."""

    low: float
    high: float
    dual: float


class PolicyLossTerms(msgspec.Struct, frozen=True):
    """Per-token loss and detached per-token diagnostics, all (B, T)."""

    loss: torch.Tensor  # fp32, to be aggregated by the learner over the response mask
    ratio: torch.Tensor  # the ratio the mode clips (sequence-level ones broadcast over T)
    clipped: torch.Tensor  # bool: the mode clipped, detached, gated out or penalized the token
    approx_kl: torch.Tensor  # k3 estimate of KL(pi_prox || pi_theta): (r - 1) - log r


@register_policy_loss(
    "vanilla",
    paper="Schulman et al. 2017; Yu et al. 2025 (DAPO clip-higher); Ye et al. 2020 (dual-clip)",
    zero_advantage_zero_gradient=True,
    config_keys=("actor.clip_ratio_low", "actor.clip_ratio_high", "actor.clip_ratio_c"))
def vanilla_policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    clip: Clip,
    *,
    generator: torch.Generator | None = None,
) -> PolicyLossTerms:
    """PPO's clipped surrogate with clip-higher and dual-clip, per token (B, T).

        pg  = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))    (Schulman et al., 2017;
                                                                   DAPO, Yu et al., 2025)
        pg  = min(pg, -A c)                      where A < 0      (dual-clip, Ye et al., 2020)

    Recommended loss_agg_mode: token-mean.
    """
    log_ratio = _log_ratio(logprobs, proximal_logprobs)
    ratio = log_ratio.exp()
    adv = _constant(advantages)
    pg_loss, clipped = _clipped_surrogate(ratio, adv, clip)
    dual_bound = -adv * clip.dual
    dual_clipped = (adv < 0) & (dual_bound < pg_loss)
    loss = torch.where(dual_clipped, dual_bound, pg_loss)
    return _terms(loss, ratio, clipped | dual_clipped, log_ratio)


@register_policy_loss(
    "gspo", paper="Zheng et al. 2025, GSPO", per_sequence=True, zero_advantage_zero_gradient=True,
    config_keys=("actor.clip_ratio_low", "actor.clip_ratio_high"))
def gspo_policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    clip: Clip,
    *,
    generator: torch.Generator | None = None,
) -> PolicyLossTerms:
    """GSPO-token: the clipped surrogate on the length-normalized sequence ratio.

    Zheng et al., 2025, "Group Sequence Policy Optimization". With |y_i| the row's mask sum,

        s_i   = exp(min((1 / |y_i|) sum_t m_it log r_it, 10))
        s_it  = sg(s_i) * pi_theta(y_it) / sg(pi_theta(y_it))     (value s_i, grad s_i dlogp_it)
        loss  = max(-A s_it, -A clip(s_it, 1 - eps_low, 1 + eps_high))

    The bound 10 on log s_i is verl's (no gradient past it). Shapes: (B, T) in and out;
    ``ratio`` is s_i broadcast over the row. Aggregated with seq-mean-token-mean (as verl
    forces), which gives GSPO's (1/B) sum_i of the sequence objective and its gradient
    s_i A_i (1/|y_i|) sum_t grad log pi_theta(y_it).
    """
    log_ratio = _log_ratio(logprobs, proximal_logprobs)
    mask = response_mask.float()
    seq_log_ratio = (log_ratio.detach() * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    current = logprobs.float()
    log_seq_ratio = seq_log_ratio.unsqueeze(-1) + current - current.detach()
    ratio = torch.exp(log_seq_ratio.clamp(max=GSPO_LOG_RATIO_MAX))
    loss, clipped = _clipped_surrogate(ratio, _constant(advantages), clip)
    return _terms(loss, ratio, clipped, log_ratio)


@register_policy_loss(
    "clip_cov", paper="Cui et al. 2025, The Entropy Mechanism of RL for Reasoning LMs",
    config_keys=("actor.clip_ratio_low", "actor.clip_ratio_high",
                 "actor.policy_loss.clip_cov_ratio", "actor.policy_loss.clip_cov_lb",
                 "actor.policy_loss.clip_cov_ub"))
def clip_cov_policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    clip: Clip,
    *,
    generator: torch.Generator | None = None,
) -> PolicyLossTerms:
    """Clip-Cov: detach the gradient of a few tokens with high logp/advantage covariance.

    Cui et al., 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
    Language Models". Over the batch's response tokens (means taken over the mask),

        cov_t = (A_t - mean A) (log pi_theta_t - mean log pi_theta)
        pick  = max(1, floor(clip_cov_ratio * sum m)) tokens drawn uniformly (``generator``)
                among unmasked, not PPO-clipped tokens with clip_cov_lb < cov_t < clip_cov_ub
        loss  = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), set to 0 on picked tokens

    As in verl (and the paper's code) the picked tokens' loss is zeroed, which detaches their
    gradient. No dual-clip. The count and means are over this call's batch. Shapes: (B, T) in
    and out; ``clipped`` marks PPO-clipped and picked tokens. Recommended loss_agg_mode:
    token-mean.
    """
    log_ratio = _log_ratio(logprobs, proximal_logprobs)
    ratio = log_ratio.exp()
    adv = _constant(advantages)
    mask = response_mask.float()
    pg_loss, ppo_clipped = _clipped_surrogate(ratio, adv, clip)
    cov = _centered_covariance(adv, logprobs, mask)
    candidates = (mask > 0) & ~ppo_clipped & (cov > config.clip_cov_lb) & (cov < config.clip_cov_ub)
    budget = max(int(config.clip_cov_ratio * float(mask.sum())), 1)
    picked = _random_subset(candidates, budget, generator)
    loss = pg_loss.masked_fill(picked, 0.0)
    return _terms(loss, ratio, ppo_clipped | picked, log_ratio)


@register_policy_loss(
    "kl_cov", paper="Cui et al. 2025, The Entropy Mechanism of RL for Reasoning LMs",
    config_keys=("actor.policy_loss.kl_cov_ratio", "actor.policy_loss.ppo_kl_coef"))
def kl_cov_policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    clip: Clip,
    *,
    generator: torch.Generator | None = None,
) -> PolicyLossTerms:
    """KL-Cov: an unclipped surrogate with a KL penalty on the top-covariance tokens.

    Cui et al., 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
    Language Models". With cov_t as in ``clip_cov_policy_loss`` and
    k = max(1, floor(kl_cov_ratio * sum m)) unmasked tokens of largest cov_t,

        loss = -A r + ppo_kl_coef |log r|     on the top-k tokens
        loss = -A r                           elsewhere

    No ratio clipping. Shapes: (B, T) in and out; ``clipped`` marks the penalized tokens.
    Recommended loss_agg_mode: token-mean.
    """
    log_ratio = _log_ratio(logprobs, proximal_logprobs)
    ratio = log_ratio.exp()
    adv = _constant(advantages)
    mask = response_mask.float()
    valid = mask > 0
    cov = _centered_covariance(adv, logprobs, mask).masked_fill(~valid, -torch.inf)
    penalized = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
    num_valid = int(valid.sum())
    if num_valid > 0:
        k = max(int(config.kl_cov_ratio * num_valid), 1)
        penalized[cov.reshape(-1).topk(k).indices] = True
    penalized = penalized.view_as(valid)
    loss = -adv * ratio + torch.where(penalized, config.ppo_kl_coef * log_ratio.abs(), 0.0)
    return _terms(loss, ratio, penalized, log_ratio)


@register_policy_loss(
    "gpg", paper="Chu et al. 2025, GPG", zero_advantage_zero_gradient=True)
def gpg_policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    clip: Clip,
    *,
    generator: torch.Generator | None = None,
) -> PolicyLossTerms:
    """GPG: plain policy gradient, no ratio and no clipping.

    Chu et al., 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
    Reasoning".

        loss = -A log pi_theta

    Shapes: (B, T) in and out; ``ratio`` is r, reported only; ``clipped`` is all False.
    Recommended loss_agg_mode: token-mean.
    """
    log_ratio = _log_ratio(logprobs, proximal_logprobs)
    loss = -_constant(advantages) * logprobs.float()
    return _terms(loss, log_ratio.exp(), torch.zeros_like(loss, dtype=torch.bool), log_ratio)


@register_policy_loss(
    "geo_mean", paper="Zhao et al. 2025, GMPO", per_sequence=True,
    zero_advantage_zero_gradient=True,
    config_keys=("actor.clip_ratio_low", "actor.clip_ratio_high"))
def geo_mean_policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    clip: Clip,
    *,
    generator: torch.Generator | None = None,
) -> PolicyLossTerms:
    """GMPO: the geometric mean of token ratios, each clipped pessimistically in log space.

    Zhao et al., 2025, "Geometric-Mean Policy Optimization". With sgn = sign(A) and
    |y_i| the row's mask sum,

        l_it  = sgn min(sgn log r_it, sgn clip(log r_it, -eps_low, eps_high))
        A_i   = (1 / |y_i|) sum_t m_it A_it
        L_i   = -A_i exp((1 / |y_i|) sum_t m_it l_it)
        loss_it = L_i                                          (broadcast over the row)

    Shapes: (B, T) in and out; ``ratio`` is the token ratio r that is clipped. Aggregated
    with seq-mean-token-mean, which gives GMPO's (1/B) sum_i L_i, verl's plain mean over
    sequences (token-mean would weight each sequence by its length). The paper uses
    eps_low = eps_high = 0.4. Importance weights enter as their geometric mean over the row
    (``policy_loss``).
    """
    log_ratio = _log_ratio(logprobs, proximal_logprobs)
    adv = _constant(advantages)
    mask = response_mask.float()
    sign = adv.sign()
    bounded = log_ratio.clamp(-clip.low, clip.high)
    token_log_ratio = sign * torch.minimum(sign * log_ratio, sign * bounded)
    clipped = sign * bounded < sign * log_ratio
    lengths = mask.sum(-1).clamp(min=1.0)
    seq_ratio = torch.exp((token_log_ratio * mask).sum(-1) / lengths)
    seq_advantage = (adv * mask).sum(-1) / lengths
    loss = (-seq_advantage * seq_ratio).unsqueeze(-1).expand_as(log_ratio)
    return _terms(loss, log_ratio.exp(), clipped, log_ratio)


@register_policy_loss(
    "cispo", paper="MiniMax 2025, MiniMax-M1", zero_advantage_zero_gradient=True,
    config_keys=("actor.clip_ratio_low", "actor.clip_ratio_high"))
def cispo_policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    clip: Clip,
    *,
    generator: torch.Generator | None = None,
) -> PolicyLossTerms:
    """CISPO: REINFORCE weighted by the clipped, stop-gradient ratio; no token is dropped.

    MiniMax, 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
    Attention".

        loss = -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi_theta

    Shapes: (B, T) in and out; ``clipped`` marks r outside the bounds. The paper sets no
    lower bound in effect (a large eps_low). Recommended loss_agg_mode: token-mean (the
    paper normalizes by the total token count).
    """
    log_ratio = _log_ratio(logprobs, proximal_logprobs)
    ratio = log_ratio.exp()
    weight = ratio.detach().clamp(1.0 - clip.low, 1.0 + clip.high)
    loss = -weight * _constant(advantages) * logprobs.float()
    return _terms(loss, ratio, weight != ratio.detach(), log_ratio)


@register_policy_loss(
    "sapo", paper="Gao et al. 2025, Soft Adaptive Policy Optimization", per_sequence=True,
    zero_advantage_zero_gradient=True,
    config_keys=("actor.policy_loss.tau_pos", "actor.policy_loss.tau_neg"))
def sapo_policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    clip: Clip,
    *,
    generator: torch.Generator | None = None,
) -> PolicyLossTerms:
    """SAPO: a smooth sigmoid gate on the ratio instead of a hard clip.

    Gao et al. (Qwen), 2025, "Soft Adaptive Policy Optimization".

        tau  = tau_pos if A > 0 else tau_neg
        loss = -A (4 / tau) sigmoid(tau (r - 1))

    The gate's gradient 4 sigmoid (1 - sigmoid) r dlogp equals the plain policy gradient at
    r = 1 and fades smoothly as r leaves 1. Shapes: (B, T) in and out; ``clipped`` is all
    False. Aggregated with seq-mean-token-mean (as verl forces).
    """
    log_ratio = _log_ratio(logprobs, proximal_logprobs)
    ratio = log_ratio.exp()
    adv = _constant(advantages)
    tau = torch.where(adv > 0, config.tau_pos, config.tau_neg)
    loss = -adv * torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return _terms(loss, ratio, torch.zeros_like(loss, dtype=torch.bool), log_ratio)


LOSS_MODES: dict[str, Callable[..., PolicyLossTerms]] = {
    name: entry.function for name, entry in POLICY_LOSSES.items()
    if entry.function.__module__ == __name__}
"""The built-in modes' functions, by name."""

def policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    importance_weights: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> PolicyLossTerms:
    """The per-token loss of ``config.loss_mode`` (see the module docstring).

    Every tensor is (B, T); ``advantages`` already broadcast over tokens; ``response_mask``
    float, the tokens that are trained on (the off-policy correction's mask, rejected tokens
    0). ``clip_ratio_low`` / ``clip_ratio_high`` / ``clip_ratio_c``: verl's
    ``actor.clip_ratio_*`` (eps_low, eps_high, the dual-clip bound c > 1).
    ``importance_weights``: the detached off-policy weights w, multiplied into each token's
    loss; geo_mean's sequence loss takes their geometric mean over the row,
    exp(sum_t m_t log w_t / sum_t m_t), as verl. ``generator`` drives clip_cov's random choice
    (the global RNG if None); other modes are deterministic and ignore it.
    """
    mode_fn = policy_loss_mode(config.loss_mode).function
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (dual-clip bound), got {clip_ratio_c}")
    clip = Clip(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    terms = mode_fn(logprobs, proximal_logprobs, advantages, response_mask, config, clip,
                    generator=generator)
    if importance_weights is None:
        return terms
    weights = importance_weights.detach().float()
    if mode_fn is geo_mean_policy_loss:
        weights = _geometric_row_mean(weights, response_mask.float()).expand_as(weights)
    return msgspec.structs.replace(terms, loss=terms.loss * weights)


def policy_loss_agg_mode(loss_mode: str, configured: LossAggMode) -> LossAggMode:
    """How the policy loss of ``loss_mode`` is aggregated: seq-mean-token-mean for the
    per-sequence objectives (gspo, sapo, geo_mean), as verl forces; ``configured``
    (``actor.loss_agg_mode``) for the rest."""
    return "seq-mean-token-mean" if policy_loss_mode(loss_mode).per_sequence else configured


def _geometric_row_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """exp(sum_t m_t log v_t / sum_t m_t) per row, (B, 1); 1 for an empty row."""
    logs = values.clamp(min=1e-10).log() * mask
    return torch.exp(logs.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0))


def _constant(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().float()


def _log_ratio(logprobs: torch.Tensor, proximal_logprobs: torch.Tensor) -> torch.Tensor:
    """log r in fp32, clamped to [-20, 20]; gradient flows through ``logprobs`` only."""
    log_ratio = logprobs.float() - _constant(proximal_logprobs)
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip: Clip
) -> tuple[torch.Tensor, torch.Tensor]:
    """max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) and where the clipped term won."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip.low, 1.0 + clip.high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).detach()


def _centered_covariance(
    advantages: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """(A_t - mean A) (log pi_t - mean log pi) per token, means over the mask; no grad."""
    logprobs = _constant(logprobs)
    return ((advantages - masked_mean(advantages, mask))
            * (logprobs - masked_mean(logprobs, mask)))


def _random_subset(
    candidates: torch.Tensor, budget: int, generator: torch.Generator | None
) -> torch.Tensor:
    """A bool mask of min(budget, #candidates) entries of ``candidates`` drawn uniformly."""
    indices = candidates.reshape(-1).nonzero().squeeze(-1)
    device = generator.device if generator is not None else torch.device("cpu")
    order = torch.randperm(indices.numel(), generator=generator, device=device)
    picked = torch.zeros(candidates.numel(), dtype=torch.bool, device=candidates.device)
    picked[indices[order[:budget].to(indices.device)]] = True
    return picked.view_as(candidates)


def _terms(
    loss: torch.Tensor, ratio: torch.Tensor, clipped: torch.Tensor, log_ratio: torch.Tensor
) -> PolicyLossTerms:
    log_ratio = log_ratio.detach()
    return PolicyLossTerms(loss=loss, ratio=ratio.detach(), clipped=clipped.detach(),
                           approx_kl=torch.expm1(log_ratio) - log_ratio)
