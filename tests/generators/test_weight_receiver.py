"""A weight version reaches a generator whole, or not at all; the evaluator's receiver keeps
the versions offered for evaluation until they are evaluated."""

from __future__ import annotations

import gc
import logging
import time
import weakref
from collections.abc import Iterator

import msgspec
import pytest
import torch
from torch import nn

from relay.generators.weight_receiver import (
    EvalWeights,
    SUBSCRIBE_SETTLE_S,
    DeviceCopy,
    IncompleteVersion,
    VersionAssembler,
    WeightReceiver,
)
from relay.learner.weight_buckets import gather_buckets, plan_buckets
from relay.learner.weights import WeightStream
from relay.transport.messages import EvalOffer, WeightBucket, WeightManifest
from relay.transport.threads import ThreadDied

from ..conftest import LearnerSide

TIMEOUT_S = 20.0


def model(scale: float) -> nn.Module:
    layers = nn.Sequential(nn.Linear(16, 12), nn.Linear(12, 8))
    with torch.no_grad():
        for i, param in enumerate(layers.parameters()):
            param.fill_(scale * (i + 1))
    return layers


def version(number: int, scale: float = 1.0) -> tuple[WeightManifest, list[WeightBucket]]:
    """Version ``number`` of ``model(scale)`` in 256-byte buckets (some parameters split)."""
    layers = model(scale)
    plan = plan_buckets(layers, torch.bfloat16, 256)
    buckets = [b for b in gather_buckets(layers, plan, torch.bfloat16, number) if b]
    return plan.manifest(number, step=number), buckets


def assemble(messages: list) -> list:
    assembler = VersionAssembler()
    return [assembler.feed(m) for m in messages]


def test_a_version_is_staged_after_its_last_bucket_only() -> None:
    manifest, buckets = version(1)
    assert len(buckets) > 2
    *partial, staged = assemble([manifest, *buckets])
    assert all(s is None for s in partial)
    assert staged.version == 1
    for name, param in model(1.0).named_parameters():
        assert torch.equal(staged.tensors[name], param.detach().to(torch.bfloat16))


def test_a_version_handed_over_is_not_kept_by_the_assembler() -> None:
    """Once the version is staged, its memory belongs to whoever holds it: the assembler
    keeps no reference until the next version (a generator would otherwise hold a version
    in host memory after its engine loaded it)."""
    manifest, buckets = version(1)
    assembler = VersionAssembler()
    *_, staged = [assembler.feed(m) for m in (manifest, *buckets)]
    held = [weakref.ref(t) for t in staged.tensors.values()]
    del staged, buckets
    gc.collect()
    assert all(ref() is None for ref in held)


@pytest.mark.parametrize("fault, message", [
    ("skipped", "bucket 2 of version 1 where bucket 1 of version 1 was due"),
    ("other_version", "bucket 1 of version 9 where bucket 1 of version 1 was due"),
    ("unknown_name", "intruder is not in the manifest"),
    ("rows_out_of_order", "rows from 0 where row"),
    ("wrong_dtype", "a piece of torch.float32"),
])
def test_a_bucket_that_does_not_continue_the_version_is_refused(fault: str,
                                                                message: str) -> None:
    manifest, buckets = version(1)
    second = buckets[1]
    broken = {
        "skipped": buckets[2],
        "other_version": msgspec.structs.replace(second, version=9),
        "unknown_name": msgspec.structs.replace(second, names=["intruder", *second.names[1:]]),
        "rows_out_of_order": msgspec.structs.replace(second, starts=[0, *second.starts[1:]]),
        "wrong_dtype": msgspec.structs.replace(
            second, tensors=[second.tensors[0].float(), *second.tensors[1:]]),
    }[fault]
    if fault == "rows_out_of_order":
        assert second.starts[0] > 0  # the bucket continues a split parameter
    assembler = VersionAssembler()
    assembler.feed(manifest)
    assembler.feed(buckets[0])
    with pytest.raises(IncompleteVersion, match=message):
        assembler.feed(broken)
    assert assembler.version is None  # dropped: the rest of it is refused too
    with pytest.raises(IncompleteVersion):
        assembler.feed(buckets[2])
    *_, staged = [assembler.feed(m) for m in (manifest, *buckets)]  # a new manifest: afresh
    assert staged is not None and staged.version == 1


