"""The hub's rules: the staleness gate, lease expiry, admission, batches, shutdown."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import get_args

import msgspec
import pytest
import torch

from relay.buffer.hub import COUNTERS, REFUSALS, Hub
from relay.buffer.rollout_log import LogBudget, RolloutLogWriter, read_steps
from relay.transport.messages import (
    Ack,
    Attach,
    AttachAck,
    BufferCheckpointRequest,
    Detach,
    ErrorReply,
    Heartbeat,
    HeartbeatAck,
    LeaseRequest,
    LeaseReturn,
    PromptLease,
    RolloutAck,
    RolloutVerdict,
    SampleBatch,
    SampleRequest,
    Shutdown,
    VersionUpdate,
)

from .conftest import make_group


def lease(hub: Hub, generator_id: str = "g0", max_prompts: int = 100) -> PromptLease:
    reply = hub.handle(LeaseRequest(generator_id=generator_id, max_prompts=max_prompts))
    assert isinstance(reply, PromptLease)
    return reply


def answer(hub: Hub, granted: PromptLease, version: int = 0) -> list[RolloutAck]:
    return [hub.handle(make_group(granted.lease_id, p, granted.n, version))
            for p in granted.prompts]


def test_eta_zero_admits_exactly_one_batch_per_version(make_hub) -> None:
    hub = make_hub(batch_size=4, per_lease=3, max_staleness=0)
    first, second = lease(hub), lease(hub)
    assert (len(first.prompts), len(second.prompts)) == (3, 1)
    assert lease(hub).prompts == []  # gate closed: 4 running = (0 + 0 + 1) * 4
    assert all(a.accepted for a in answer(hub, first) + answer(hub, second))
    assert lease(hub).prompts == []  # 4 accepted still fill version 0's budget
    batch = hub.handle(SampleRequest(num_groups=4))
    assert isinstance(batch, SampleBatch) and len(batch.groups) == 4
    hub.handle(VersionUpdate(version=1, step=1))
    third = lease(hub)
    assert len(third.prompts) == 3 and third.min_version == 1


def test_no_lease_before_min_generators_attached_then_the_run_goes_on(make_hub) -> None:
    hub = make_hub(min_generators=2)  # g0 attached
    assert lease(hub).prompts == [] and hub.counts["leases/gated"] == 1
    hub.handle(Attach(generator_id="g1", engine="vllm", device="cpu"))
    assert len(lease(hub, "g1").prompts) == 2
    hub.handle(Detach(generator_id="g1"))
    assert len(lease(hub).prompts) == 2  # leasing, once begun, never waits again


def test_a_generator_holding_prompts_yields_the_next_lease_to_one_still_asking_for_any(
        make_hub, clock) -> None:
    """A busy generator asks between its engine's steps, an idle one every RETRY_AFTER_S:
    without the yield the busy one took every slot the gate opened (two generators, one
    never leased: seen in CI). Each gets leases; a silent asker stops holding them up."""
    hub = make_hub(batch_size=2, per_lease=2, max_staleness=0, min_generators=2)
    assert lease(hub, "g0").prompts == []  # alone: leasing waits for g1
    hub.handle(Attach(generator_id="g1", engine="torch", device="cpu"))
    first = lease(hub, "g1")
    assert len(first.prompts) == 2 and lease(hub, "g0").prompts == []  # the gate is full
    answer_as(hub, first, "g1")
    assert len(hub.handle(SampleRequest(num_groups=2, step=1)).groups) == 2
    hub.handle(VersionUpdate(version=1, step=1))
    held = lease(hub, "g1", max_prompts=1)  # g1 asks first and gets part of the room...
    assert len(held.prompts) == 1
    assert lease(hub, "g1").prompts == []  # ...but holding it, yields the rest to g0
    assert len(lease(hub, "g0").prompts) == 1
    answer_as(hub, held, "g1", version=1)
    assert hub.handle(SampleRequest(num_groups=2, step=2)).groups == []  # g0's is out
    hub.handle(Detach(generator_id="g0"))  # g0 leaves: its prompt is back in the pool
    assert len(lease(hub, "g1").prompts) == 1


def test_a_generator_that_stopped_asking_holds_no_one_up(make_hub, clock) -> None:
    hub = make_hub(batch_size=2, per_lease=1, max_staleness=0)
    hub.handle(Attach(generator_id="g1", engine="torch", device="cpu"))
    held = lease(hub, "g1")
    assert len(held.prompts) == 1 and len(lease(hub, "g0").prompts) == 1
    assert lease(hub, "g0").prompts == []  # refused holding one: not an idle asker
    assert lease(hub, "g1").prompts == []  # the gate is full
    answer_as(hub, held, "g1")
    assert lease(hub, "g1").prompts == []  # g1 holds nothing: refused, it now asks idle
    hub.handle(VersionUpdate(version=1, step=1))
    clock.now += 1.0  # g1 fell silent since (killed, or busy elsewhere)
    assert len(lease(hub, "g0").prompts) == 1


def answer_as(hub: Hub, granted: PromptLease, generator_id: str, version: int = 0) -> None:
    acks = [hub.handle(make_group(granted.lease_id, p, granted.n, version, generator_id))
            for p in granted.prompts]
    assert all(a.accepted for a in acks), acks


def test_eta_bounds_leases_ahead_of_the_learner(make_hub) -> None:
    hub = make_hub(batch_size=2, per_lease=10, max_staleness=2)
    assert len(lease(hub).prompts) == 6  # (2 + 0 + 1) * 2
    assert lease(hub).prompts == []


def test_a_lease_asks_for_the_weights_its_batch_needs_to_be_fresh(make_hub) -> None:
    """eta = 1, batch 2, one prompt per lease. At version 0 batches 1 and 2 may be leased
    (trained at versions 0 and 1: weights >= 0). Once batch 1 is trained and version 1
    published, the next prompts complete batch 3, trained at version 2 at the earliest:
    weights >= 1, where version - eta would have asked for 0 and had them dropped."""
    hub = make_hub(batch_size=2, per_lease=1, max_staleness=1)
    first = [lease(hub) for _ in range(4)]
    assert [granted.min_version for granted in first] == [0, 0, 0, 0]
    for granted in first:
        answer(hub, granted)
    assert len(hub.handle(SampleRequest(num_groups=2)).groups) == 2
    hub.handle(VersionUpdate(version=1, step=1))
    assert [lease(hub).min_version for _ in range(2)] == [1, 1]


def train(hub: Hub, steps: int, publishes: Callable[[int], bool]) -> list[int]:
    """A generator that leases all it may and answers each lease once it holds the weights
    the lease asks for (the learner's newest), and a learner that trains ``steps`` steps,
    asking again (at most twice) while the buffer has no batch, and publishes after the
    steps ``publishes`` names. The times each step asked."""
    version, held, asked = 0, [], []
    for step in range(1, steps + 1):
        for attempt in range(1, 4):
            while (granted := lease(hub)).prompts:
                held.append(granted)
            for granted in [g for g in held if g.min_version <= version]:
                assert all(a.accepted for a in answer(hub, granted, version))
                held.remove(granted)
            batch = hub.handle(SampleRequest(num_groups=hub.batch_size, step=step))
            if batch.groups:
                assert len(batch.groups) == hub.batch_size
                asked.append(attempt)
                break
        else:
            raise AssertionError(f"step {step}: no batch after 3 requests (deadlock)")
        if publishes(step):
            version += 1
            hub.handle(VersionUpdate(version=version, step=step))
    assert hub.counts["dropped/stale"] == 0
    return asked


@pytest.mark.parametrize("eta", [0, 1, 2])
@pytest.mark.parametrize("every", [1, 2, 4])
def test_a_learner_publishing_every_k_steps_gets_every_batch(make_hub, eta, every) -> None:
    """trainer.publish_every = k > eta + 1 once deadlocked: the gate counted eta + 1
    batches per version, and the learner needed a k-th batch to publish the next one."""
    hub = make_hub(batch_size=2, per_lease=2, max_staleness=eta, steps_per_version=every)
    # every batch was there when first asked for (this generator acts between steps)
    assert train(hub, 12, lambda step: step % every == 0) == [1] * 12


def test_eta_steps_ahead_of_each_version_are_leased(make_hub) -> None:
    """eta = 1, a version every 2 steps, batch 2: at version 0 (steps 1-2) the batches of
    steps 1-4 may be made (trained at versions 0 and 1), after the publish at step 2, those
    of steps 5-6 as well."""
    hub = make_hub(batch_size=2, per_lease=100, max_staleness=1, steps_per_version=2)
    first = lease(hub)
    assert len(first.prompts) == 8 and first.min_version == 0
    assert lease(hub).prompts == []
    answer(hub, first)
    for step in (1, 2):
        assert len(hub.handle(SampleRequest(num_groups=2, step=step)).groups) == 2
    hub.handle(VersionUpdate(version=1, step=2))
    second = lease(hub)
    assert len(second.prompts) == 4 and second.min_version == 1  # steps 5-6 train at v2


@pytest.mark.parametrize("eta", [0, 1])
def test_steps_that_skip_their_publish_never_starve_the_learner(make_hub, eta) -> None:
    """The critic's warm-up leaves the policy unchanged and skips its publishes: the gate
    counts from the step the learner asks for, not from the last publish."""
    hub = make_hub(batch_size=2, per_lease=2, max_staleness=eta)
    asked = train(hub, 8, lambda step: step > 3)
    # a skipped publish shows when the next step is asked for: with eta = 0 its batch is
    # made then, as after a publish
    assert asked == ([1, 2, 2, 2, 1, 1, 1, 1] if eta == 0 else [1] * 8)


def test_expired_lease_returns_its_prompts_first(make_hub, clock) -> None:
    hub = make_hub(batch_size=4, per_lease=2, lease_timeout_s=10.0)
    granted = lease(hub)
    clock.now += 11.0
    hub.tick()
    assert hub.leases.running == 0 and hub.counts["prompts/expired"] == 2
    again = lease(hub)
    assert [p.prompt_id for p in again.prompts] == [p.prompt_id for p in granted.prompts]
    late = answer(hub, granted)  # the old lease's answers come too late
    assert [a.verdict for a in late] == ["unknown_lease", "unknown_lease"]
    assert not any(a.accepted for a in late)


def test_duplicates_and_foreign_leases_are_rejected(make_hub) -> None:
    hub = make_hub()
    granted = lease(hub)
    group = make_group(granted.lease_id, granted.prompts[0], granted.n)
    assert hub.handle(group).accepted
    assert hub.handle(group).verdict == "duplicate"
    other = make_group(granted.lease_id, granted.prompts[1], granted.n, generator_id="intruder")
    assert hub.handle(other).verdict == "unknown_lease"
    assert hub.counts["rejected/duplicate"] == 1 and hub.counts["rejected/unknown_lease"] == 1
    assert len(hub.store) == 1


def test_malformed_group_is_rejected_and_its_prompt_returns(make_hub) -> None:
    hub = make_hub(n=2)
    granted = lease(hub)
    group = make_group(granted.lease_id, granted.prompts[0], granted.n)
    group.samples[1].logprobs = torch.zeros(7)  # does not match the 3 response tokens
    ack = hub.handle(group)
    assert not ack.accepted and ack.verdict == "malformed" and ack.detail.startswith("sample 1")
    short = hub.handle(make_group(granted.lease_id, granted.prompts[1], 1))
    assert short.verdict == "malformed" and "1 samples, the lease asked for 2" in short.detail
    assert hub.source.returned == 2 and len(hub.store) == 0
    assert hub.counts["rejected/malformed"] == 2


def test_tokens_from_a_future_version_are_malformed(make_hub) -> None:
    hub = make_hub()
    granted = lease(hub)
    ack = hub.handle(make_group(granted.lease_id, granted.prompts[0], granted.n, version=3))
    assert ack.verdict == "malformed" and "learner is at version 0" in ack.detail


def test_stale_groups_are_dropped_before_training(make_hub) -> None:
    hub = make_hub(batch_size=2, per_lease=2, max_staleness=1)
    answer(hub, lease(hub), version=0)
    hub.handle(VersionUpdate(version=1, step=1))
    answer(hub, lease(hub), version=1)
    hub.handle(VersionUpdate(version=2, step=2))
    batch = hub.handle(SampleRequest(num_groups=2))
    assert len(batch.groups) == 2 and hub.counts["dropped/stale"] == 2
    assert all(int(g.samples[0].versions[0]) == 1 for g in batch.groups)
    assert batch.buffer_stats["buffer/dropped/stale"] == 2.0


def test_not_enough_groups_means_retry(make_hub) -> None:
    hub = make_hub(batch_size=4)
    answer(hub, lease(hub))
    batch = hub.handle(SampleRequest(num_groups=4))
    assert batch.groups == [] and batch.retry_after_s > 0 and len(hub.store) == 2


def test_detach_and_silence_return_leases(make_hub, clock) -> None:
    hub = make_hub(batch_size=8, per_lease=2)
    lease(hub)
    hub.handle(Detach(generator_id="g0", reason="bye"))
    assert hub.leases.running == 0 and hub.source.returned == 2
    hub.handle(Attach(generator_id="g1", engine="torch", device="cpu"))
    lease(hub, "g1")
    clock.now += 31.0
    hub.tick()
    assert hub.generators == 0 and hub.source.returned == 2 + 2 - 2  # 2 re-leased, 2 back


def test_unattached_generator_must_attach(make_hub) -> None:
    hub = make_hub()
    reply = hub.handle(LeaseRequest(generator_id="stranger", max_prompts=1))
    assert isinstance(reply, ErrorReply) and reply.code == "not_attached"
    beat = hub.handle(Heartbeat(generator_id="stranger", version=0))
    assert isinstance(beat, HeartbeatAck) and not beat.known


def test_lease_return_puts_prompts_back(make_hub) -> None:
    hub = make_hub()
    granted = lease(hub)
    hub.handle(LeaseReturn(generator_id="g0", lease_id=granted.lease_id,
                           prompt_ids=[p.prompt_id for p in granted.prompts]))
    assert hub.source.returned == 2 and hub.leases.running == 0


def test_shutdown_tells_generators_to_stop(make_hub) -> None:
    hub = make_hub()
    hub.handle(Shutdown(reason="done"))
    assert isinstance(hub.handle(LeaseRequest(generator_id="g0", max_prompts=1)), Shutdown)
    assert isinstance(hub.handle(Heartbeat(generator_id="g0", version=0)), Shutdown)
    ack = hub.handle(Attach(generator_id="g9", engine="torch", device="cpu"))
    assert isinstance(ack, AttachAck) and not ack.accepted


def test_a_generator_told_the_run_is_over_is_forgotten_with_its_leases(make_hub) -> None:
    hub = make_hub()
    granted = lease(hub)  # attaches g0
    hub.handle(Attach(generator_id="g1", engine="torch", device="cpu"))
    hub.handle(Shutdown(reason="done"))
    assert hub.generators == 2
    assert isinstance(hub.handle(Heartbeat(generator_id="g0", version=0)), Shutdown)
    assert hub.generators == 1 and hub.leases.running == 0
    assert hub.counts["prompts/returned"] == len(granted.prompts)
    assert isinstance(hub.handle(LeaseRequest(generator_id="g1", max_prompts=1)), Shutdown)
    assert hub.generators == 0 and hub.accounting_problems() == []


def test_a_stopped_run_tells_each_generator_why_at_its_next_request(make_hub) -> None:
    """``Hub.stop`` (the buffer's stop signal) ends the run as the learner's ``Shutdown``
    does, and the generators hear why; a second stop keeps the first reason."""
    hub = make_hub()
    granted = lease(hub)  # attaches g0
    hub.handle(Attach(generator_id="g1", engine="torch", device="cpu"))
    hub.stop("Ctrl-C")
    hub.stop("later")
    told = hub.handle(Heartbeat(generator_id="g0", version=0, leases=[granted.lease_id]))
    assert told == Shutdown(reason="the run was stopped: Ctrl-C")
    assert hub.generators == 1 and hub.counts["prompts/returned"] == len(granted.prompts)
    assert hub.handle(LeaseRequest(generator_id="g1", max_prompts=1, request_id="r")) == told
    late = hub.handle(Attach(generator_id="g9", engine="torch", device="cpu"))
    assert late == AttachAck(accepted=False, reason="the run was stopped: Ctrl-C")
    assert hub.generators == 0 and hub.accounting_problems() == []


def test_generator_throughput_over_a_window(make_hub, clock) -> None:
    hub = make_hub()
    for second, tokens in ((0, 0), (10, 500), (20, 1500)):
        clock.now = 1000.0 + second
        hub.handle(Heartbeat(generator_id="g0", version=0, generated_tokens=tokens))
        hub.tick()
    assert hub.stats()["buffer/generator_tokens_per_s"] == pytest.approx(1500 / 20)
    assert hub.stats()["buffer/generator_tokens_total"] == 1500


def test_remax_leases_ask_for_the_greedy_baseline_and_refuse_groups_without_it(make_hub) -> None:
    hub = make_hub(batch_size=2, n=2, per_lease=2, greedy_baseline=True)
    granted = lease(hub)
    assert granted.greedy_baseline
    first, second = (make_group(granted.lease_id, p, 2, rewards=[1.0, 0.0])
                     for p in granted.prompts)
    missing = hub.handle(first)
    assert missing.verdict == "malformed" and "baseline_reward is None" in missing.detail
    assert hub.counts["rejected/malformed"] == 1
    nan = hub.handle(msgspec.structs.replace(second, baseline_reward=float("nan")))
    assert nan.verdict == "malformed" and "greedy response's reward" in nan.detail
    again = lease(hub)  # both prompts went back to the pool
    assert len(again.prompts) == 2
    for prompt in again.prompts:
        group = make_group(again.lease_id, prompt, 2, rewards=[1.0, 0.0])
        assert hub.handle(msgspec.structs.replace(group, baseline_reward=1.0)).accepted
    batch = hub.handle(SampleRequest(num_groups=2))
    assert [g.baseline_reward for g in batch.groups] == [1.0, 1.0]
    assert not lease(make_hub()).greedy_baseline


def test_only_version_update_moves_the_learner_version(make_hub) -> None:
    hub = make_hub(batch_size=2, per_lease=2, max_staleness=0)
    answer(hub, lease(hub), version=0)
    assert len(hub.handle(SampleRequest(num_groups=2)).groups) == 2
    assert hub.learner_version == 0  # a sample request carries no version
    ack = hub.handle(VersionUpdate(version=1, step=1))
    assert isinstance(ack, Ack) and hub.learner_version == 1
    assert lease(hub).min_version == 1


def test_group_stale_on_arrival_is_dropped_and_its_prompt_returns(make_hub) -> None:
    hub = make_hub(batch_size=2, per_lease=2, max_staleness=0)
    granted = lease(hub)
    hub.handle(VersionUpdate(version=1, step=1))
    acks = answer(hub, granted, version=0)
    assert [(a.verdict, a.accepted) for a in acks] == [("stale", False)] * 2
    assert hub.counts["dropped/stale_on_arrival"] == 2 and hub.source.returned == 2
    assert len(hub.store) == 0


def test_every_refusal_has_a_counter_reported_from_the_start(make_hub) -> None:
    assert set(REFUSALS) == set(get_args(RolloutVerdict)) - {"accepted", "run_failed"}
    assert set(REFUSALS.values()) <= set(COUNTERS)
    stats = make_hub().stats()
    assert all(stats[f"buffer/{name}"] == 0.0 for name in REFUSALS.values())


def test_a_message_the_buffer_does_not_take_is_answered_unexpected(make_hub) -> None:
    hub = make_hub()
    reply = hub.handle(Ack(detail="hello"))
    assert isinstance(reply, ErrorReply) and reply.code == "unexpected"
    assert hub.counts["rejected/unexpected_message"] == 1


def test_heartbeats_renew_the_leases_of_a_generator_that_makes_progress(make_hub,
                                                                        clock) -> None:
    """A lease outlives its timeout while its generator's engine steps (or waits for weights
    the learner has not published); a generator that heartbeats but stopped generating
    loses it."""
    hub = make_hub(batch_size=4, per_lease=2, lease_timeout_s=10.0)
    granted = lease(hub)
    busy = 0.0
    for _ in range(5):  # 40 s of generation, four times the timeout
        clock.now += 8.0
        busy += 1.0
        hub.handle(Heartbeat(generator_id="g0", version=0, generation_seconds=busy))
        hub.tick()
    assert hub.leases.running == 2 and hub.counts["prompts/expired"] == 0
    assert all(a.accepted for a in answer(hub, granted))
    stuck = lease(hub)
    for _ in range(2):  # alive, but its engine no longer steps
        clock.now += 8.0
        hub.handle(Heartbeat(generator_id="g0", version=0, generation_seconds=busy))
        hub.tick()
    assert hub.counts["prompts/expired"] == len(stuck.prompts)


def test_a_stalled_buffer_excuses_its_generators_and_leases(make_hub, clock) -> None:
    """After the buffer itself stood still for 60 s, nobody is silent and no lease expired
    for that: their heartbeats and groups were waiting in its queue."""
    hub = make_hub(batch_size=4, per_lease=2, lease_timeout_s=10.0)
    granted = lease(hub)
    clock.now += 60.0
    hub.excuse(60.0)
    hub.tick()
    assert hub.counts["prompts/expired"] == 0 and hub.generators == 1
    assert all(a.accepted for a in answer(hub, granted))


def test_a_batch_asked_again_for_the_same_step_is_sent_again(make_hub) -> None:
    """The learner retries after a lost reply: the same groups, nothing served twice."""
    hub = make_hub(batch_size=2, per_lease=4, max_staleness=1)
    answer(hub, lease(hub))
    first = hub.handle(SampleRequest(num_groups=2, step=1))
    again = hub.handle(SampleRequest(num_groups=2, step=1))
    assert [g.rollout_id for g in again.groups] == [g.rollout_id for g in first.groups]
    assert hub.counts["groups/served"] == 2 and hub.counts["groups/trained"] == 2
    second = hub.handle(SampleRequest(num_groups=2, step=2))
    assert {g.rollout_id for g in second.groups}.isdisjoint(g.rollout_id for g in first.groups)
    assert hub.accounting_problems() == []


def test_each_served_step_is_recorded_in_the_rollout_log(make_hub, tmp_path) -> None:
    log = RolloutLogWriter(tmp_path)
    hub = make_hub(batch_size=2, per_lease=4, max_staleness=1, log=log)
    answer(hub, lease(hub))
    hub.handle(VersionUpdate(version=1, step=1))
    served = hub.handle(SampleRequest(num_groups=2, step=2))
    log.close()
    steps = read_steps(tmp_path)
    assert list(steps) == [2] and steps[2].version == 1
    assert steps[2].rollout_ids == [g.rollout_id for g in served.groups]


def test_a_checkpoint_deletes_the_log_segments_its_kept_checkpoints_cannot_need(
        make_hub, tmp_path) -> None:
    """One group per segment, one checkpoint kept, eta = 0: at the checkpoint after step 2
    (version 2) segment 0, closed when the learner held version 1, goes; segment 1, still
    being written then, stays."""
    log = RolloutLogWriter(tmp_path, segment_bytes=1,
                           budget=LogBudget(max_bytes=1, keep_last=1, max_staleness=0))
    hub = make_hub(batch_size=2, per_lease=2, max_staleness=1, log=log)
    answer(hub, lease(hub))
    segments = []
    for step in (1, 2):
        hub.handle(VersionUpdate(version=step, step=step))
        hub.handle(BufferCheckpointRequest(step=step))
        segments.append(sorted(p.name for p in tmp_path.glob("segment-*.rlog")))
    log.close()
    assert segments == [["segment-000000.rlog", "segment-000001.rlog"], ["segment-000001.rlog"]]
    assert hub.counts["rollout_log/write_errors"] == 0


def test_a_batch_request_for_a_step_past_the_run_is_refused(make_hub) -> None:
    hub = make_hub()
    reply = hub.handle(SampleRequest(num_groups=1, step=10**9))
    assert isinstance(reply, ErrorReply) and reply.code == "bad_request"
    assert "trainer.total_training_steps" in reply.detail


def test_a_second_process_under_a_live_name_is_refused_not_let_take_over(make_hub,
                                                                           clock) -> None:
    hub = make_hub(batch_size=8, per_lease=2)
    hub.handle(Attach(generator_id="gen", engine="torch", device="cpu", host="a", pid=1))
    held = lease(hub, "gen")
    reply = hub.handle(Attach(generator_id="gen", engine="torch", device="cpu", host="b", pid=2))
    assert isinstance(reply, AttachAck) and not reply.accepted
    assert "belongs to a live generator (pid 1 on a" in reply.reason
    assert 30.0 < reply.retry_after_s <= 31.0
    assert hub.counts["rejected/name_in_use"] == 1
    assert hub.leases.running == len(held.prompts)  # the holder keeps its leases
    again = hub.handle(Attach(generator_id="gen", engine="torch", device="cpu", host="a", pid=1))
    assert again.accepted
    clock.now += 31.0  # the first process died: its name is free once it falls silent
    taken = hub.handle(Attach(generator_id="gen", engine="torch", device="cpu", host="b", pid=2))
    assert taken.accepted and hub.registry.generators["gen"].pid == 2


def test_a_generator_restarted_in_place_of_its_dead_process_takes_its_name_at_once(
        make_hub, clock, caplog: pytest.LogCaptureFixture) -> None:
    hub = make_hub(batch_size=8, per_lease=2)
    hub.handle(Attach(generator_id="gen", engine="torch", device="cpu", host="a", pid=1,
                      lineage="feed0001"))
    held = lease(hub, "gen")  # then pid 1 dies, its last heartbeat a moment ago
    clock.now += 1.0
    wrong = hub.handle(Attach(generator_id="gen", engine="torch", device="cpu", host="b",
                              pid=2, lineage="feed0002"))
    assert not wrong.accepted and "of another lineage than this process's" in wrong.reason
    assert hub.counts["rejected/name_in_use"] == 1 and hub.leases.running == len(held.prompts)
    with caplog.at_level(logging.WARNING, logger="relay.buffer.hub"):
        reply = hub.handle(Attach(generator_id="gen", engine="torch", device="cpu", host="b",
                                  pid=2, lineage="feed0001"))  # restarted on another host
    assert isinstance(reply, AttachAck) and reply.accepted
    assert hub.registry.generators["gen"].pid == 2
    assert hub.counts["generators/replaced"] == 1
    assert hub.leases.running == 0  # the dead process's prompts are back in the pool
    assert hub.counts["prompts/returned"] == len(held.prompts)
    assert f"generator gen restarted, replacing pid 1 on a ({len(held.prompts)} leased " \
           "prompts back in the pool)" in caplog.text
    assert hub.accounting_problems() == []
    again = hub.handle(Attach(generator_id="gen", engine="torch", device="cpu", host="b",
                              pid=2, lineage="feed0001"))  # the same process, attaching again
    assert again.accepted and hub.counts["generators/replaced"] == 1


def test_a_lease_its_generator_never_heard_of_expires_while_the_generator_progresses(
        make_hub, clock) -> None:
    """The reply granting ``lost`` never reached the generator: its heartbeats name only the
    lease it got, so ``lost`` expires after its timeout and its prompts go back to the pool,
    while the named lease is renewed all along."""
    hub = make_hub(batch_size=8, per_lease=2, lease_timeout_s=10.0)
    lost, held = lease(hub), lease(hub)
    busy = 0.0
    for _ in range(5):  # 40 s of generation, four times the timeout
        clock.now += 8.0
        busy += 1.0
        hub.handle(Heartbeat(generator_id="g0", version=0, generation_seconds=busy,
                             leases=[held.lease_id]))
        hub.tick()
    assert hub.counts["prompts/expired"] == len(lost.prompts)
    assert hub.leases.running == len(held.prompts)
    assert all(a.accepted for a in answer(hub, held))
    assert [a.verdict for a in answer(hub, lost)] == ["unknown_lease"] * len(lost.prompts)
    assert hub.accounting_problems() == []


def test_a_lease_request_asked_again_gets_the_lease_granted_for_it(make_hub, clock) -> None:
    """A retry after a lost reply (the same request id) leases nothing more, and the lease's
    time counts from the retry, when its generator first has it; a new request leases
    more."""
    hub = make_hub(batch_size=8, per_lease=2, lease_timeout_s=25.0)
    ask = LeaseRequest(generator_id="g0", max_prompts=2, request_id="r1")
    first = hub.handle(ask)
    clock.now += 20.0
    again = hub.handle(ask)
    clock.now += 20.0
    hub.tick()
    assert hub.counts["prompts/expired"] == 0
    assert isinstance(again, PromptLease) and again.lease_id == first.lease_id
    assert [p.prompt_id for p in again.prompts] == [p.prompt_id for p in first.prompts]
    assert hub.counts["prompts/leased"] == 2 and hub.leases.running == 2
    other = hub.handle(LeaseRequest(generator_id="g0", max_prompts=2, request_id="r2"))
    assert other.lease_id != first.lease_id and hub.leases.running == 4
    unnamed = [lease(hub, max_prompts=2).lease_id for _ in range(2)]
    assert len(set(unnamed)) == 2 and hub.counts["prompts/leased"] == 8
