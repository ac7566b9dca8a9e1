"""learner.weights.WeightServer's evaluation side, over loopback: the evaluator gets the
newest offer once (an untaken one is replaced), whole and stamped with its step, hands its
report back with the next request, and is told to stop when the run is over. (The
generators' side is in tests/generators/test_weight_receiver.py.)"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from generators.weight_receiver import receive_version
from learner.weights import EvalOffer, PublishedVersion, WeightServer, bucketize
from transport.messages import (
    ErrorReply,
    EvalReport,
    EvalRequest,
    Heartbeat,
    Message,
    Shutdown,
    WeightManifest,
    WeightRequest,
)
from transport.sockets import Client

TIMEOUT_S = 10.0
LONG_WAIT_S = 30.0  # an end_evaluation wait that the test must never sit through


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


def test_the_initial_checkpoint_is_offered_without_buckets(server: WeightServer,
                                                           client: Client) -> None:
    server.offer_evaluation(EvalOffer(step=0, version=0, weights=None))
    assert ask(client, -1) == [WeightManifest(version=0, step=0)]
    assert nothing_newer(ask(client, 0), 0)  # taken: not handed out twice


def test_an_offered_version_arrives_whole_with_its_step(server: WeightServer,
                                                        client: Client) -> None:
    offered = published(2)
    assert offered.manifest.num_buckets == 2
    server.offer_evaluation(EvalOffer(step=10, version=2, weights=offered))
    replies = client.request_stream(EvalRequest(after_step=0), TIMEOUT_S)
    manifest, staged = receive_version(next(replies), replies)
    assert (manifest.step, manifest.version, manifest.num_buckets) == (10, 2, 2)
    assert staged is not None and staged.version == 2
    assert staged.tensors.keys() == version_tensors(2.0).keys()
    for name, tensor in version_tensors(2.0).items():
        assert torch.equal(staged.tensors[name], tensor)
    assert offered.manifest.step == 0  # stamped on a copy: what generators get is untouched
    assert nothing_newer(ask(client, 10), 10)


def test_a_newer_offer_replaces_an_untaken_one(server: WeightServer, client: Client,
                                               caplog: pytest.LogCaptureFixture) -> None:
    server.offer_evaluation(EvalOffer(step=10, version=1, weights=published(1)))
    with caplog.at_level(logging.WARNING, logger="learner.weights"):
        server.offer_evaluation(EvalOffer(step=20, version=2, weights=published(2)))
    assert "step 10 will not be evaluated" in caplog.text
    steps = []
    for after_step in (0, 0, 5, 20):
        replies = ask(client, after_step)
        assert isinstance(replies[0], WeightManifest)
        steps.append(replies[0].step)
    assert steps == [20, 0, 5, 20]  # step 10 never: once 20 is taken, nothing is due


def test_a_report_comes_back_with_the_next_request(server: WeightServer,
                                                   client: Client) -> None:
    server.offer_evaluation(EvalOffer(step=0, version=0, weights=None))
    ask(client, -1)
    assert server.take_eval_reports() == []
    report = EvalReport(step=0, version=0, metrics={"eval/accuracy": 0.25})
    server.offer_evaluation(EvalOffer(step=5, version=1, weights=published(1)))
    replies = ask(client, 0, report)
    assert isinstance(replies[0], WeightManifest) and replies[0].step == 5  # and the next
    assert server.take_eval_reports() == [report]
    assert server.take_eval_reports() == []  # handed over once


def test_end_evaluation_waits_for_the_last_report_then_the_evaluator_is_stopped(
        server: WeightServer, client: Client) -> None:
    server.offer_evaluation(EvalOffer(step=10, version=1, weights=published(1)))
    assert ask(client, -1)[0].step == 10
    ended: list[list[EvalReport]] = []
    began = time.monotonic()
    waiter = threading.Thread(target=lambda: ended.append(
        server.end_evaluation(last_step=10, min_wait_s=LONG_WAIT_S)))
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive()  # step 10 not reported yet
    report = EvalReport(step=10, version=1, metrics={"eval/accuracy": 0.5})
    ask(client, 10, report)  # nothing newer, or already Shutdown: either way it is delivered
    waiter.join(TIMEOUT_S)
    assert not waiter.is_alive() and time.monotonic() - began < LONG_WAIT_S / 2
    assert ended == [[report]]
    assert ask(client, 10) == [Shutdown(reason="the run is over")]


def test_end_evaluation_returns_at_once_when_the_last_report_is_in(server: WeightServer,
                                                                   client: Client) -> None:
    server.offer_evaluation(EvalOffer(step=10, version=1, weights=published(1)))
    ask(client, -1)
    report = EvalReport(step=10, version=1, metrics={})
    assert nothing_newer(ask(client, 10, report), 10)
    began = time.monotonic()
    assert server.end_evaluation(last_step=10, min_wait_s=LONG_WAIT_S) == [report]
    assert time.monotonic() - began < LONG_WAIT_S / 2
    assert ask(client, 10) == [Shutdown(reason="the run is over")]


def test_an_offer_left_at_the_end_is_still_handed_out_before_shutdown(
        server: WeightServer, client: Client, caplog: pytest.LogCaptureFixture) -> None:
    server.offer_evaluation(EvalOffer(step=10, version=1, weights=published(1)))
    with caplog.at_level(logging.WARNING, logger="learner.weights"):
        assert server.end_evaluation(last_step=10, min_wait_s=0.2) == []  # nobody asked
    assert "no evaluation of step 10 arrived in time" in caplog.text
    assert ask(client, -1)[0].step == 10
    assert ask(client, 10) == [Shutdown(reason="the run is over")]


def test_other_messages_are_answered_unexpected(server: WeightServer, client: Client) -> None:
    reply = client.request(Heartbeat(generator_id="g0", version=0), TIMEOUT_S)
    assert isinstance(reply, ErrorReply) and reply.code == "unexpected"
    assert "Heartbeat" in reply.detail
    # and it goes on serving both kinds of request
    up_to_date = client.request(WeightRequest(generator_id="g0", have_version=0), TIMEOUT_S)
    assert up_to_date == WeightManifest(version=0)
    assert nothing_newer(ask(client, -1), -1)


def test_end_evaluation_returns_at_once_when_the_last_report_was_already_taken(
        server: WeightServer, client: Client) -> None:
    server.offer_evaluation(EvalOffer(step=0, version=0, weights=None))
    ask(client, -1)
    ask(client, 0, EvalReport(step=0, version=0, metrics={}))
    assert [r.step for r in server.take_eval_reports()] == [0]  # the loop logged it already
    began = time.monotonic()
    assert server.end_evaluation(last_step=0, min_wait_s=LONG_WAIT_S) == []
    assert time.monotonic() - began < LONG_WAIT_S / 2
