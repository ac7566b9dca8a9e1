"""relay.learner.weights over loopback: a version streams once to every subscriber and arrives
whole; a subscriber that missed it asks again and gets it; one that stops reading neither
stalls the learner nor starves the others; the weight server names the newest version,
takes resend wishes only from those behind, serves the evaluation queue (to the evaluator's
key only, under CURVE) and refuses everything else. (Buckets: test_weight_buckets.py; the generators' side:
tests/generators/test_weight_receiver.py; the queue: test_eval_queue.py.)"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import relay.learner.weights as weights_module
from relay.generators.weight_receiver import StagedWeights, WeightReceiver
from relay.learner.weight_buckets import buffer_spec
from relay.learner.weights import WeightServer
from relay.transport.messages import (
    ErrorReply,
    EvalOffer,
    EvalRequest,
    Heartbeat,
    WeightBucket,
    WeightManifest,
    WeightRequest,
)
from relay.transport.security import ClientKeys, ServerKeys, create_keypair
from relay.transport.sockets import Client, Subscriber
from relay.transport.threads import ThreadDied

from ..conftest import LearnerSide

TIMEOUT_S = 20.0


def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 32))


@pytest.fixture
def learner() -> Iterator[LearnerSide]:
    side = LearnerSide(small_model(), bucket_bytes=2048)
    yield side
    side.close()


def receiver(learner: LearnerSide, name: str) -> WeightReceiver:
    return WeightReceiver(learner.server.endpoint, learner.stream.endpoint, name,
                          poll_s=0.05).start(applied_version=0)


def expected(learner: LearnerSide) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(torch.bfloat16) for n, p in learner.model.named_parameters()}


def deliver(learner: LearnerSide, version: int,
            receivers: list[WeightReceiver]) -> dict[str, StagedWeights]:
    """Publish ``version`` (again whenever a subscriber asks) until every receiver has it."""
    got: dict[str, StagedWeights] = {}

    def everyone_has_it() -> bool:
        for r in receivers:
            staged = r.wait_for(version, timeout_s=0.02)
            if staged is not None:
                got[r.generator_id] = staged
        return len(got) == len(receivers)

    learner.publish_until(version, everyone_has_it, timeout_s=TIMEOUT_S)
    return got


def test_a_version_reaches_every_subscriber_whole(learner: LearnerSide) -> None:
    assert len(learner.plan.buckets) > 3  # several buckets, parameters split across them
    receivers = [receiver(learner, f"g{i}") for i in range(2)]
    try:
        got = deliver(learner, 1, receivers)
        assert sorted(got) == ["g0", "g1"]
        for staged in got.values():
            assert staged.version == 1
            assert staged.tensors.keys() == expected(learner).keys()
            for name, tensor in expected(learner).items():
                assert torch.equal(staged.tensors[name], tensor), name
        with torch.no_grad():
            learner.model[0].weight.add_(1.0)
        assert all(s.version == 2 for s in deliver(learner, 2, receivers).values())
        assert all(r.take() is None for r in receivers)  # each version handed over once
    finally:
        for one in receivers:
            one.stop()


def test_a_subscriber_that_missed_a_version_asks_again_and_gets_it(learner: LearnerSide) -> None:
    learner.publish(3)  # nobody listens yet
    late = receiver(learner, "late")
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not learner.server.resend_wanted() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert late.resends >= 1
        assert deliver(learner, 3, [late])["late"].version == 3
    finally:
        late.stop()


def test_a_subscriber_that_stops_reading_stalls_no_one(learner: LearnerSide, monkeypatch) -> None:
    monkeypatch.setattr(weights_module, "send_wait_s", lambda nbytes: 0.5)
    big = LearnerSide(nn.Sequential(*(nn.Linear(1024, 512) for _ in range(8))),
                      bucket_bytes=1 << 20)  # 8 MiB of bf16 weights in 1 MiB buckets
    stuck = Subscriber(big.stream.endpoint)  # connected, never reads
    healthy = receiver(big, "healthy")
    try:
        read_one: list[object] = []  # the stuck one reads one beacon, then no more

        def both_heard() -> bool:
            if not read_one and (beacon := stuck.receive(timeout_s=0.05)) is not None:
                read_one.append(beacon)
            return bool(read_one) and healthy.wait_subscribed(timeout_s=0.05)

        big.greet(both_heard)  # both subscriptions reached the publisher
        began = time.monotonic()
        lagging = []
        for version in (1, 2, 3):
            lagging.append(big.publish(version).lagging)
            staged = healthy.wait_for(version, timeout_s=TIMEOUT_S)
            assert staged is not None and staged.version == version
        assert time.monotonic() - began < 10  # waited for the stuck one once, briefly
        assert any(lagging)
    finally:
        healthy.stop()
        stuck.close()
        big.close()


def test_versions_are_gathered_into_host_buffers_made_once(learner: LearnerSide) -> None:
    """Rank 0 gathers every version into the same host buffer (the CPU's one), made for
    the first publish; each version still arrives whole."""
    spec = buffer_spec(learner.model, learner.plan)
    buffers = learner.stream.host_buffers(spec)
    taken: list[int] = []  # the memory each bucket was gathered into
    take = buffers.take
    buffers.take = lambda: taken.append((buffer := take()).data_ptr()) or buffer
    one = receiver(learner, "g0")
    try:
        for version in (1, 2, 3):
            with torch.no_grad():
                learner.model[0].weight.add_(1.0)
            staged = deliver(learner, version, [one])["g0"]
            for name, tensor in expected(learner).items():
                assert torch.equal(staged.tensors[name], tensor), (version, name)
        assert learner.stream.host_buffers(spec) is buffers
        assert buffers.made == spec.count == 1 and spec.nbytes == max(learner.plan.sizes)
        assert len(taken) >= 3 * len(learner.plan.buckets) and len(set(taken)) == 1
    finally:
        one.stop()


def test_a_lagging_subscriber_later_reads_the_versions_it_was_sent(monkeypatch) -> None:
    """A subscriber that stops reading while three versions go by still reads, later, the
    bytes of each bucket ZeroMQ kept for it: a buffer whose send did not end is replaced,
    not refilled with the next bucket. (Fails when ``HostBuffers.sent`` reuses it.)"""
    monkeypatch.setattr(weights_module, "send_wait_s", lambda nbytes: 0.2)
    big = LearnerSide(nn.Sequential(*(nn.Linear(1024, 512) for _ in range(8))),
                      bucket_bytes=1 << 20)  # 8 MiB of bf16 weights in 1 MiB buckets
    stuck = Subscriber(big.stream.endpoint)
    try:
        big.greet(lambda: stuck.receive(timeout_s=0.05) is not None)
        sent: dict[int, dict[str, torch.Tensor]] = {}
        lagging = []
        for version in (1, 2, 3):
            with torch.no_grad():
                for param in big.model.parameters():
                    param.normal_()
            sent[version] = expected(big)
            lagging.append(big.publish(version).lagging)
        assert any(lagging)  # its queues filled up: ZeroMQ held buckets for it
        checked = 0
        while (msg := stuck.receive(timeout_s=2.0)) is not None:
            if not isinstance(msg, WeightBucket):
                continue
            for name, start, piece in zip(msg.names, msg.starts, msg.tensors):
                rows = sent[msg.version][name][start:start + piece.shape[0]]
                assert torch.equal(piece, rows), (msg.version, msg.index, name)
            checked += 1
        assert checked >= 8  # what its queues held: at least a version's worth
    finally:
        stuck.close()
        big.close()


def test_the_server_names_the_newest_version_and_takes_resends_only_from_those_behind(
        learner: LearnerSide) -> None:
    client = Client(learner.server.endpoint)
    try:
        def ask(have: int, resend: bool) -> WeightManifest:
            return client.request(WeightRequest(generator_id="g", have_version=have,
                                                resend=resend), TIMEOUT_S,
                                  expect=WeightManifest)

        assert ask(0, resend=True) == WeightManifest(version=0)
        assert not learner.server.resend_wanted()  # version 0 is model.path: nothing to resend
        learner.server.published(4, step=8)
        assert ask(4, resend=True) == WeightManifest(version=4, step=8)
        assert not learner.server.resend_wanted()  # up to date
        assert ask(2, resend=False).version == 4
        assert not learner.server.resend_wanted()  # behind, but did not ask
        ask(2, resend=True)
        assert learner.server.resend_wanted()
        learner.server.take_resend()
        assert not learner.server.resend_wanted()
    finally:
        client.close()


def test_the_server_answers_evaluation_requests_and_refuses_other_messages(
        learner: LearnerSide) -> None:
    client = Client(learner.server.endpoint)
    try:
        learner.server.evaluation.offer(EvalOffer(step=10, version=2))
        reply = client.request(EvalRequest(after_step=0), TIMEOUT_S)
        assert reply == WeightManifest(version=2, step=10)
        reply = client.request(Heartbeat(generator_id="g0", version=0), TIMEOUT_S)
        assert isinstance(reply, ErrorReply) and reply.code == "unexpected"
        assert "Heartbeat" in reply.detail
        reply = client.request(WeightRequest(generator_id="g0", have_version=0), TIMEOUT_S)
        assert reply == WeightManifest(version=0)  # and it goes on serving
    finally:
        client.close()


def test_only_the_evaluator_key_may_ask_for_evaluations(tmp_path: Path) -> None:
    """Under CURVE a generator key may fetch weights but not steer evaluation: its forged
    ``EvalRequest`` is refused before it reaches the queue, which keeps every offer."""
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    held = {}
    for name in ("generator", "evaluator"):
        held[name] = create_keypair(tmp_path / name, "client")
        shutil.copy(tmp_path / name / "client.key", authorized / f"{name}.key")
    server_pair = create_keypair(tmp_path, "server")
    server = WeightServer("tcp://127.0.0.1:*", keys=ServerKeys(server_pair, authorized)).start()
    clients = {name: Client(server.endpoint, keys=ClientKeys(pair, server_pair.public))
               for name, pair in held.items()}
    try:
        server.evaluation.offer(EvalOffer(step=10, version=2))
        forged = clients["generator"].request(EvalRequest(after_step=10**9), TIMEOUT_S)
        assert isinstance(forged, ErrorReply) and forged.code == "forbidden", forged
        assert "'generator' may act as generator, not as the evaluator" in forged.detail
        assert clients["generator"].request(
            WeightRequest(generator_id="g0", have_version=0), TIMEOUT_S) == WeightManifest(version=0)
        assert clients["evaluator"].request(EvalRequest(after_step=-1), TIMEOUT_S) == \
            WeightManifest(version=2, step=10)
        assert server.forbidden == 1
    finally:
        for client in clients.values():
            client.close()
        server.stop()


def test_the_server_drops_an_oversize_request(learner: LearnerSide) -> None:
    client = Client(learner.server.endpoint)
    try:
        huge = WeightRequest(generator_id="x" * weights_module.MAX_REQUEST_BYTES,
                             have_version=0)
        with pytest.raises(Exception, match="no reply"):
            client.request(huge, 1.0)
        reply = client.request(WeightRequest(generator_id="g0", have_version=0), 5.0)
        assert reply == WeightManifest(version=0)
    finally:
        client.close()


def test_publishing_after_the_server_thread_died_stops_the_learner(monkeypatch) -> None:
    server = WeightServer("tcp://127.0.0.1:*")

    def broken(_timeout_s: float) -> bool:
        raise OSError("socket gone")

    monkeypatch.setattr(server._server, "serve_once", broken)
    server.start()
    try:
        deadline = time.monotonic() + 5
        while server._thread._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(ThreadDied, match="weight-server.*socket gone"):
            server.published(1, step=1)
    finally:
        server.stop()
