"""The buffer's accounting: every leased prompt ends completed, returned, expired or still
in flight; every answering group is admitted, dropped, refused or failed; every admitted
group is trained on, dropped stale (its prompt back in the pool) or still stored. The sums
hold after every operation, failures included, and the check does catch a lost group."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import msgspec
import pytest
import torch

from relay.buffer.dynamic_sampling import DynamicSampling
from relay.buffer.hub import Hub
from relay.buffer.prioritized import PrioritizedStore
from relay.buffer.rollout_log import RolloutLogWriter
from relay.buffer.store import Admission, FifoStore, FilteredStore, Taken
from relay.configs.run_schema import ReplayConfig
from relay.transport.messages import (
    Attach,
    Detach,
    Heartbeat,
    LeaseRequest,
    LeaseReturn,
    Prompt,
    PromptLease,
    RolloutGroup,
    SampleBatch,
    SampleRequest,
    VersionUpdate,
)

from .conftest import make_group
from .test_hub import answer, lease


def balanced(hub: Hub) -> None:
    assert hub.accounting_problems() == []
    assert hub.stats()["buffer/accounting_problems"] == 0.0


def test_every_path_of_a_prompt_keeps_the_sums(make_hub, clock) -> None:
    store = FilteredStore(FifoStore(), [DynamicSampling("score", 2, 0)])
    hub = make_hub(batch_size=2, n=2, per_lease=2, max_staleness=1, lease_timeout_s=10.0,
                   store=store)
    first = lease(hub)
    assert hub.handle(make_group(first.lease_id, first.prompts[0], 2, rewards=[1.0, 0.0])).accepted
    balanced(hub)
    bad = make_group(first.lease_id, first.prompts[1], 2, rewards=[1.0, 0.0])
    bad.samples[0].logprobs = bad.samples[0].logprobs.half()
    assert hub.handle(bad).verdict == "malformed"
    balanced(hub)
    second = lease(hub)  # the malformed group's prompt, then a new one
    assert second.prompts[0] == first.prompts[1]
    assert hub.handle(make_group(second.lease_id, second.prompts[0], 2,
                                 rewards=[1.0, 1.0])).verdict == "zero_variance"
    balanced(hub)
    hub.handle(LeaseReturn(generator_id="g0", lease_id=second.lease_id,
                           prompt_ids=[second.prompts[1].prompt_id]))
    balanced(hub)
    third = lease(hub)
    clock.now += 11.0
    hub.tick()  # third expires
    balanced(hub)
    fourth = lease(hub)
    hub.handle(Detach(generator_id="g0"))
    balanced(hub)
    hub.handle(Attach(generator_id="g0", engine="torch", device="cpu"))
    fifth = lease(hub)
    hub.handle(Attach(generator_id="g0", engine="torch", device="cpu"))  # restarted
    balanced(hub)
    assert hub.counts["prompts/expired"] == len(third.prompts)
    assert hub.counts["prompts/returned"] == 1 + len(fourth.prompts) + len(fifth.prompts)
    sixth = lease(hub)
    for prompt in sixth.prompts:
        hub.handle(make_group(sixth.lease_id, prompt, 2, rewards=[0.0, 1.0]))
    balanced(hub)
    batch = hub.handle(SampleRequest(num_groups=2))
    assert len(batch.groups) == 2 and hub.counts["groups/trained"] == 2
    balanced(hub)


def test_a_group_gone_stale_in_the_store_returns_its_prompt(make_hub) -> None:
    hub = make_hub(batch_size=2, per_lease=2, max_staleness=1)
    granted = lease(hub)
    answer(hub, granted, version=0)
    hub.handle(VersionUpdate(version=2, step=2))
    batch = hub.handle(SampleRequest(num_groups=2))
    assert batch.groups == [] and hub.counts["dropped/stale"] == 2
    assert hub.source.returned == 2 and len(hub.store) == 0
    balanced(hub)
    again = lease(hub)
    assert [p.prompt_id for p in again.prompts] == [p.prompt_id for p in granted.prompts]
    assert all(a.accepted for a in answer(hub, again, version=2))
    assert len(hub.handle(SampleRequest(num_groups=2)).groups) == 2
    balanced(hub)


class BrokenLog(RolloutLogWriter):
    def append(self, group: RolloutGroup) -> None:
        raise OSError(28, "No space left on device")


def test_a_rollout_log_error_skips_no_counter(make_hub, tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    hub = make_hub(batch_size=2, per_lease=2, log=BrokenLog(tmp_path))
    with caplog.at_level(logging.ERROR, logger="relay.buffer.hub"):
        acks = answer(hub, lease(hub))
    assert all(a.accepted for a in acks)
    assert hub.counts["groups/accepted"] == 2 and hub.counts["rollout_log/write_errors"] == 2
    assert "No space left on device" in caplog.text
    balanced(hub)
    assert len(hub.handle(SampleRequest(num_groups=2)).groups) == 2
    balanced(hub)


class FailingStore(FifoStore):
    def add(self, group: RolloutGroup) -> Admission:
        raise RuntimeError("store bug")


def test_a_store_error_returns_the_prompt(make_hub) -> None:
    hub = make_hub(store=FailingStore())
    granted = lease(hub)
    with pytest.raises(RuntimeError, match="store bug"):
        hub.handle(make_group(granted.lease_id, granted.prompts[0], granted.n))
    assert hub.counts["groups/store_errors"] == 1 and hub.source.returned == 1
    balanced(hub)


def test_a_failed_run_keeps_the_sums(make_hub) -> None:
    store = FilteredStore(FifoStore(), [DynamicSampling("score", 2, 1)])
    hub = make_hub(batch_size=2, per_lease=2, store=store)
    granted = lease(hub)
    verdicts = [hub.handle(make_group(granted.lease_id, p, 2)).verdict for p in granted.prompts]
    assert verdicts == ["zero_variance", "run_failed"] and hub.failure
    balanced(hub)


def test_groups_drawn_again_are_trained_once(make_hub) -> None:
    config = ReplayConfig(priority="uniform", max_reuse=3, seed=0)
    hub = make_hub(batch_size=2, per_lease=2, store=PrioritizedStore(config, max_staleness=0))
    answer(hub, lease(hub))
    for _ in range(3):
        assert len(hub.handle(SampleRequest(num_groups=2)).groups) == 2
        assert hub.counts["groups/trained"] == 2
        balanced(hub)
    assert len(hub.store) == 0 and hub.counts["groups/served"] == 6


class LosingStore(FifoStore):
    """Forgets one group without saying so."""

    def take(self, num_groups: int, learner_version: int, max_staleness: int, *,
             run_fraction: float) -> Taken:
        self._groups.popleft()
        return Taken(groups=[], dropped_stale=[])


def test_the_check_catches_a_lost_group(make_hub, caplog: pytest.LogCaptureFixture) -> None:
    hub = make_hub(batch_size=2, per_lease=2, store=LosingStore())
    answer(hub, lease(hub))
    hub.handle(SampleRequest(num_groups=2))
    problems = hub.accounting_problems()
    assert problems == ["2 groups never trained on, but the store holds 1"]
    assert hub.stats()["buffer/accounting_problems"] == 1.0
    with caplog.at_level(logging.ERROR, logger="relay.buffer.hub"):
        hub.tick()
        hub.tick()
    assert caplog.text.count("accounting is off") == 1  # once, when it goes wrong


def test_the_sums_hold_through_a_random_run_with_faults(make_hub, clock) -> None:
    """Seeded random operations from two generators and the learner, faults included:
    malformed, stale and zero-variance groups, returns, expiries, silences, restarts."""
    rng = random.Random(1)
    store = FilteredStore(FifoStore(), [DynamicSampling("score", 4, 0)])
    hub = make_hub(batch_size=4, n=2, per_lease=3, max_staleness=1, lease_timeout_s=5.0,
                   store=store)
    hub.handle(Attach(generator_id="g1", engine="torch", device="cpu"))
    generators = ["g0", "g1"]
    outstanding: list[tuple[str, PromptLease, Prompt]] = []  # (generator, lease, prompt)

    def send(generator: str, granted: PromptLease, prompt: Prompt) -> None:
        version = max(0, hub.learner_version - rng.choice([0, 0, 1, 2]))
        rewards = rng.choice([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
        group = make_group(granted.lease_id, prompt, 2, version, generator_id=generator,
                           rewards=rewards)
        fault = rng.random()
        if fault < 0.1:
            group = msgspec.structs.replace(group, samples=group.samples[:1])
        elif fault < 0.2:
            group.samples[0].response_ids = torch.full_like(group.samples[0].response_ids, 99)
        hub.handle(group)

    for _ in range(1000):
        op = rng.random()
        if op < 0.2:
            generator = rng.choice(generators)
            reply = hub.handle(LeaseRequest(generator_id=generator, max_prompts=3))
            if isinstance(reply, PromptLease):
                outstanding += [(generator, reply, p) for p in reply.prompts]
        elif op < 0.7 and outstanding:
            send(*outstanding.pop(rng.randrange(len(outstanding))))
        elif op < 0.73 and outstanding:
            generator, granted, prompt = outstanding.pop(rng.randrange(len(outstanding)))
            hub.handle(LeaseReturn(generator_id=generator, lease_id=granted.lease_id,
                                   prompt_ids=[prompt.prompt_id]))
        elif op < 0.78:
            clock.now += rng.choice([0.5, 6.0])
            hub.handle(Heartbeat(generator_id=rng.choice(generators), version=0))
            hub.tick()
        elif op < 0.8:
            generator = rng.choice(generators)
            hub.handle(rng.choice([Detach(generator_id=generator),
                                   Attach(generator_id=generator, engine="torch",
                                          device="cpu")]))
        else:
            batch = hub.handle(SampleRequest(num_groups=4))
            assert isinstance(batch, SampleBatch)
            if batch.groups:
                step = hub.learner_step + 1
                hub.handle(VersionUpdate(version=step, step=step))
        balanced(hub)
    counts = hub.counts
    assert counts["groups/trained"] > 10 and counts["rejected/malformed"] > 10
    assert counts["dropped/stale"] > 0 and counts["dropped/stale_on_arrival"] > 0
    assert counts["prompts/expired"] > 0 and counts["prompts/returned"] > 0
    assert counts["dropped/zero_variance"] > 0
