"""Advantage estimators, registered under verl's names, as pure functions on tensors.

Shapes: B samples, T response positions, m (B, T) the response mask. Samples of the same
prompt form a group, identified by ``group_ids`` (B,) (any integer labels; groups need not be
contiguous nor equal in size). With r (B,) the outcome reward and k (B, T) the extra per-token
rewards (e.g. -beta * KL when the KL penalty is in the reward), a sample is seen two ways,
both as verl derives them from its ``token_level_rewards``:

* score                      s_i  = r_i + sum_t m_it k_it                 (``sequence_scores``)
  used by the outcome estimators: grpo, rloo, opo, gpg, grpo_passk,
  reinforce_plus_plus_baseline;
* token-level total reward   R_it = m_it k_it + r_i [t = last response token of i]
                                                                      (``token_level_rewards``)
  used by the return-based ones: reinforce_plus_plus, remax, and ``gae_advantages``.

Rejection (``algorithm.rollout_correction``'s ``rollout_rs`` or M2PO) decides which response
tokens are trained on; verl rewrites the response mask with it before computing advantages,
and so does Relay through ``kept_mask``: batch statistics are taken over the kept tokens
(REINFORCE++'s and GAE's whitening, OPO's lengths), and advantages are 0 on rejected tokens.
Rewards stay where the response put them, and returns still flow back along the whole
response: unlike verl, whose return recursion treats a masked token as a tool-observation
token (no reward of its own, nothing flows across), a rejected token here is a policy token
whose reward is real, so a rejected last token does not erase its sequence's outcome.

A multi-turn episode's tokens inserted between its turns (tool responses, the chat
template's markers) are off m altogether (``relay.learner.batch``): no reward sits there,
the outcome sits on the last policy token, and the return-based estimators skip them, so a
later turn's return reaches the earlier turns (REINFORCE++ and GAE step from one response
position to the next; verl's REINFORCE++ resets there instead).

Every estimator returns a (B, T) float32 tensor that is 0 off the response mask. One deviation
from verl holds throughout: a group of a single sample has its own score as baseline, so its
advantage is 0 (before any batch whitening); verl uses the baseline 0 there, which makes the
raw score that sample's advantage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch

from relay.algorithms.registry import ADV_ESTIMATORS, advantage_estimator, register_adv_estimator

_WHITEN_EPS = 1e-8  # verl's masked_whiten constant
_STD_EPS = 1e-6  # added to the group std (verl's epsilon)


@dataclass(frozen=True)
class AdvantageInputs:
    """A batch's rewards. ``token_rewards`` is 0 off the response and excludes the outcome
    reward; ``baseline_rewards`` is ReMax's reward of the greedy sample of each sample's prompt;
    ``kept_mask`` the response tokens the off-policy correction kept (None: all of them).
    """

    rewards: torch.Tensor  # (B,)
    group_ids: torch.Tensor  # (B,) long
    response_mask: torch.Tensor  # (B, T)
    token_rewards: torch.Tensor | None = None  # (B, T)
    baseline_rewards: torch.Tensor | None = None  # (B,)
    kept_mask: torch.Tensor | None = None  # (B, T), within response_mask

    @property
    def trained_mask(self) -> torch.Tensor:
        """The tokens trained on: the response mask times ``kept_mask`` (B, T)."""
        if self.kept_mask is None:
            return self.response_mask
        return self.response_mask * self.kept_mask


# An estimator: (inputs, norm_adv_by_std_in_grpo, gamma) -> advantages (B, T); the scalars
# are verl's algorithm.norm_adv_by_std_in_grpo (grpo, grpo_passk) and algorithm.gamma
# (reinforce_plus_plus), ignored by the estimators that do not use them.
Estimator = Callable[[AdvantageInputs, bool, float], torch.Tensor]


# ---------------------------------------------------------------------------- group helpers


def group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Dense group index 0..G-1 per sample (B,) and the number of groups G."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, int(inverse.max()) + 1 if inverse.numel() else 0


def group_sum(values: torch.Tensor, inverse: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Sum of ``values`` (B,) over each group, (G,)."""
    total = torch.zeros(num_groups, dtype=values.dtype, device=values.device)
    return total.index_add_(0, inverse, values)