def test_a_version_missing_rows_after_its_last_bucket_is_refused() -> None:
    manifest, buckets = version(1)
    short = msgspec.structs.replace(manifest, num_buckets=len(buckets) - 1)
    with pytest.raises(IncompleteVersion, match="incomplete after the last bucket"):
        assemble([short, *buckets[:-1]])


def rescale(layers: nn.Module, scale: float) -> None:
    """Give ``layers`` the weights of ``model(scale)``."""
    with torch.no_grad():
        for i, param in enumerate(layers.parameters()):
            param.fill_(scale * (i + 1))


@pytest.fixture
def learner() -> Iterator[LearnerSide]:
    side = LearnerSide(model(1.0), bucket_bytes=256)
    yield side
    side.close()


def test_a_receiver_whose_thread_dies_says_so_instead_of_waiting(learner: LearnerSide,
                                                                  monkeypatch) -> None:
    """An unexpected error in the receiving thread stops the waiting generator loudly."""
    def broken(*_args):
        raise KeyError("a bug")

    monkeypatch.setattr(VersionAssembler, "feed", broken)
    receiver = WeightReceiver(learner.server.endpoint, learner.stream.endpoint, "g0",
                              poll_s=0.05).start(applied_version=0)
    try:
        learner.publish(1)
        deadline = time.monotonic() + TIMEOUT_S
        with pytest.raises(ThreadDied, match="weight-receiver.*a bug"):
            while time.monotonic() < deadline:
                receiver.wait_for(1, timeout_s=0.1)
                if learner.server.resend_wanted():
                    learner.publish(1)
    finally:
        receiver.stop()


def test_the_evaluator_keeps_each_offered_version_until_it_is_evaluated(
        learner: LearnerSide, caplog: pytest.LogCaptureFixture) -> None:
    weights = EvalWeights(learner.server.endpoint, learner.stream.endpoint, max_waiting=1,
                          poll_s=0.05).start(applied_version=0)
    try:
        learner.publish_until(1, lambda: weights._have == 1)
        learner.stream.offer(EvalOffer(step=10, version=1))
        rescale(learner.model, 2.0)
        learner.publish_until(2, lambda: weights._have == 2)  # newer, not offered
        kept = weights.weights_for(10, 1, timeout_s=TIMEOUT_S)  # still there
        assert kept is not None and kept.version == 1
        assert float(kept.tensors["0.bias"][0]) == 2.0  # scale 1, second parameter
        weights.release(10)
        # an offer whose version is the newest is kept even if asked for before it came
        assert weights.weights_for(20, 2, timeout_s=TIMEOUT_S).version == 2
        weights.release(20)
        assert weights.weights_for(30, 7, timeout_s=0.2) is None  # never published
        with caplog.at_level(logging.WARNING, logger="relay.generators.weight_receiver"):
            for step in (40, 50, 60):
                learner.publish_until(step, lambda s=step: weights._have == s)
                learner.stream.offer(EvalOffer(step=step, version=step))
            deadline = time.monotonic() + TIMEOUT_S
            while "after step 40" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.02)
        assert "dropped the weights offered after step 40" in caplog.text  # max_waiting 1
        assert weights.weights_for(60, 60, timeout_s=TIMEOUT_S) is not None
        assert weights.weights_for(40, 40, timeout_s=0.2) is None
    finally:
        weights.stop()


def test_once_it_heard_the_stream_the_evaluator_hears_every_offered_version(
        learner: LearnerSide) -> None:
    """The learner's stream binds after the evaluator connected to it (the evaluator started
    first), so the subscription arrives late: ``wait_subscribed`` ends only when the stream
    is heard, not after a while. Then versions streamed back to back, each offered, all
    arrive without asking again, though the stream only ever repeats the newest."""
    late_endpoint = learner.stream.endpoint
    learner.stream.close()
    weights = EvalWeights(learner.server.endpoint, late_endpoint, max_waiting=3,
                          poll_s=0.05).start(applied_version=0)
    try:
        assert not weights.wait_subscribed(timeout_s=SUBSCRIBE_SETTLE_S + 0.2)  # no timer
        learner.stream = WeightStream(late_endpoint)
        learner.greet(lambda: weights.wait_subscribed(timeout_s=0.05))
        for number in (1, 2, 3):
            rescale(learner.model, float(number))
            learner.publish(number)
            learner.stream.offer(EvalOffer(step=number, version=number))
        for number in (1, 2, 3):
            kept = weights.weights_for(number, number, timeout_s=TIMEOUT_S)
            assert kept is not None and kept.version == number
            assert float(kept.tensors["0.bias"][0]) == 2.0 * number
        assert weights.resends == 0
    finally:
        weights.stop()


