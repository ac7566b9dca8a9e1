"""learner.weights.WeightServer's evaluation side, over loopback: an offered version reaches
the evaluator whole and stamped with its step, and other messages are refused. (The queue's
logic is in test_eval_queue.py; the generators' side in
tests/generators/test_weight_receiver.py.)"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from generators.weight_receiver import receive_version
from learner.eval_queue import EvalOffer
from learner.weights import PublishedVersion, WeightServer, bucketize
from transport.messages import (
    ErrorReply,
    EvalReport,
    EvalRequest,
    Heartbeat,
    Message,
    WeightManifest,
    WeightRequest,
)
from transport.sockets import Client
from transport.threads import ThreadDied

TIMEOUT_S = 10.0


def version_tensors(scale: float) -> dict[str, torch.Tensor]:
    return {f"layer{i}.weight": torch.full((64, 64), scale * i, dtype=torch.bfloat16)
            for i in range(4)}


def published(version: int) -> PublishedVersion:
    """Version ``version`` in buckets of two tensors (two buckets)."""
    return bucketize(version, version_tensors(float(version)), bucket_bytes=2 * 64 * 64 * 2)


@pytest.fixture
def server() -> Iterator[WeightServer]:
    server = WeightServer("tcp://127.0.0.1:*").start()
    yield server
    server.stop()


@pytest.fixture
def client(server: WeightServer) -> Iterator[Client]:
    client = Client(server.endpoint)
    yield client
    client.close()


def ask(client: Client, after_step: int, report: EvalReport | None = None) -> list[Message]:
    """Every reply to one ``EvalRequest``."""
    return list(client.request_stream(EvalRequest(after_step=after_step, report=report),
                                      TIMEOUT_S))


def nothing_newer(replies: list[Message], after_step: int) -> bool:
    """The reply that means "no weights after ``after_step`` are due yet"."""
    return (len(replies) == 1 and isinstance(replies[0], WeightManifest)
            and replies[0].step == after_step and replies[0].num_buckets == 0)


def test_with_nothing_offered_the_reply_is_nothing_newer(server: WeightServer,
                                                         client: Client) -> None:
    assert nothing_newer(ask(client, -1), -1)
    server.publish(published(1))  # published for the generators is not offered to evaluate
    assert nothing_newer(ask(client, -1), -1)


def test_an_offered_version_arrives_whole_with_its_step(server: WeightServer,
                                                        client: Client) -> None:
    offered = published(2)
    assert offered.manifest.num_buckets == 2
    server.evaluation.offer(EvalOffer(step=10, version=2, weights=offered))
    replies = client.request_stream(EvalRequest(after_step=0), TIMEOUT_S)
    manifest, staged = receive_version(next(replies), replies)
    assert (manifest.step, manifest.version, manifest.num_buckets) == (10, 2, 2)
    assert staged is not None and staged.version == 2
    assert staged.tensors.keys() == version_tensors(2.0).keys()
    for name, tensor in version_tensors(2.0).items():
        assert torch.equal(staged.tensors[name], tensor)
    assert offered.manifest.step == 0  # stamped on a copy: what generators get is untouched
    assert nothing_newer(ask(client, 10), 10)


def test_other_messages_are_answered_unexpected(server: WeightServer, client: Client) -> None:
    reply = client.request(Heartbeat(generator_id="g0", version=0), TIMEOUT_S)
    assert isinstance(reply, ErrorReply) and reply.code == "unexpected"
    assert "Heartbeat" in reply.detail
    # and it goes on serving both kinds of request
    up_to_date = client.request(WeightRequest(generator_id="g0", have_version=0), TIMEOUT_S)
    assert up_to_date == WeightManifest(version=0)
    assert nothing_newer(ask(client, -1), -1)


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
            server.publish(bucketize(1, {"w": torch.zeros(2)}))
    finally:
        server.stop()
