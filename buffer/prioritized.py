"""Prioritized replay of prompt groups, with importance weights, reuse bound and age eviction.

Schaul et al. 2016, "Prioritized Experience Replay". Every group i in the store has a
priority p_i >= 0; a batch draws ``num_groups`` distinct groups, group i with probability

    P(i) = (p_i + eps)^alpha / sum_k (p_k + eps)^alpha

(alpha = 0 is uniform replay). Drawing by P instead of uniformly biases the update towards
high-priority groups; the learner multiplies every token loss of drawn group i by

    w_i = min(1, (N P(i))^-beta_t / max_{j in S} (N P(j))^-beta_t)
        = min(1, (min_{j in S} P(j) / P(i))^beta_t)                      (N: groups stored)

S: the drawn groups whose priority is > 0 (all drawn groups when none is). beta_t = 1
undoes the bias fully, and w <= 1 only ever scales the update down (Schaul et al. 2016,
section 3.4). The reference is not the batch's largest weight: that belongs to its least
likely group, and a zero-priority group (all samples pass or all fail) is the least likely
by far; at the defaults (alpha 0.6, beta 0.4, epsilon 1e-3) its weight put every other
group's at (1e-3^0.6)^0.4 = 0.19, in the batches that happened to draw one, although its
own gradient is zero (its advantages are). Nor is it the store's least likely group, as in
Schaul's: a near-zero TD-error would do the same from there. A zero-priority group itself
gets w = 1 (its weight only scales what it adds besides the policy gradient: KL, entropy).

beta anneals linearly over the run, as in the paper, from ``beta`` to ``beta_final``:

    beta_t = beta + (beta_final - beta) * min(1, t / T)

t the learner step the batch is drawn for, T = ``trainer.total_training_steps``.

Priorities (``buffer.replay.priority``):

- ``uniform``:   p_i = 1.
- ``advantage``: p_i = mean_j |r_j - mean_k r_k| over the group's samples: the size of
  the group-centered advantage (Dr.GRPO's); exactly 0 for a group whose samples all score
  the same.
- ``pass_rate``: p_i = 4 q (1 - q), q = fraction of the group's samples whose reward is
  >= ``pass_threshold``; 1 at q = 1/2, 0 when all pass or all fail (the "learnability" of
  Foster & Foerster 2025, Learning to Reason at the Frontier of Learnability).
- ``td_error``:  p_i = mean over the group's response tokens of |R_t - V_t| (GAE return
  minus the critic's value, i.e. |A_t|), reported by the learner after it trains on the
  group (``update_priorities``). A group not trained on yet gets the largest priority
  seen so far, so every group is drawn at least once with high probability (Schaul's rule).

A group is trained on at most ``max_reuse`` times, then leaves the store. It is evicted
once its staleness (learner version - oldest token version) exceeds ``max_age``; a group
evicted before it was ever drawn is reported as evicted (``Taken.evicted``: it frees its
admission slot, and the hub sends its prompt to the back of the epoch). Draws use a
generator seeded by ``seed``, so a replay is reproducible given the arrivals.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from typing import get_args

import msgspec
import torch

from relay.buffer.staleness import staleness
from relay.buffer.store import Admission, PriorityError, Taken, keep_all
from relay.configs.run_schema import ReplayConfig, ReplayPriority
from relay.transport.messages import RolloutGroup

PRIORITIES: tuple[str, ...] = tuple(p for p in get_args(ReplayPriority) if p != "fifo")


def advantage_priority(rewards: list[float]) -> float:
    """mean_j |r_j - mean(r)|; exactly 0 when all rewards are equal (their float mean need
    not be: 8 x 0.1 sums to 0.7999999999999999)."""
    if min(rewards) == max(rewards):
        return 0.0
    mean = sum(rewards) / len(rewards)
    return sum(abs(r - mean) for r in rewards) / len(rewards)


def pass_rate_priority(rewards: list[float], pass_threshold: float) -> float:
    """4 q (1 - q), q the fraction of rewards >= ``pass_threshold``."""
    q = sum(r >= pass_threshold for r in rewards) / len(rewards)
    return 4.0 * q * (1.0 - q)


def sampling_probabilities(priorities: torch.Tensor, alpha: float,
                           epsilon: float) -> torch.Tensor:
    """P(i) = (p_i + eps)^alpha / sum_k (p_k + eps)^alpha, float64 of shape (N,), computed
    as softmax(alpha log(p + eps)) so that no finite priority overflows the sum."""
    return torch.softmax(alpha * torch.log(priorities.double() + epsilon), dim=0)


def importance_weights(drawn: torch.Tensor, signal: torch.Tensor, beta: float) -> torch.Tensor:
    """w_i = min(1, (min_{j in S} P(j) / P(i))^beta), S the groups where ``signal`` is true
    (all when none is): the module docstring's weights, for the drawn groups' probabilities
    ``drawn`` (D,) > 0 and whether each one's priority is > 0, ``signal`` (D,) bool."""
    reference = drawn[signal].min() if bool(signal.any()) else drawn.min()
    return ((reference / drawn) ** beta).clamp(max=1.0)