def test_a_beacon_stages_nothing_and_warns_of_nothing(learner: LearnerSide,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    weights = WeightReceiver(learner.server.endpoint, learner.stream.endpoint, "gen-0",
                             poll_s=0.05).start(applied_version=0)
    try:
        with caplog.at_level(logging.WARNING, logger="relay.generators.weight_receiver"):
            learner.greet(lambda: weights.wait_subscribed(timeout_s=0.05))
            learner.publish_until(1, lambda: weights._have == 1)
        assert weights.take().version == 1
        assert caplog.text == ""
    finally:
        weights.stop()


# -- a device copy: filled bucket by bucket, handed over atomically -------------------------

CPU = torch.device("cpu")  # a DeviceCopy's device: CUDA in use, the CPU here


def expected_weights(scale: float) -> dict[str, torch.Tensor]:
    return {name: p.detach().to(torch.bfloat16) for name, p in model(scale).named_parameters()}


def test_a_device_copy_is_made_once_and_filled_bucket_by_bucket() -> None:
    """Version after version lands in the same tensors, none of which shares memory with a
    bucket (the frames are free once their bucket is copied); a different set of shapes
    makes a new copy."""
    copy = DeviceCopy(CPU)
    assembler = VersionAssembler(copy)
    tensors = None
    for number, scale in ((1, 1.0), (2, 3.0)):
        manifest, buckets = version(number, scale)
        frames = {t.untyped_storage().data_ptr() for b in buckets for t in b.tensors}
        *partial, staged = [assembler.feed(m) for m in (manifest, *buckets)]
        assert all(s is None for s in partial) and staged.version == number
        assert staged.tensors.keys() == expected_weights(scale).keys()
        for name, tensor in expected_weights(scale).items():
            assert torch.equal(staged.tensors[name], tensor), (number, name)
            assert staged.tensors[name].untyped_storage().data_ptr() not in frames, name
        assert tensors is None or all(staged.tensors[n].data_ptr() == tensors[n]
                                      for n in tensors)
        tensors = {n: t.data_ptr() for n, t in staged.tensors.items()}
    assert copy.made == 1
    other = nn.Sequential(nn.Linear(4, 3))
    plan = plan_buckets(other, torch.bfloat16, 256)
    assembler.feed(plan.manifest(3, step=3))
    assert copy.made == 2 and copy.tensors["0.weight"].shape == (3, 4)


def copy_receiver(learner: LearnerSide) -> WeightReceiver:
    return WeightReceiver(learner.server.endpoint, learner.stream.endpoint, "g0",
                          poll_s=0.05, staging_device=CPU).start(applied_version=0)


def load(staged, engine: dict[str, torch.Tensor]) -> None:
    """What an engine's load_weights does with the copy: copy each tensor in."""
    for name, tensor in staged.tensors.items():
        engine[name] = tensor.clone()


def test_a_handover_is_never_written_into_and_a_newer_version_follows(
        learner: LearnerSide) -> None:
    """While the engine loads version 1 from the copy (slowly), version 2 streams in: the
    copy keeps version 1 until the load ends, then takes version 2 whole. A resent version
    the receiver has is not assembled again. (Fails without the receiver's copy lock.)"""
    receiver = copy_receiver(learner)
    engine: dict[str, torch.Tensor] = {}
    try:
        learner.publish_until(1, lambda: receiver._staged_version() == 1)
        with pytest.raises(TypeError, match="handover"):
            receiver.take()
        with receiver.handover(at_least=1) as staged:
            assert staged is not None and staged.version == 1
            rescale(learner.model, 2.0)
            learner.publish(2)  # its buckets wait for the receiving thread
            time.sleep(0.5)  # the engine takes its time; the thread would write meanwhile
            load(staged, engine)
        for name, tensor in expected_weights(1.0).items():
            assert torch.equal(engine[name], tensor), name
        with receiver.handover(at_least=2, wait_s=TIMEOUT_S) as staged:
            assert staged is not None and staged.version == 2
            load(staged, engine)
        for name, tensor in expected_weights(2.0).items():
            assert torch.equal(engine[name], tensor), name
        learner.publish(2)  # resent: nothing to assemble
        with receiver.handover(wait_s=0.5) as staged:
            assert staged is None
    finally:
        receiver.stop()


def test_a_version_missing_a_bucket_leaves_the_engine_on_the_last_whole_one(
        learner: LearnerSide) -> None:
    """Version 2 arrives without one of its buckets: nothing is handed over (the copy's
    half-written version is never loaded); asked again, version 2 arrives whole."""
    receiver = copy_receiver(learner)
    engine: dict[str, torch.Tensor] = {}
    try:
        learner.publish_until(1, lambda: receiver._staged_version() == 1)
        with receiver.handover() as staged:
            load(staged, engine)
        rescale(learner.model, 2.0)
        manifest, buckets = learner.plan.manifest(2, step=2), \
            list(gather_buckets(learner.model, learner.plan, torch.bfloat16, 2))
        learner.stream.send_version(manifest, buckets[:1] + buckets[2:])
        learner.server.published(2, step=2)
        with receiver.handover(at_least=2, wait_s=1.0) as staged:
            assert staged is None
        for name, tensor in expected_weights(1.0).items():
            assert torch.equal(engine[name], tensor), name
        learner.publish_until(2, lambda: receiver._staged_version() == 2)  # asked again
        with receiver.handover(at_least=2) as staged:
            load(staged, engine)
        for name, tensor in expected_weights(2.0).items():
            assert torch.equal(engine[name], tensor), name
    finally:
        receiver.stop()


def test_the_evaluator_lets_go_of_an_unoffered_version_when_a_newer_one_starts(
        learner: LearnerSide) -> None:
    """Version 1 (offered) and version 2 (not) arrive; once version 3 starts, version 2 is
    no longer held (no offer can name it now) while version 1 waits for its evaluation."""
    weights = EvalWeights(learner.server.endpoint, learner.stream.endpoint, max_waiting=2,
                          poll_s=0.05).start(applied_version=0)
    try:
        learner.publish_until(1, lambda: weights._have == 1)
        learner.stream.offer(EvalOffer(step=1, version=1))
        rescale(learner.model, 2.0)
        learner.publish_until(2, lambda: weights._have == 2)
        rescale(learner.model, 3.0)
        buckets = list(gather_buckets(learner.model, learner.plan, torch.bfloat16, 3))
        learner.stream.send_version(learner.plan.manifest(3, step=3), buckets[:1])  # begun
        deadline = time.monotonic() + TIMEOUT_S
        while weights._newest is not None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert weights._newest is None
        assert weights.weights_for(2, 2, timeout_s=0.2) is None
        kept = weights.weights_for(1, 1, timeout_s=TIMEOUT_S)
        assert kept is not None and float(kept.tensors["0.bias"][0]) == 2.0
    finally:
        weights.stop()


def test_without_room_for_the_device_copy_versions_arrive_in_host_memory(
        learner: LearnerSide, monkeypatch, caplog: pytest.LogCaptureFixture) -> None:
    """The copy cannot be made (the device is full): the receiver says so and assembles
    the version whole in host memory instead."""
    def full(_copy, _manifest):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 14.20 GiB")

    monkeypatch.setattr(DeviceCopy, "start", full)
    receiver = copy_receiver(learner)
    try:
        with caplog.at_level(logging.WARNING, logger="relay.generators.weight_receiver"):
            learner.publish_until(1, lambda: receiver._staged_version() == 1)
        assert "no room on cpu for a second copy of the weights" in caplog.text
        assert receiver.copy is None
        staged = receiver.take()  # a host version: the engine may keep it
        for name, tensor in expected_weights(1.0).items():
            assert torch.equal(staged.tensors[name], tensor), name
    finally:
        receiver.stop()
