"""The staleness bound eta (``buffer.max_staleness``), applied twice.

Versions count published weight updates. A sample's staleness is the learner's version at
training time minus the oldest version among its tokens.

1. Admission (AReaL's rule, Fu et al. 2025, counted in learner steps): a new lease is
   granted only while the batch it completes would be trained at most eta versions after
   the weights the generators hold now. Prompts complete batch
   j = ceil((accepted + running + count) / batch_size), counting groups (one per prompt):
   ``accepted`` groups ever admitted to the store (consumed or not), ``running`` prompts
   leased and unanswered, ``batch_size`` groups per learner step; the learner trains batch j
   at step j. The learner publishes version V after step S and then every k steps
   (``trainer.publish_every``), so it trains step j > S with version

       version_at(j) = V + floor((j - S - 1) / k)

   and a lease is granted while version_at(j) <= V + eta, i.e. j <= S + (eta + 1) * k.
   With k = 1 and S = V this is AReaL's ``accepted + running <= (eta + V + 1) * batch_size``;
   with eta = 0 exactly one batch is generated per version: synchronous. When the learner
   has asked for step R > S + k without publishing (a step that left the policy unchanged,
   the critic's warm-up, skips its publish) the steps count from R - 1 instead of S, so the
   gate never holds back the batch the learner waits for.
   The lease names the oldest weights it may be generated with (``lease_min_version``):
   version_at(j) - eta, so that its tokens are still fresh enough when batch j trains.
   (Asking only for V - eta would let a generator that runs ahead make groups that are
   dropped as stale before training.)
2. Training: groups whose staleness exceeds eta are dropped before a batch is formed.
"""

from __future__ import annotations

import msgspec

from relay.transport.messages import RolloutGroup


class LearnerPosition(msgspec.Struct, frozen=True):
    """Where the learner is: ``version`` published after step ``published_step``, step
    ``requested_step`` the last it asked a batch for (0: none yet), a version every
    ``steps_per_version`` steps (``trainer.publish_every``)."""

    version: int = 0
    published_step: int = 0
    requested_step: int = 0
    steps_per_version: int = 1

    @property
    def base_step(self) -> int:
        """The step after which ``version`` is known to hold: the publish, or the step before
        the one asked for when publishes were skipped since."""
        if self.requested_step - 1 - self.published_step >= self.steps_per_version:
            return self.requested_step - 1
        return self.published_step

    def version_at(self, batch: int) -> int:
        """The version the learner will train batch (step) ``batch`` with."""
        return self.version + max(0, (batch - self.base_step - 1) // self.steps_per_version)

    def last_batch(self, max_staleness: int) -> int:
        """The last batch whose version is at most ``max_staleness`` past ``version``."""
        return self.base_step + (max_staleness + 1) * self.steps_per_version


def lease_capacity(learner: LearnerPosition, *, max_staleness: int, batch_size: int, accepted: int,
                   running: int) -> int:
    """How many more prompts may be leased now (never negative)."""
    return max(0, learner.last_batch(max_staleness) * batch_size - (accepted + running))


def lease_min_version(learner: LearnerPosition, *, max_staleness: int, batch_size: int,
                      accepted: int, running: int, count: int) -> int:
    """The oldest weights version a lease of ``count`` prompts may use (module docstring)."""
    batch = -(-(accepted + running + count) // batch_size)
    return max(0, learner.version_at(batch) - max_staleness)


def oldest_version(group: RolloutGroup) -> int:
    """The oldest policy version among all tokens of all samples of a group."""
    return min(int(s.versions.min()) if s.versions.numel() else 0 for s in group.samples)


def staleness(group: RolloutGroup, learner_version: int) -> int:
    return learner_version - oldest_version(group)
