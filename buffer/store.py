"""Where accepted rollout groups wait for the learner.

``ReplayStore`` is the seam that replay policies plug into (prioritized sampling, PF-PPO
filtering, reuse bounds come in later); ``FifoStore`` serves groups in arrival order, each
once. A store drops groups that became too stale to train on, and says how many.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import msgspec

from buffer.staleness import staleness
from transport.messages import RolloutGroup


class Taken(msgspec.Struct, frozen=True):
    """A batch for the learner (empty when not enough groups are ready) and the drops."""

    groups: list[RolloutGroup]
    dropped_stale: list[RolloutGroup]


class ReplayStore(Protocol):
    def add(self, group: RolloutGroup) -> None: ...

    def take(self, num_groups: int, learner_version: int, max_staleness: int) -> Taken: ...

    def __len__(self) -> int: ...


class FifoStore:
    """First in, first out; a group is trained on at most once."""

    def __init__(self) -> None:
        self._groups: deque[RolloutGroup] = deque()

    def add(self, group: RolloutGroup) -> None:
        self._groups.append(group)

    def take(self, num_groups: int, learner_version: int, max_staleness: int) -> Taken:
        """Drop groups staler than ``max_staleness``, then the oldest ``num_groups`` or none."""
        fresh = [g for g in self._groups if staleness(g, learner_version) <= max_staleness]
        dropped = [g for g in self._groups if staleness(g, learner_version) > max_staleness]
        if len(fresh) < num_groups:
            self._groups = deque(fresh)
            return Taken(groups=[], dropped_stale=dropped)
        self._groups = deque(fresh[num_groups:])
        return Taken(groups=fresh[:num_groups], dropped_stale=dropped)

    def __len__(self) -> int:
        return len(self._groups)