def annealed_beta(beta: float, beta_final: float, run_fraction: float) -> float:
    """beta_t = beta + (beta_final - beta) * min(1, t / T), ``run_fraction`` = t / T
    (below 0 counts as 0)."""
    return beta + (beta_final - beta) * min(1.0, max(0.0, run_fraction))


class BatchWeights(msgspec.Struct, frozen=True):
    """A batch's importance weights in brief: the least, the mean over its groups with
    priority > 0 (1 when it has none: nothing that carries a gradient was scaled), and the
    beta they were computed with."""

    least: float
    signal_mean: float
    beta: float

    @classmethod
    def of(cls, weights: torch.Tensor, signal: torch.Tensor, beta: float) -> BatchWeights:
        signal_mean = float(weights[signal].mean()) if bool(signal.any()) else 1.0
        return cls(least=float(weights.min()), signal_mean=signal_mean, beta=beta)


class _Entry:
    __slots__ = ("group", "priority", "uses")

    def __init__(self, group: RolloutGroup, priority: float) -> None:
        self.group, self.priority, self.uses = group, priority, 0


class PrioritizedStore:
    """A ``ReplayStore`` that draws groups by priority and returns their importance weights."""

    def __init__(self, config: ReplayConfig, *, max_staleness: int) -> None:
        """``config`` is the run's ``buffer.replay``; ``max_staleness`` (eta) bounds its
        ``max_age`` and stands in for it when that is -1."""
        if config.priority not in PRIORITIES:
            raise ValueError(f"buffer.replay.priority = {config.priority!r} is not a priority "
                             f"of prioritized replay; known: {', '.join(PRIORITIES)}")
        self.priority, self.alpha = config.priority, config.alpha
        self.beta, self.beta_final = config.beta, config.beta_final
        self.epsilon, self.max_reuse = config.epsilon, config.max_reuse
        self.max_age = max_staleness if config.max_age < 0 else config.max_age
        self.pass_threshold = config.pass_threshold
        self._entries: dict[str, _Entry] = {}  # by rollout id, in arrival order
        self._rng = torch.Generator().manual_seed(config.seed)
        self._max_priority = 1.0
        self.counts: Counter[str] = Counter(
            {"evicted_after_use": 0, "evicted_unused": 0, "retired_max_reuse": 0, "draws": 0,
             "redraws": 0})
        self._last = BatchWeights(least=1.0, signal_mean=1.0, beta=config.beta)

    def initial_priority(self, group: RolloutGroup) -> float:
        rewards = [s.reward for s in group.samples]
        if self.priority == "advantage":
            return advantage_priority(rewards)
        if self.priority == "pass_rate":
            return pass_rate_priority(rewards, self.pass_threshold)
        if self.priority == "td_error":
            return self._max_priority
        return 1.0

    def add(self, group: RolloutGroup) -> Admission:
        self._entries[group.rollout_id] = _Entry(group, self.initial_priority(group))
        return keep_all(group)

    def update_priorities(self, priorities: Mapping[str, float]) -> None:
        """New priorities by rollout id, from the learner (``td_error``); groups that have
        left the store are skipped. Every value is checked before any is applied: one that
        is negative or not finite refuses the whole request (``PriorityError``)."""
        bad = {rollout_id: priority for rollout_id, priority in priorities.items()
               if not math.isfinite(priority) or priority < 0}
        if bad:
            shown = ", ".join(f"{rollout_id} = {priority}"
                              for rollout_id, priority in list(bad.items())[:3])
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            raise PriorityError(f"priorities must be finite and >= 0; got {shown}{more}; "
                                f"none of the {len(priorities)} was applied")
        for rollout_id, priority in priorities.items():
            self._max_priority = max(self._max_priority, priority)
            entry = self._entries.get(rollout_id)
            if entry is not None:
                entry.priority = priority

    def take(self, num_groups: int, learner_version: int, max_staleness: int, *,
             run_fraction: float) -> Taken:
        """Evict by age, then draw ``num_groups`` distinct groups by priority (or none),
        weighted with beta annealed to ``run_fraction`` of the run."""
        evicted = self._evict(learner_version, min(self.max_age, max_staleness))
        if len(self._entries) < num_groups:
            return Taken(groups=[], dropped_stale=[], evicted=evicted)
        entries = list(self._entries.values())
        priorities = torch.tensor([e.priority for e in entries], dtype=torch.float64,
                                  device="cpu")  # the hub's own host bookkeeping
        # clamped: a probability that underflowed to 0 is still drawable, and divides nothing
        probabilities = sampling_probabilities(priorities, self.alpha, self.epsilon).clamp(
            min=torch.finfo(torch.float64).tiny)
        drawn = torch.multinomial(probabilities, num_groups, replacement=False,
                                  generator=self._rng)
        signal = priorities[drawn] > 0
        beta = annealed_beta(self.beta, self.beta_final, run_fraction)
        weights = importance_weights(probabilities[drawn], signal, beta)
        self._last = BatchWeights.of(weights, signal, beta)
        chosen = [entries[i] for i in drawn.tolist()]
        for entry in chosen:
            self.counts["draws"] += 1
            self.counts["redraws"] += entry.uses > 0
            entry.uses += 1
            if entry.uses >= self.max_reuse:
                del self._entries[entry.group.rollout_id]
                self.counts["retired_max_reuse"] += 1
        return Taken(groups=[e.group for e in chosen], dropped_stale=[],
                     weights=weights.tolist(), evicted=evicted)

    def _evict(self, learner_version: int, max_age: int) -> list[RolloutGroup]:
        """Remove groups older than ``max_age``; return those never trained on."""
        never_used = []
        for rollout_id, entry in list(self._entries.items()):
            if staleness(entry.group, learner_version) > max_age:
                del self._entries[rollout_id]
                if entry.uses:
                    self.counts["evicted_after_use"] += 1
                else:
                    self.counts["evicted_unused"] += 1
                    never_used.append(entry.group)
        return never_used

    def stats(self) -> dict[str, float]:
        """Counters, the stored priorities' mean, and the last batch's weights: the least,
        and the mean over its groups with priority > 0 (``is_weight_signal_mean``: the
        scale the replay puts on the learning rate of the groups that carry a gradient)."""
        priorities = [e.priority for e in self._entries.values()]
        stats = {f"replay/{name}": float(value) for name, value in self.counts.items()}
        stats["replay/priority_mean"] = sum(priorities) / len(priorities) if priorities else 0.0
        stats["replay/is_weight_min"] = self._last.least
        stats["replay/is_weight_signal_mean"] = self._last.signal_mean
        stats["replay/beta"] = self._last.beta
        return stats

    def __len__(self) -> int:
        return len(self._entries)
