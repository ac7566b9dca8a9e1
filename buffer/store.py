"""Where accepted rollout groups wait for the learner.

``ReplayStore`` is the seam that replay policies plug into: ``add`` says whether a group was
kept (``Admission``), and a store drops groups that became too stale to train on, and says
how many. ``FifoStore`` serves groups in arrival order, each once;
``relay.buffer.prioritized.PrioritizedStore`` draws them by priority, possibly more than once,
with importance weights, and evicts by age the groups its draws passed over.
``FilteredStore`` puts group filters in front of another store: DAPO dynamic sampling
(``relay.buffer.dynamic_sampling``) drops whole groups, PF-PPO (``relay.buffer.pf_ppo``) keeps some
samples of each.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Literal, Protocol

import msgspec

from relay.buffer.staleness import staleness
from relay.transport.messages import RolloutGroup

DropReason = Literal["zero_variance"]
"""Why a group filter dropped a whole group (a ``RolloutVerdict`` of the wire)."""


class PriorityError(ValueError):
    """The learner's priorities were refused whole (the message names the rollout ids and
    values): none of them was applied."""


class Taken(msgspec.Struct, frozen=True):
    """A batch for the learner (empty when not enough groups are ready), each group's
    importance weight (empty: all 1), and the groups that left the store before they were
    ever trained on: ``dropped_stale``, too stale by the time a batch could take them (their
    prompts are generated again, with fresher weights), and ``evicted``, aged out while the
    store's draws preferred others (their prompts go to the back of the epoch: generated
    again at once, they would most likely be passed over again)."""

    groups: list[RolloutGroup]
    dropped_stale: list[RolloutGroup]
    weights: list[float] = []
    evicted: list[RolloutGroup] = []


class Admission(msgspec.Struct, frozen=True):
    """What a store did with a group: kept (``kept_samples``: indices of the samples it
    kept, in order) or dropped (``reason``: the counter ``buffer/dropped/<reason>``)."""

    kept_samples: tuple[int, ...] = ()
    reason: DropReason | Literal[""] = ""

    @property
    def kept(self) -> bool:
        return not self.reason


def keep_all(group: RolloutGroup) -> Admission:
    return Admission(kept_samples=tuple(range(len(group.samples))))


class ReplayStore(Protocol):
    def add(self, group: RolloutGroup) -> Admission: ...

    def take(self, num_groups: int, learner_version: int, max_staleness: int, *,
             run_fraction: float) -> Taken:
        """A batch of ``num_groups``; ``run_fraction`` is how far the run is (the learner
        step asked for over ``trainer.total_training_steps``, in [0, 1]), for schedules."""

    def update_priorities(self, priorities: Mapping[str, float]) -> None:
        """Priorities by rollout id that the learner measured while training; all of them
        or, with ``PriorityError``, none."""

    def stats(self) -> dict[str, float]:
        """The store's own gauges and counters (``buffer/`` is prefixed by the hub)."""

    def __len__(self) -> int: ...


class FifoStore:
    """First in, first out; a group is trained on at most once."""

    def __init__(self) -> None:
        self._groups: deque[RolloutGroup] = deque()

    def add(self, group: RolloutGroup) -> Admission:
        self._groups.append(group)
        return keep_all(group)

    def take(self, num_groups: int, learner_version: int, max_staleness: int, *,
             run_fraction: float) -> Taken:
        """Drop groups staler than ``max_staleness``, then the oldest ``num_groups`` or none
        (``run_fraction`` does not matter to FIFO)."""
        fresh = [g for g in self._groups if staleness(g, learner_version) <= max_staleness]
        dropped = [g for g in self._groups if staleness(g, learner_version) > max_staleness]
        if len(fresh) < num_groups:
            self._groups = deque(fresh)
            return Taken(groups=[], dropped_stale=dropped)
        self._groups = deque(fresh[num_groups:])
        return Taken(groups=fresh[:num_groups], dropped_stale=dropped)

    def update_priorities(self, priorities: Mapping[str, float]) -> None:
        raise PriorityError("the FIFO store has no priorities; buffer.replay.priority is 'fifo'")

    def stats(self) -> dict[str, float]:
        return {}

    def __len__(self) -> int:
        return len(self._groups)


class GroupFilter(Protocol):
    """Returns the group to keep (possibly with fewer samples, the same objects), or the
    reason to drop it."""

    def __call__(self, group: RolloutGroup) -> RolloutGroup | DropReason: ...


class FilteredStore:
    """Group filters, in order, in front of another store."""

    def __init__(self, inner: ReplayStore, filters: list[GroupFilter]) -> None:
        self.inner = inner
        self.filters = filters

    def add(self, group: RolloutGroup) -> Admission:
        kept = group
        for group_filter in self.filters:
            filtered = group_filter(kept)
            if isinstance(filtered, str):
                return Admission(reason=filtered)
            kept = filtered
        self.inner.add(kept)
        ids = {id(s) for s in kept.samples}
        return Admission(kept_samples=tuple(i for i, s in enumerate(group.samples)
                                            if id(s) in ids))

    def take(self, num_groups: int, learner_version: int, max_staleness: int, *,
             run_fraction: float) -> Taken:
        return self.inner.take(num_groups, learner_version, max_staleness,
                               run_fraction=run_fraction)

    def update_priorities(self, priorities: Mapping[str, float]) -> None:
        self.inner.update_priorities(priorities)

    def stats(self) -> dict[str, float]:
        return self.inner.stats()

    def __len__(self) -> int:
        return len(self.inner)
