"""The leases a generator holds: waiting for weights, generating, or partly sent.

A lease's prompts become engine groups keyed ``(lease_id, index, kind)``: ``kind`` is
``"sampled"`` for the ``n`` samples and ``"greedy"`` for ReMax's greedy response. A prompt
is finished when all of its groups are; its prompts leave the lease one by one, and the
lease is closed when the last has been handed on.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from relay.generators.engine import Completion, FinishedGroup, GroupRequest
from relay.generators.sampling import SamplingParams
from relay.transport.messages import PromptLease

SAMPLED, GREEDY = "sampled", "greedy"


@dataclass
class HeldLease:
    """One lease and the completions of its prompts so far."""

    lease: PromptLease
    prompt_ids: list[list[int]]
    leased_at: float = field(default_factory=time.monotonic)
    sampled: dict[int, list[Completion]] = field(default_factory=dict)
    greedy: dict[int, Completion] = field(default_factory=dict)
    handed_on: set[int] = field(default_factory=set)
    warned_late: bool = False

    @property
    def sequences(self) -> int:
        """Engine sequences the lease needs: n per prompt, and one more for a baseline."""
        per_prompt = self.lease.n + (1 if self.lease.greedy_baseline else 0)
        return per_prompt * len(self.prompt_ids)

    def requests(self, params: SamplingParams, greedy: SamplingParams) -> Iterator[GroupRequest]:
        """The engine groups of every prompt: its samples, and its greedy response."""
        for index, ids in enumerate(self.prompt_ids):
            yield GroupRequest((self.lease.lease_id, index, SAMPLED), ids, self.lease.n, params)
            if self.lease.greedy_baseline:
                yield GroupRequest((self.lease.lease_id, index, GREEDY), ids, 1, greedy)

    def add(self, index: int, kind: str, completions: list[Completion]) -> bool:
        """Record a finished group; True when prompt ``index`` now has all it needs."""
        if kind == SAMPLED:
            self.sampled[index] = completions
        else:
            self.greedy[index] = completions[0]
        return index in self.sampled and (not self.lease.greedy_baseline
                                          or index in self.greedy)

    @property
    def unsent_prompt_ids(self) -> list[str]:
        return [p.prompt_id for i, p in enumerate(self.lease.prompts) if i not in self.handed_on]

    @property
    def done(self) -> bool:
        return len(self.handed_on) == len(self.prompt_ids)


class HeldLeases:
    """The leases this generator holds, by id, in the order they were taken: waiting for
    weights, then generating (the buffer keeps its own book of every generator's leases)."""

    def __init__(self) -> None:
        self.waiting: list[HeldLease] = []  # for weights they need
        self.generating: dict[str, HeldLease] = {}

    @property
    def waiting_sequences(self) -> int:
        return sum(h.sequences for h in self.waiting)

    def all(self) -> list[HeldLease]:
        return [*self.waiting, *self.generating.values()]

    def hold(self, held: HeldLease) -> None:
        """A new lease, waiting until the engine has the weights it needs."""
        self.waiting.append(held)

    def forget(self, held: HeldLease) -> None:
        """A waiting lease the caller gives back."""
        self.waiting.remove(held)

    def start(self, held: HeldLease) -> None:
        """A waiting lease whose weights are here: its groups go to the engine."""
        self.waiting.remove(held)
        self.generating[held.lease.lease_id] = held

    def finish(self, group: FinishedGroup) -> tuple[HeldLease, int] | None:
        """Record an engine group; the lease and prompt index when that prompt is finished."""
        lease_id, index, kind = group.key
        held = self.generating[lease_id]
        if not held.add(index, kind, group.completions):
            return None
        held.handed_on.add(index)
        if held.done:
            del self.generating[lease_id]
        return held, index

    def clear(self) -> list[HeldLease]:
        """Forget every lease (the caller returns their unsent prompts); the leases."""
        held = self.all()
        self.waiting, self.generating = [], {}
        return held
