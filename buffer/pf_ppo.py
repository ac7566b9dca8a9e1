"""PF-PPO policy filtration, per prompt group.

Shen et al. 2025, "Policy Filtration for RLHF to Mitigate Noise in Reward Models" (PF-PPO).
A reward model is more reliable at the extremes of its scores than in the middle, so PF-PPO
trains on the filtered policy

    pi_f(y | x)  proportional to  w(R(x, y)) * pi(y | x)

realised per prompt: sample n responses y_1..y_n of x, rank them by reward R, and keep

- ``best``         (BoN): { argmax_i R_i }
- ``best_random``  (BR):  { argmax_i R_i, one other sample drawn uniformly }
- ``best_worst``   (BW):  { argmax_i R_i, argmin over the others of R_i }

The kept samples replace the group before it is stored, so the learner computes advantages
over them alone. (verl's ``pf_ppo`` reweights the whole batch instead; this is the paper's
per-prompt form.) Ties go to the lowest index; the random draw is seeded by ``seed`` and the
group's rollout id, so a group's choice is the same whatever order groups arrive in.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
import msgspec

from relay.configs.run_schema import PfPpoMode as Mode
from relay.transport.messages import RolloutGroup


def _best(rewards: Sequence[float]) -> int:
    return max(range(len(rewards)), key=lambda i: (rewards[i], -i))


def _worst(rewards: Sequence[float], among: list[int]) -> int:
    return min(among, key=lambda i: (rewards[i], i))


def kept_indices(rewards: Sequence[float], mode: Mode, rng: random.Random) -> list[int]:
    """Indices of the samples ``mode`` keeps, in their original order."""
    best = _best(rewards)
    others = [i for i in range(len(rewards)) if i != best]
    if mode == "best" or not others:
        return [best]
    second = rng.choice(others) if mode == "best_random" else _worst(rewards, others)
    return sorted((best, second))


class PolicyFiltration:
    """The ``GroupFilter`` for PF-PPO: keeps some samples of every group, drops none."""

    def __init__(self, mode: Mode, seed: int) -> None:
        self.mode = mode
        self.seed = seed

    def __call__(self, group: RolloutGroup) -> RolloutGroup:
        rng = random.Random(f"{self.seed}/{group.rollout_id}")
        keep = kept_indices([s.reward for s in group.samples], self.mode, rng)
        return msgspec.structs.replace(group, samples=[group.samples[i] for i in keep])
