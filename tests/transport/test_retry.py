"""relay.transport.retry: a request rides out a stalled peer, and gives up after its patience."""

from __future__ import annotations

import threading
import time

import pytest

from relay.transport.messages import Ack, Heartbeat
from relay.transport.retry import PeerGone, patient_request
from relay.transport.sockets import Client, Server, ServerThread


class Stalling:
    """A handler that answers its first ``silent`` requests too late for a 0.2 s client
    (a stalled peer), then at once."""

    def __init__(self, silent: int) -> None:
        self.silent, self.seen = silent, 0

    def __call__(self, msg, _peer: bytes) -> Ack:
        self.seen += 1
        if self.seen <= self.silent:
            time.sleep(0.3)
        return Ack(detail=f"try {self.seen}")


def test_a_request_is_retried_until_the_peer_answers() -> None:
    handler = Stalling(silent=2)
    server = Server("tcp://127.0.0.1:*", handler)
    client = Client(server.endpoint)
    with ServerThread(server, poll_s=0.01):
        reply = patient_request(client, Heartbeat(generator_id="g", version=0), 0.2,
                                patience_s=10.0, first_pause_s=0.05)
    client.close()
    assert isinstance(reply, Ack)
    # the first try answered in time: the third, or a later one if this machine was slow
    assert reply.detail.startswith("try ") and int(reply.detail[4:]) > handler.silent


def test_past_its_patience_it_raises_naming_the_peer_and_the_request() -> None:
    server = Server("tcp://127.0.0.1:*", Stalling(silent=10**6))
    client = Client(server.endpoint)
    began = time.monotonic()
    with ServerThread(server, poll_s=0.01), pytest.raises(PeerGone) as caught:
        patient_request(client, Heartbeat(generator_id="g", version=0), 0.2, patience_s=1.0,
                        first_pause_s=0.05)
    client.close()
    assert time.monotonic() - began < 10.0  # 1 s of patience, not 10 s of a stalled peer
    assert server.endpoint in str(caught.value) and "Heartbeat" in str(caught.value)


def test_a_stop_event_ends_the_waiting_early() -> None:
    server = Server("tcp://127.0.0.1:*", Stalling(silent=10**6))
    client = Client(server.endpoint)
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    began = time.monotonic()
    with ServerThread(server, poll_s=0.01), pytest.raises(PeerGone):
        patient_request(client, Heartbeat(generator_id="g", version=0), 0.2, patience_s=60.0,
                        stop=stop, first_pause_s=0.5)
    client.close()
    assert time.monotonic() - began < 5.0
