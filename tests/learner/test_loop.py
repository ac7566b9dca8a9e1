"""The training loop's own bookkeeping: the TD-error priorities it sends the buffer."""

from __future__ import annotations

import pytest

from relay.buffer.prioritized import PrioritizedStore
from relay.buffer.store import PriorityError
from relay.configs.run_schema import ReplayConfig
from relay.learner.loop import finite_priorities
from relay.transport.messages import Prompt

from ..buffer.conftest import make_group


def groups(count: int):
    return [make_group("lease", Prompt(prompt_id=f"p{i}", messages=[], data_source="test"), 2,
                       rewards=[1.0, 0.0]) for i in range(count)]


def test_non_finite_td_errors_are_left_out_and_counted() -> None:
    """A NaN or inf TD-error went to the buffer with the rest, which refuses the whole
    request (none applied), and the learner died of the refusal; now those groups are left
    out, the others are sent, and the loop reports how many were left out."""
    batch = groups(5)
    errors = [0.5, float("nan"), 2.0, float("inf"), float("-inf")]
    priorities, left_out = finite_priorities(batch, errors)
    assert priorities == {"lease/p0": 0.5, "lease/p2": 2.0}
    assert left_out == 3
    assert finite_priorities(batch[:2], [0.25, 0.0]) == ({"lease/p0": 0.25, "lease/p1": 0.0}, 0)


def test_what_is_sent_is_what_the_store_accepts() -> None:
    """The store's check (``PriorityError``) and the loop's filter agree: the raw errors
    are refused whole, the filtered ones applied."""
    batch = groups(3)
    replay = PrioritizedStore(ReplayConfig(priority="td_error", max_reuse=5), max_staleness=2)
    for group in batch:
        replay.add(group)
    errors = [3.0, float("nan"), 1.0]
    with pytest.raises(PriorityError):
        replay.update_priorities(dict(zip((g.rollout_id for g in batch), errors)))
    priorities, _ = finite_priorities(batch, errors)
    replay.update_priorities(priorities)
    # p0 3, p1 kept its initial priority (the largest seen before: 1), p2 1
    assert replay.stats()["replay/priority_mean"] == pytest.approx((3.0 + 1.0 + 1.0) / 3)