def group_stats(values: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-sample group mean, unbiased group std and group size, each (B,) float64.

    A group of one has std 0 (no spread to normalize by).
    """
    inverse, num_groups = group_index(group_ids)
    values = values.to(torch.float64)
    count = group_sum(torch.ones_like(values), inverse, num_groups)
    mean = group_sum(values, inverse, num_groups) / count
    sq_dev = group_sum((values - mean[inverse]) ** 2, inverse, num_groups)
    std = torch.where(count > 1, (sq_dev / (count - 1).clamp(min=1)).sqrt(),
                      torch.zeros_like(count))
    return mean[inverse], std[inverse], count[inverse]


def _centered(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """s_i - mean_g(s), (B,); 0 for a group of one."""
    mean, _, count = group_stats(scores, group_ids)
    return torch.where(count > 1, scores - mean, torch.zeros_like(scores))


# ------------------------------------------------------------------------- reward views


def sequence_scores(inputs: AdvantageInputs) -> torch.Tensor:
    """s_i = r_i + sum_t m_it k_it, (B,) float64 (verl: ``token_level_rewards.sum(-1)``)."""
    scores = inputs.rewards.to(torch.float64)
    if inputs.token_rewards is None:
        return scores
    mask = inputs.response_mask.to(torch.float64)
    return scores + (inputs.token_rewards.to(torch.float64) * mask).sum(-1)


def token_level_rewards(inputs: AdvantageInputs) -> torch.Tensor:
    """R_it = m_it k_it + r_i [t = last response token of i], (B, T) float64.

    This is verl's ``token_level_rewards`` (outcome reward on the last response token); feed it
    to ``gae_advantages``. A sample with an empty response carries no reward.
    """
    mask = inputs.response_mask.to(torch.float64)
    total = torch.zeros_like(mask) if inputs.token_rewards is None else (
        inputs.token_rewards.to(torch.float64) * mask)
    last = mask.shape[-1] - 1 - (mask.flip(-1) > 0).to(torch.float64).argmax(-1)
    outcome = torch.where(mask.sum(-1) > 0, inputs.rewards.to(torch.float64),
                          torch.zeros_like(mask[:, 0]))
    return total.scatter_add(1, last.unsqueeze(-1), outcome.unsqueeze(-1))


# ------------------------------------------------------------------------ token helpers


def _broadcast(per_sample: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, T) float32 over the response tokens, 0 elsewhere."""
    return (per_sample.to(torch.float64).unsqueeze(-1) * mask.to(torch.float64)).float()


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's ``masked_whiten`` over all masked tokens of the batch, then masked:

        (x - mean_m(x)) / sqrt(var_m(x) + 1e-8),  var_m unbiased (Bessel over the token count)

    Fewer than two masked tokens give 0 (verl raises there).
    """
    mask = mask.to(values.dtype)
    count = mask.sum()
    mean = (values * mask).sum() / count.clamp(min=1)
    var = ((values - mean) ** 2 * mask).sum() / (count - 1).clamp(min=1)
    return (values - mean) * torch.rsqrt(var + _WHITEN_EPS) * mask


def _discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = R_t + gamma * G_t', (B, T), where t' is the next position of the mask (0 past
    the last); G is 0 off the mask. Positions off the mask are skipped, as in
    ``gae_advantages``: a multi-turn episode's inserted tokens (tool responses, template)
    lie between its turns, and a later turn's return flows back across them to the earlier
    turns. verl resets the running return at every masked position ("reset after EOS"),
    which with a contiguous response mask gives the same returns on it."""
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[-1])):
        on = mask[:, t] > 0
        running = torch.where(on, rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(on, running, 0.0)
    return returns


# ----------------------------------------------------------------------------- estimators


def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO's group-relative advantage (Shao et al., 2024, DeepSeekMath):

        A_i = (r_i - mean_g(r)) / (std_g(r) + eps)     if norm_by_std  (GRPO)
        A_i =  r_i - mean_g(r)                          otherwise      (Dr.GRPO, Liu et al. 2025)

    std is the unbiased sample standard deviation of the group's rewards (as verl computes
    it); a group of one sample gets advantage 0. Shapes: rewards, group_ids (B,) -> (B,).
    """
    mean, std, count = group_stats(rewards, group_ids)
    centered = rewards.to(torch.float64) - mean
    advantages = centered / (std + eps) if norm_by_std else centered
    return torch.where(count > 1, advantages, torch.zeros_like(advantages)).to(torch.float32)


@register_adv_estimator("grpo", paper="Shao et al. 2024, DeepSeekMath", group=True,
                        config_keys=("algorithm.norm_adv_by_std_in_grpo",))
def grpo(inputs: AdvantageInputs, norm_by_std: bool, gamma: float) -> torch.Tensor:
    """``grpo``: ``grpo_advantages`` of the scores s (B,), broadcast over the response (B, T).

    GRPO (arXiv 2402.03300) when ``norm_by_std`` (``algorithm.norm_adv_by_std_in_grpo``),
    else Dr.GRPO (arXiv 2503.20783).
    """
    advantages = grpo_advantages(sequence_scores(inputs), inputs.group_ids,
                                 norm_by_std=norm_by_std, eps=_STD_EPS)
    return _broadcast(advantages, inputs.trained_mask)


@register_adv_estimator("rloo", paper="Ahmadian et al. 2024, Back to Basics", group=True)
def rloo(inputs: AdvantageInputs, norm_by_std: bool, gamma: float) -> torch.Tensor:
    """``rloo``: REINFORCE leave-one-out (Ahmadian et al., 2024, arXiv 2402.14740):

        A_i = s_i - mean_{j != i in g} s_j = n/(n-1) * (s_i - mean_g(s))     (B,) -> (B, T)

    with n the size of i's group.
    """
    scores = sequence_scores(inputs)
    mean, _, count = group_stats(scores, inputs.group_ids)
    advantages = torch.where(count > 1, count / (count - 1).clamp(min=1) * (scores - mean),
                             torch.zeros_like(scores))
    return _broadcast(advantages, inputs.trained_mask)


@register_adv_estimator("opo", paper="Hao et al. 2025, On-Policy RL with Optimal Reward Baseline",
                        group=True)
def opo(inputs: AdvantageInputs, norm_by_std: bool, gamma: float) -> torch.Tensor:
    """``opo``: On-Policy RL with Optimal reward baseline (Hao et al., 2025, arXiv 2505.23585):

        A_i = s_i - b_g,   b_g = sum_{j in g} |o_j| s_j / sum_{j in g} |o_j|     (B,) -> (B, T)

    with |o_j| = sum_t m_jt the response length (a length-weighted group mean), counting the
    kept tokens only under rejection (verl computes it on the rejection-rewritten mask).
    """
    scores = sequence_scores(inputs)
    lengths = inputs.trained_mask.to(torch.float64).sum(-1)
    inverse, num_groups = group_index(inputs.group_ids)
    weighted = group_sum(lengths * scores, inverse, num_groups)
    total_length = group_sum(lengths, inverse, num_groups).clamp(min=1)  # token counts
    count = group_sum(torch.ones_like(scores), inverse, num_groups)
    advantages = torch.where(count[inverse] > 1, scores - (weighted / total_length)[inverse],
                             torch.zeros_like(scores))
    return _broadcast(advantages, inputs.trained_mask)


@register_adv_estimator("gpg", paper="Chu et al. 2025, GPG", group=True)
def gpg(inputs: AdvantageInputs, norm_by_std: bool, gamma: float) -> torch.Tensor:
    """``gpg``: Group Policy Gradient (Chu et al., 2025, arXiv 2504.02546), as verl computes it:

        A_i = alpha * (s_i - mean_g(s)) / F_norm,   alpha = B / max(1, #{j : s_j != 0})
                                                                              (B,) -> (B, T)

    with F_norm = 1 (verl's default, which its trainer never changes). The paper's alpha is
    B / M with M the number of samples in groups whose rewards are not all equal; verl counts
    the samples with a nonzero score instead, and we follow verl.
    """
    scores = sequence_scores(inputs)
    alpha = scores.numel() / max(1, int(torch.count_nonzero(scores)))
    return _broadcast(alpha * _centered(scores, inputs.group_ids), inputs.trained_mask)


@register_adv_estimator("grpo_passk", paper="Chen et al. 2025, Pass@k Training", group=True,
                        config_keys=("algorithm.norm_adv_by_std_in_grpo",))
def grpo_passk(inputs: AdvantageInputs, norm_by_std: bool, gamma: float) -> torch.Tensor:
    """``grpo_passk``: Pass@k training (Chen et al., 2025, arXiv 2503.19595), as verl:

        A_i = (s_max - s_second) / (std_g(s) + eps)   for the best sample i of its group g
        A_j = 0                                        for every other sample   (B,) -> (B, T)

    s_second is the group's second-largest score (equal to s_max on a tie, giving 0), std_g the
    unbiased group std; without ``norm_by_std`` no division. verl raises on
    a group of one; here it gets 0.
    """
    scores = sequence_scores(inputs)
    inverse, num_groups = group_index(inputs.group_ids)
    order = torch.argsort(scores, descending=True, stable=True)
    order = order[torch.argsort(inverse[order], stable=True)]  # by group, best first
    count = group_sum(torch.ones_like(scores), inverse, num_groups).long()
    first = torch.cumsum(count, 0) - count
    paired = count > 1
    best, second = order[first[paired]], order[first[paired] + 1]
    gap = scores[best] - scores[second]
    if norm_by_std:
        _, std, _ = group_stats(scores, inputs.group_ids)
        gap = gap / (std[best] + _STD_EPS)
    advantages = torch.zeros_like(scores).index_put_((best,), gap)
    return _broadcast(advantages, inputs.trained_mask)


@register_adv_estimator("reinforce_plus_plus_baseline", paper="Hu 2025, REINFORCE++",
                        group=True)
def reinforce_plus_plus_baseline(inputs: AdvantageInputs, norm_by_std: bool,
                                 gamma: float) -> torch.Tensor:
    """``reinforce_plus_plus_baseline``: REINFORCE++ with a group baseline (Hu, 2025,
    arXiv 2501.03262):

        A_it = whiten_batch( m_it * (s_i - mean_g(s)) )                       (B, T)

    whitened over all trained tokens of the batch (so longer responses weigh more in the
    statistics, as in verl).
    """
    mask = inputs.trained_mask.to(torch.float64)
    centered = _centered(sequence_scores(inputs), inputs.group_ids)
    return masked_whiten(centered.unsqueeze(-1) * mask, mask).float()


@register_adv_estimator("reinforce_plus_plus", paper="Hu 2025, REINFORCE++",
                        config_keys=("algorithm.gamma",))
def reinforce_plus_plus(inputs: AdvantageInputs, norm_by_std: bool, gamma: float) -> torch.Tensor:
    """``reinforce_plus_plus``: REINFORCE++ (Hu, 2025, arXiv 2501.03262):

        G_it = sum_{t' >= t} gamma^(t'-t) R_it',   A_it = whiten_batch(G_it)      (B, T)

    on the token-level total rewards R, whitened over all trained tokens of the batch; t' runs
    over the response mask only, so a multi-turn episode's return flows back across the
    inserted tokens between its turns (``_discounted_returns``).
    """
    mask = inputs.response_mask.to(torch.float64)
    returns = _discounted_returns(token_level_rewards(inputs), mask, gamma)
    return masked_whiten(returns, inputs.trained_mask.to(torch.float64)).float()


@register_adv_estimator("remax", paper="Li et al. 2023, ReMax", greedy_baseline=True)
def remax(inputs: AdvantageInputs, norm_by_std: bool, gamma: float) -> torch.Tensor:
    """``remax``: ReMax (Li et al., 2023, arXiv 2310.10505):

        A_it = m_it * (sum_{t' >= t} R_it' - b_i)                               (B, T)

    with b_i = ``baseline_rewards`` (the reward of the greedy response to i's prompt) and R
    the token-level total rewards; the return is undiscounted (verl ignores gamma here). With
    outcome rewards only, A_it = r_i - b_i on every response token.
    """
    if inputs.baseline_rewards is None:
        raise ValueError("remax needs AdvantageInputs.baseline_rewards: the reward of the "
                         "greedy sample of each sample's prompt, shape (B,)")
    mask = inputs.trained_mask.to(torch.float64)
    returns = token_level_rewards(inputs).flip(-1).cumsum(-1).flip(-1)
    baseline = inputs.baseline_rewards.to(torch.float64).unsqueeze(-1)
    return ((returns - baseline) * mask).float()


AdvEstimator = Literal["gae", "grpo", "rloo", "reinforce_plus_plus",
                       "reinforce_plus_plus_baseline", "opo", "gpg", "grpo_passk", "remax",
                       "prime"]
"""verl's ``algorithm.adv_estimator``: the built-in entries of ``relay.algorithms.registry``,
``ESTIMATORS``, ``gae`` (with the learner's critic: ``gae_advantages``) and ``prime``
(``relay.algorithms.prime``)."""

DEFAULT_ESTIMATOR: AdvEstimator = "grpo"

ESTIMATORS: dict[str, Estimator] = {
    name: entry.function for name, entry in ADV_ESTIMATORS.items()
    if entry.function.__module__ == __name__ and not entry.learned_models}
"""The built-in estimators of the ``Estimator`` protocol (those without a learned model)."""


def _check_shapes(inputs: AdvantageInputs) -> None:
    if inputs.response_mask.dim() != 2:
        raise ValueError(f"response_mask must be (B, T), got {tuple(inputs.response_mask.shape)}")
    batch = inputs.response_mask.shape[:1]
    expected = {"rewards": batch, "group_ids": batch, "baseline_rewards": batch,
                "token_rewards": inputs.response_mask.shape,
                "kept_mask": inputs.response_mask.shape}
    for field, shape in expected.items():
        value = getattr(inputs, field)
        if value is not None and value.shape != shape:
            raise ValueError(f"{field} must have shape {tuple(shape)}, got {tuple(value.shape)}")


@torch.no_grad()
def compute_advantages(
    name: str, inputs: AdvantageInputs, *, norm_adv_by_std_in_grpo: bool, gamma: float
) -> torch.Tensor:
    """Advantages (B, T) float32, 0 off the trained tokens, of the estimator registered as
    ``name`` (``relay.algorithms.registry``); ``norm_adv_by_std_in_grpo`` and ``gamma`` are
    verl's ``algorithm`` keys."""
    entry = advantage_estimator(name)
    if entry.learned_models:
        raise ValueError(f"advantage estimator {name!r} needs the learner's "
                         f"{' and '.join(entry.learned_models)}; the learner computes it")
    _check_shapes(inputs)
    return entry.function(inputs, norm_adv_by_std_in_grpo, gamma)


@register_adv_estimator("gae", paper="Schulman et al. 2016", critic=True,
                        config_keys=("algorithm.gamma", "algorithm.lam", "critic"))
@torch.no_grad()
def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    kept_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al., 2016, arXiv 1506.02438), as verl:

        delta_t = R_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}           returns_t = A_t + V_t

    where t+1 is the next *response* position (masked positions are skipped: their values and
    TD errors do not enter) and V, A are 0 past the last one. ``token_rewards`` are the
    token-level total rewards R (outcome reward included, e.g. ``token_level_rewards``).
    Returns (advantages whitened over the batch's trained tokens, returns), both (B, T)
    float32 and 0 off the response (verl leaves leftovers there). Under rejection
    (``kept_mask``, see the module docstring) the whitening statistics are over the kept tokens
    and advantages are 0 on the rejected ones; the recursion and the critic's returns still
    run over the whole response.
    """
    rewards, values = token_rewards.to(torch.float64), values.to(torch.float64)
    mask = response_mask.to(torch.float64)
    advantages = torch.zeros_like(rewards)
    next_value = next_advantage = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[-1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        m = mask[:, t]
        next_value = m * values[:, t] + (1 - m) * next_value
        next_advantage = m * advantage + (1 - m) * next_advantage
        advantages[:, t] = next_advantage
    returns = (advantages + values) * mask
    trained = mask if kept_mask is None else mask * kept_mask.to(torch.float64)
    return masked_whiten(advantages, trained).float(), returns.float()
