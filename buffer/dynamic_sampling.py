"""DAPO dynamic sampling: drop prompt groups that carry no learning signal.

Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", sec. 3.2
(verl's ``algorithm.filter_groups``). With a group-relative advantage
``A_i = (r_i - mean(r)) / std(r)``, a group whose rewards are all equal (every sample right,
or every sample wrong) has ``A_i = 0`` for all i and contributes no gradient. DAPO keeps
only groups with

    0 < |{i : o_i correct}| < G,   i.e.   Var_i[m_i] > 0

(``m_i`` the configured metric of sample i) and keeps generating until the batch is full.

In the hub that is: a zero-variance group is dropped (counted as ``dropped/zero_variance``)
and never counts as accepted in the admission rule, so its lease slot is free again and
the generators produce a replacement. ``max_num_gen_batches`` (verl's name, 0 = no cap)
bounds the replacements: the groups judged while one learner batch of ``batch_size`` kept
groups fills may not reach ``max_num_gen_batches * batch_size``. Past that the filter
raises ``ReplayFilterError`` and the run ends with that error, as verl does.
"""

from __future__ import annotations

from relay.buffer.store import DropReason
from relay.transport.messages import RolloutGroup, Sample

SCORE = "score"  # the metric that means the sample's reward itself


class ReplayFilterError(RuntimeError):
    """A replay filter cannot go on: the run must end with this message."""


def sample_metric(sample: Sample, metric: str) -> float:
    """The value the filter compares: the reward for ``score``, else ``reward_info[metric]``.

    A sample whose reward function failed has no info; it counts with its reward (0).
    """
    if metric == SCORE or sample.reward_error:
        return sample.reward
    if metric not in sample.reward_info:
        known = ", ".join(sorted(sample.reward_info)) or "none"
        raise ReplayFilterError(
            f"buffer.filter_groups.metric is {metric!r} but the reward function returned no "
            f"such entry (its entries: {known}); use 'score' or one of those")
    return sample.reward_info[metric]


def has_zero_variance(values: list[float]) -> bool:
    """True when every value is the same (a group of one sample counts as having signal,
    as in verl, which keeps it)."""
    return len(values) > 1 and max(values) == min(values)


class DynamicSampling:
    """The ``GroupFilter`` for DAPO dynamic sampling, with verl's generation cap."""

    def __init__(self, metric: str, batch_size: int, max_num_gen_batches: int) -> None:
        self.metric = metric
        self.batch_size = batch_size
        self.max_num_gen_batches = max_num_gen_batches
        self.judged = 0  # groups judged since the last learner batch filled
        self.kept = 0  # groups kept since then

    def __call__(self, group: RolloutGroup) -> RolloutGroup | DropReason:
        """The group, or ``"zero_variance"`` when its samples all score the same."""
        values = [sample_metric(s, self.metric) for s in group.samples]
        keep = not has_zero_variance(values)
        self._count(keep)
        return group if keep else "zero_variance"

    def _count(self, keep: bool) -> None:
        self.judged += 1
        self.kept += keep
        if self.kept == self.batch_size:
            self.judged = self.kept = 0
        elif self.max_num_gen_batches and \
                self.judged >= self.max_num_gen_batches * self.batch_size:
            raise ReplayFilterError(
                f"dynamic sampling judged {self.judged} groups "
                f"(buffer.filter_groups.max_num_gen_batches = {self.max_num_gen_batches} "
                f"batches of {self.batch_size}) and kept only {self.kept} of the "
                f"{self.batch_size} a learner batch needs: nearly every prompt is answered "
                f"all right or all wrong. Raise max_num_gen_batches (0 = no cap), or check "
                f"the data's difficulty and the reward function (metric "
                f"{self.metric!r})")
