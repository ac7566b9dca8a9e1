"""The replay filters inside the hub: drops are counted and replaced, the cap ends the run,
PF-PPO's kept samples are what the learner gets, and the log holds every whole group."""

from __future__ import annotations

from pathlib import Path

from relay.buffer.dynamic_sampling import DynamicSampling
from relay.buffer.pf_ppo import PolicyFiltration
from relay.buffer.rollout_log import RolloutLogWriter, read_rollout_log
from relay.buffer.store import FifoStore, FilteredStore
from relay.transport.messages import Heartbeat, PromptLease, SampleBatch, SampleRequest, Shutdown

from .conftest import make_group
from .test_hub import lease


def dynamic_store(batch_size: int, cap: int = 0) -> FilteredStore:
    return FilteredStore(FifoStore(), [DynamicSampling("score", batch_size, cap)])


def send(hub, granted: PromptLease, index: int, rewards: list[float]):
    return hub.handle(make_group(granted.lease_id, granted.prompts[index], granted.n,
                                 rewards=rewards))


def test_zero_variance_groups_are_dropped_counted_and_replaced(make_hub, tmp_path: Path) -> None:
    log = RolloutLogWriter(tmp_path)
    hub = make_hub(batch_size=2, n=2, per_lease=2, max_staleness=0, store=dynamic_store(2),
                   log=log)
    first = lease(hub)
    assert len(first.prompts) == 2 and lease(hub).prompts == []  # (0 + 0 + 1) * 2 running
    dropped = send(hub, first, 0, [1.0, 1.0])  # all right: no signal
    assert not dropped.accepted and dropped.verdict == "zero_variance"
    assert send(hub, first, 1, [1.0, 0.0]).accepted
    assert hub.counts["dropped/zero_variance"] == 1 and hub.accepted == 1
    assert hub.handle(SampleRequest(num_groups=2)).groups == []

    replacement = lease(hub)  # the dropped group's slot is free: 1 accepted + 0 running < 2
    assert len(replacement.prompts) == 1 and lease(hub).prompts == []
    assert not send(hub, replacement, 0, [0.0, 0.0]).accepted  # all wrong: dropped too
    again = lease(hub)
    assert send(hub, again, 0, [0.0, 1.0]).accepted

    batch = hub.handle(SampleRequest(num_groups=2))
    assert isinstance(batch, SampleBatch) and len(batch.groups) == 2
    assert [[s.reward for s in g.samples] for g in batch.groups] == [[1.0, 0.0], [0.0, 1.0]]
    assert batch.buffer_stats["buffer/dropped/zero_variance"] == 2.0
    assert batch.buffer_stats["buffer/groups/accepted"] == 2.0
    log.close()
    logged = list(read_rollout_log(tmp_path))
    assert [g.metadata["buffer_admission"]["dropped"] for g in logged] == \
        ["zero_variance", "", "zero_variance", ""]
    assert all(len(g.samples) == 2 for g in logged)


def test_exceeding_max_num_gen_batches_fails_the_run(make_hub) -> None:
    hub = make_hub(batch_size=2, n=2, per_lease=2, max_staleness=0,
                   store=dynamic_store(2, cap=1))
    granted = lease(hub)
    send(hub, granted, 0, [1.0, 1.0])
    ack = send(hub, granted, 1, [0.0, 0.0])  # 2 judged = 1 batch's worth, 0 kept
    assert ack.verdict == "run_failed" and not ack.accepted
    assert "max_num_gen_batches" in ack.detail
    assert "max_num_gen_batches = 1" in hub.failure and hub.finished
    stop = hub.handle(Heartbeat(generator_id="g0", version=0))
    assert isinstance(stop, Shutdown) and "max_num_gen_batches" in stop.reason


def test_pf_ppo_stores_the_kept_samples_and_logs_the_whole_group(make_hub,
                                                                 tmp_path: Path) -> None:
    log = RolloutLogWriter(tmp_path)
    store = FilteredStore(FifoStore(), [PolicyFiltration("best_worst", seed=0)])
    hub = make_hub(batch_size=1, n=4, per_lease=1, store=store, log=log)
    granted = lease(hub)
    assert send(hub, granted, 0, [0.2, 0.9, 0.1, 0.5]).accepted
    batch = hub.handle(SampleRequest(num_groups=1))
    (trained,) = batch.groups
    assert trained.rollout_id == f"{granted.lease_id}/{granted.prompts[0].prompt_id}"
    assert [s.reward for s in trained.samples] == [0.9, 0.1]
    assert hub.counts["samples/filtered"] == 2 and hub.counts["groups/accepted"] == 1
    log.close()
    (logged,) = read_rollout_log(tmp_path)
    assert logged.rollout_id == trained.rollout_id
    assert [s.reward for s in logged.samples] == [0.2, 0.9, 0.1, 0.5]
    assert logged.metadata["buffer_admission"] == {"kept_samples": [1, 2], "dropped": ""}


def test_dynamic_sampling_judges_the_whole_group_before_pf_ppo(make_hub) -> None:
    store = FilteredStore(FifoStore(), [DynamicSampling("score", 2, 0),
                                        PolicyFiltration("best", seed=0)])
    hub = make_hub(batch_size=2, n=3, per_lease=2, store=store)
    granted = lease(hub)
    assert send(hub, granted, 0, [1.0, 0.0, 0.0]).accepted  # best alone would look constant
    assert send(hub, granted, 1, [0.0, 0.0, 0.0]).verdict == "zero_variance"
    assert len(store) == 1
    (kept,) = hub.handle(SampleRequest(num_groups=1)).groups
    assert [s.reward for s in kept.samples] == [1.0]
