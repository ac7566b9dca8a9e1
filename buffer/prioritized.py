"""Prioritized replay of prompt groups, with importance weights, reuse bound and age eviction.

Schaul et al. 2016, "Prioritized Experience Replay". Every group i in the store has a
priority p_i >= 0; a batch draws ``num_groups`` distinct groups, group i with probability

    P(i) = (p_i + eps)^alpha / sum_k (p_k + eps)^alpha

(alpha = 0 is uniform replay). Drawing by P instead of uniformly biases the update towards
high-priority groups; the learner multiplies every token loss of group i by

    w_i = (N * P(i))^(-beta) / max_{j in batch} (N * P(j))^(-beta)   (N: groups in the store)

so beta = 1 undoes the bias fully and w <= 1 only ever scales the update down. (Schaul
divides by the largest weight over the whole store; here zero-priority groups, e.g. all
samples right, are common and would shrink every other weight towards 0, so the batch's
largest weight is the reference, as in Dopamine's implementation.)

Priorities (``buffer.replay.priority``):

- ``uniform``:   p_i = 1.
- ``advantage``: p_i = mean_j |r_j - mean_k r_k| over the group's samples: the size of
  the group-centered advantage (Dr.GRPO's); 0 for a group whose samples all score the same.
- ``pass_rate``: p_i = 4 q (1 - q), q = fraction of the group's samples whose reward is
  >= ``pass_threshold``; 1 at q = 1/2, 0 when all pass or all fail (the "learnability" of
  Foster & Foerster 2025, Learning to Reason at the Frontier of Learnability).
- ``td_error``:  p_i = mean over the group's response tokens of |R_t - V_t| (GAE return
  minus the critic's value, i.e. |A_t|), reported by the learner after it trains on the
  group (``update_priorities``). A group not trained on yet gets the largest priority
  seen so far, so every group is drawn at least once with high probability (Schaul's rule).

A group is trained on at most ``max_reuse`` times, then leaves the store. It is evicted
once its staleness (learner version - oldest token version) exceeds ``max_age``; a group
evicted before it was ever drawn is reported as dropped (it frees its admission slot).
Draws use a generator seeded by ``seed``, so a replay is reproducible given the arrivals.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from typing import get_args

import torch

from buffer.staleness import staleness
from buffer.store import Admission, Taken, keep_all
from configs.run_schema import ReplayConfig, ReplayPriority
from transport.messages import RolloutGroup

PRIORITIES: tuple[str, ...] = tuple(p for p in get_args(ReplayPriority) if p != "fifo")


def advantage_priority(rewards: list[float]) -> float:
    """mean_j |r_j - mean(r)|."""
    mean = sum(rewards) / len(rewards)
    return sum(abs(r - mean) for r in rewards) / len(rewards)


def pass_rate_priority(rewards: list[float], pass_threshold: float) -> float:
    """4 q (1 - q), q the fraction of rewards >= ``pass_threshold``."""
    q = sum(r >= pass_threshold for r in rewards) / len(rewards)
    return 4.0 * q * (1.0 - q)


def sampling_probabilities(priorities: torch.Tensor, alpha: float,
                           epsilon: float) -> torch.Tensor:
    """P(i) = (p_i + eps)^alpha / sum_k (p_k + eps)^alpha, float64 of shape (N,)."""
    scaled = (priorities.double() + epsilon) ** alpha
    return scaled / scaled.sum()


def importance_weights(drawn: torch.Tensor, store_size: int, beta: float) -> torch.Tensor:
    """w_i = (N P(i))^-beta / max_j (N P(j))^-beta over the drawn groups' probabilities
    ``drawn`` (D,), N = ``store_size``."""
    weights = (store_size * drawn) ** (-beta)
    return weights / weights.max()


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
        self.priority, self.alpha, self.beta = config.priority, config.alpha, config.beta
        self.epsilon, self.max_reuse = config.epsilon, config.max_reuse
        self.max_age = max_staleness if config.max_age < 0 else config.max_age
        self.pass_threshold = config.pass_threshold
        self._entries: dict[str, _Entry] = {}  # by rollout id, in arrival order
        self._rng = torch.Generator().manual_seed(config.seed)
        self._max_priority = 1.0
        self.counts: Counter[str] = Counter(
            {"evicted_after_use": 0, "retired_max_reuse": 0, "draws": 0, "redraws": 0})
        self._last_weight_min = 1.0

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
        left the store are skipped."""
        for rollout_id, priority in priorities.items():
            if not math.isfinite(priority) or priority < 0:
                raise ValueError(f"priority of {rollout_id} must be >= 0, got {priority}")
            self._max_priority = max(self._max_priority, priority)
            entry = self._entries.get(rollout_id)
            if entry is not None:
                entry.priority = priority

    def take(self, num_groups: int, learner_version: int, max_staleness: int) -> Taken:
        """Evict by age, then draw ``num_groups`` distinct groups by priority (or none)."""
        dropped = self._evict(learner_version, min(self.max_age, max_staleness))
        if len(self._entries) < num_groups:
            return Taken(groups=[], dropped_stale=dropped)
        entries = list(self._entries.values())
        probabilities = sampling_probabilities(
            torch.tensor([e.priority for e in entries]), self.alpha, self.epsilon)
        drawn = torch.multinomial(probabilities, num_groups, replacement=False,
                                  generator=self._rng).tolist()
        weights = importance_weights(probabilities[drawn], len(entries), self.beta)
        chosen = [entries[i] for i in drawn]
        for entry in chosen:
            self.counts["draws"] += 1
            self.counts["redraws"] += entry.uses > 0
            entry.uses += 1
            if entry.uses >= self.max_reuse:
                del self._entries[entry.group.rollout_id]
                self.counts["retired_max_reuse"] += 1
        batch_weights = weights.tolist()
        self._last_weight_min = min(batch_weights)
        return Taken(groups=[e.group for e in chosen], dropped_stale=dropped,
                     weights=batch_weights)

    def _evict(self, learner_version: int, max_age: int) -> list[RolloutGroup]:
        """Remove groups older than ``max_age``; return those never trained on."""
        never_used = []
        for rollout_id, entry in list(self._entries.items()):
            if staleness(entry.group, learner_version) > max_age:
                del self._entries[rollout_id]
                if entry.uses:
                    self.counts["evicted_after_use"] += 1
                else:
                    never_used.append(entry.group)
        return never_used

    def stats(self) -> dict[str, float]:
        priorities = [e.priority for e in self._entries.values()]
        stats = {f"replay/{name}": float(value) for name, value in self.counts.items()}
        stats["replay/priority_mean"] = sum(priorities) / len(priorities) if priorities else 0.0
        stats["replay/is_weight_min"] = self._last_weight_min
        return stats

    def __len__(self) -> int:
        return len(self._entries)
