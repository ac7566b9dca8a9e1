"""Prompt leases: which generator holds which prompts, and until when.

A lease is granted for a batch of prompts; each prompt is answered by one rollout group.
Prompts not answered by the lease's deadline, given back, or held by a generator that
left or died return to the pool (the caller re-leases them first). A lease's deadline is
``timeout_s`` after it was granted or last renewed: its generator's heartbeats renew it while
the generator makes progress or waits for weights the learner has not published yet
(``renew``), so a long generation never loses its lease, and a stuck generator does. Only the
leases a heartbeat names are renewed: a lease whose reply never reached its generator is held
by nobody and expires. A request asked again (a retry after a lost reply, the same
``request_id``) is answered with the lease granted for it (``asked_again``), not a second one.
This module knows leases and clocks; it knows nothing of sockets, datasets or staleness.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection

import msgspec

from relay.transport.messages import Prompt


class Lease(msgspec.Struct, kw_only=True):
    """Prompts leased to one generator; ``outstanding`` shrinks as groups come back."""

    lease_id: str
    generator_id: str
    outstanding: dict[str, Prompt]
    deadline: float
    min_version: int = 0  # the weights version the lease's samples need
    request_id: str = ""  # the LeaseRequest it answers ("": not named)


class LeaseBook:
    """All open leases, indexed by lease id."""

    def __init__(self, timeout_s: float, id_prefix: str = "L") -> None:
        self.timeout_s = timeout_s
        self._leases: dict[str, Lease] = {}
        self._ids = (f"{id_prefix}{i}" for i in itertools.count(1))

    @property
    def running(self) -> int:
        """Prompts leased and not yet answered."""
        return sum(len(lease.outstanding) for lease in self._leases.values())

    def held_by(self, generator_id: str) -> int:
        """Prompts ``generator_id`` holds, leased and not yet answered."""
        return sum(len(lease.outstanding) for lease in self._leases.values()
                   if lease.generator_id == generator_id)

    def grant(self, generator_id: str, prompts: list[Prompt], now: float,
              min_version: int = 0, request_id: str = "") -> Lease:
        lease = Lease(lease_id=next(self._ids), generator_id=generator_id,
                      outstanding={p.prompt_id: p for p in prompts},
                      deadline=now + self.timeout_s, min_version=min_version,
                      request_id=request_id)
        self._leases[lease.lease_id] = lease
        return lease

    def asked_again(self, generator_id: str, request_id: str, now: float) -> Lease | None:
        """The open lease granted to ``generator_id`` for its request ``request_id`` (a
        retry of a request whose reply was lost), its deadline counted from ``now``, when
        its generator first hears of it; None for an unnamed or a new request."""
        if not request_id:
            return None
        lease = next((lease for lease in self._leases.values()
                      if lease.request_id == request_id
                      and lease.generator_id == generator_id), None)
        if lease is not None:
            lease.deadline = now + self.timeout_s
        return lease

    def peek(self, lease_id: str, prompt_id: str, generator_id: str) -> Prompt | None:
        """The prompt if ``generator_id``'s lease ``lease_id`` holds it, left in the lease."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.generator_id != generator_id:
            return None
        return lease.outstanding.get(prompt_id)

    def complete(self, lease_id: str, prompt_id: str, generator_id: str) -> Prompt | None:
        """Mark one prompt answered; None if that lease does not hold it (any more)."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.generator_id != generator_id:
            return None
        prompt = lease.outstanding.pop(prompt_id, None)
        if not lease.outstanding:
            del self._leases[lease_id]
        return prompt

    def give_back(self, lease_id: str, prompt_ids: list[str], generator_id: str) -> list[Prompt]:
        """Prompts a generator returns unanswered."""
        return [p for pid in prompt_ids
                if (p := self.complete(lease_id, pid, generator_id)) is not None]

    def renew(self, generator_id: str, now: float, *, progressed: bool,
              learner_version: int, held: Collection[str] | None = None) -> int:
        """Push back the deadlines of the leases ``generator_id`` says it ``held`` (None: all
        of its leases) to ``now + timeout_s``: all of those when it ``progressed`` (its engine
        stepped since its last heartbeat), else those still waiting for a version the
        learner has not published. Returns how many."""
        renewed = 0
        for lease in self._leases.values():
            if lease.generator_id == generator_id and (
                    held is None or lease.lease_id in held) and (
                    progressed or lease.min_version > learner_version):
                lease.deadline = now + self.timeout_s
                renewed += 1
        return renewed

    def postpone(self, seconds: float) -> None:
        """Push every deadline back by ``seconds``."""
        for lease in self._leases.values():
            lease.deadline += seconds

    def expire(self, now: float) -> list[Prompt]:
        """Remove leases past their deadline; return their unanswered prompts."""
        expired = [lid for lid, lease in self._leases.items() if lease.deadline <= now]
        return [p for lid in expired for p in self._leases.pop(lid).outstanding.values()]

    def release(self, generator_id: str) -> list[Prompt]:
        """Remove every lease of a generator that left; return their unanswered prompts."""
        gone = [lid for lid, lease in self._leases.items() if lease.generator_id == generator_id]
        return [p for lid in gone for p in self._leases.pop(lid).outstanding.values()]
