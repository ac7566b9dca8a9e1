"""The staleness bound eta (``buffer.max_staleness``), applied twice.

Versions count published weight updates. A sample's staleness is the learner's version at
training time minus the oldest version among its tokens.

1. Admission (AReaL's rule, Fu et al. 2025): a new lease is granted only while

       accepted + running <= (eta + version + 1) * batch_size

   counting groups (one per prompt): ``accepted`` groups ever admitted to the store
   (consumed or not), ``running`` prompts leased and unanswered, ``batch_size`` groups per
   learner step. With eta = 0 exactly one batch is generated per version: synchronous.
   The lease names the oldest weights it may be generated with (``lease_min_version``):
   its prompts complete batch j = ceil((accepted + running + count) / batch_size), which
   the learner trains at version j - 1 at the earliest (and never before its current
   version), so their tokens must come from version max(version, j - 1) - eta or later
   to be trained at all. (Asking only for version - eta would let a generator that runs
   ahead make groups that are dropped as stale before training.)
2. Training: groups whose staleness exceeds eta are dropped before a batch is formed.
"""

from __future__ import annotations

from transport.messages import RolloutGroup


def lease_capacity(*, version: int, max_staleness: int, batch_size: int, accepted: int,
                   running: int) -> int:
    """How many more prompts may be leased now (never negative)."""
    return max(0, (max_staleness + version + 1) * batch_size - (accepted + running))


def lease_min_version(*, version: int, max_staleness: int, batch_size: int, accepted: int,
                      running: int, count: int) -> int:
    """The oldest weights version a lease of ``count`` prompts may use (module docstring)."""
    last_batch = -(-(accepted + running + count) // batch_size)
    return max(0, max(version, last_batch - 1) - max_staleness)


def oldest_version(group: RolloutGroup) -> int:
    """The oldest policy version among all tokens of all samples of a group."""
    return min(int(s.versions.min()) if s.versions.numel() else 0 for s in group.samples)


def staleness(group: RolloutGroup, learner_version: int) -> int:
    return learner_version - oldest_version(group)
