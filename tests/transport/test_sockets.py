"""transport.sockets: timeouts are typed and name the peer, replies never cross requests,
streams end where the server says, bad handlers and full queues do not hang or crash."""

from __future__ import annotations

import socket as pysocket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq

from transport.endpoints import ipc_endpoint, is_loopback, tcp_endpoint, tcp_host
from transport.messages import (
    Ack,
    ErrorReply,
    Heartbeat,
    HeartbeatAck,
    Message,
    Metrics,
    Shutdown,
    WeightBucket,
    WeightManifest,
    WeightRequest,
)
from transport.sockets import (
    Client,
    PeerTimeout,
    Puller,
    Pusher,
    RemoteError,
    Server,
    ServerThread,
)

LATE_S = 0.6  # how long the handler sits on the request that the client gives up on


def free_port() -> int:
    """A loopback port that nothing listens on right now."""
    with pysocket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def weights(version: int, num_buckets: int) -> Iterator[Message]:
    yield WeightManifest(version=version, num_buckets=num_buckets)
    for index in range(num_buckets):
        yield WeightBucket(
            version=version, index=index, names=["w"], tensors=[torch.full((3000,), float(index))]
        )


def handler(msg: Message, peer: bytes) -> Any:
    if isinstance(msg, Heartbeat):
        if msg.generator_id == "slow":
            time.sleep(LATE_S)
        return echo(msg.version)
    if isinstance(msg, WeightRequest):
        return weights(msg.have_version + 1, num_buckets=3)
    if isinstance(msg, Shutdown):
        raise RuntimeError(f"cannot shut down: {msg.reason}")
    if isinstance(msg, Metrics):
        return []  # a handler that forgets to reply
    return Ack(detail=type(msg).__name__)


@pytest.fixture
def server() -> Iterator[Server]:
    server = Server("tcp://127.0.0.1:*", handler)
    with ServerThread(server, poll_s=0.01):
        yield server


@pytest.fixture
def client(server: Server) -> Iterator[Client]:
    client = Client(server.endpoint)
    yield client
    client.close()


def heartbeat(version: int, generator_id: str = "gen-0") -> Heartbeat:
    return Heartbeat(generator_id=generator_id, version=version)


def echo(version: int) -> Ack:
    """The test server's answer to a heartbeat: its version echoed, so replies to different
    requests differ."""
    return Ack(detail=f"version {version}")


def test_no_server_raises_peer_timeout_naming_the_endpoint() -> None:
    endpoint = tcp_endpoint("127.0.0.1", free_port())
    client = Client(endpoint)
    started = time.monotonic()
    try:
        with pytest.raises(PeerTimeout) as info:
            client.request(heartbeat(1), timeout_s=0.2)
    finally:
        client.close()
    assert time.monotonic() - started < 2.0
    assert info.value.endpoint == endpoint
    assert endpoint in str(info.value) and "Heartbeat" in str(info.value)


def test_late_reply_is_not_taken_for_the_next_one(server: Server, client: Client) -> None:
    with pytest.raises(PeerTimeout):
        client.request(heartbeat(1, generator_id="slow"), timeout_s=0.1)
    time.sleep(LATE_S)  # the server answers the abandoned request meanwhile
    assert client.request(heartbeat(2), 5.0, Ack) == echo(2)
    assert client.stale_replies == 0  # the late reply went to the discarded socket


def test_replies_to_an_abandoned_stream_are_skipped(server: Server, client: Client) -> None:
    first = client.request(WeightRequest(generator_id="g", have_version=0), 5.0)
    assert first == WeightManifest(version=1, num_buckets=3)
    assert client.request(heartbeat(5), 5.0, Ack) == echo(5)
    assert client.stale_replies == 3


def test_stream_yields_manifest_then_every_bucket(server: Server, client: Client) -> None:
    replies = list(client.request_stream(WeightRequest(generator_id="g", have_version=4), 5.0))
    assert replies[0] == WeightManifest(version=5, num_buckets=3)
    assert [(r.version, r.index) for r in replies[1:]] == [(5, 0), (5, 1), (5, 2)]
    for index, bucket in enumerate(replies[1:]):
        assert torch.equal(bucket.tensors[0], torch.full((3000,), float(index)))
    assert client.request(heartbeat(6), 5.0, Ack) == echo(6)


def test_handler_failures_are_answered_counted_logged_and_survived(
    server: Server, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(RemoteError) as info:
        client.request(Shutdown(reason="test"), 5.0, Ack)
    assert (info.value.code, "cannot shut down: test" in info.value.detail) == ("handler", True)
    assert client.request(Metrics(source="x", step=1, values={}), 5.0) == ErrorReply(
        code="handler", detail="ValueError: handler returned no reply"
    )
    assert server.errors["handler"] == 2
    assert "handler failed on Shutdown" in caplog.text
    assert client.request(heartbeat(3), 5.0, Ack) == echo(3)


def test_unexpected_reply_type_raises_remote_error(server: Server, client: Client) -> None:
    with pytest.raises(RemoteError, match="expected HeartbeatAck, got Ack"):
        client.request(Ack(), 5.0, HeartbeatAck)


def test_serve_once_lets_the_owner_interleave_its_own_work() -> None:
    server = Server("tcp://127.0.0.1:*", handler)
    client = Client(server.endpoint)
    answered: list[Message] = []
    try:
        assert server.serve_once(0.01) is False  # nothing pending: back to the owner at once
        asker = threading.Thread(target=lambda: answered.append(client.request(heartbeat(4), 5.0)))
        asker.start()
        while not server.serve_once(0.05):
            pass
        asker.join(5.0)
    finally:
        client.close()
        server.close()
    assert answered == [echo(4)]


def test_push_pull_delivers_in_order_and_counts_garbage() -> None:
    puller = Puller("tcp://127.0.0.1:*")
    pusher = Pusher(puller.endpoint)
    with zmq.Context.instance().socket(zmq.PUSH) as vandal:
        vandal.linger = 0
        vandal.connect(puller.endpoint)
        try:
            vandal.send_multipart([b"RLY\x09", b"junk"])
            assert puller.receive(0.5) is None  # rejected, counted, not returned
            for step in range(20):
                assert pusher.send(Metrics(source="learner", step=step, values={"loss": 0.5}))
            received = [puller.receive(5.0) for _ in range(20)]
        finally:
            pusher.close()
            puller.close()
    assert [m.step for m in received] == list(range(20))
    assert puller.errors == {"version": 1}
    assert puller.received == 20


def test_push_to_nobody_drops_instead_of_blocking() -> None:
    pusher = Pusher(tcp_endpoint("127.0.0.1", free_port()), hwm=5)
    started = time.monotonic()
    try:
        results = [pusher.send(Metrics(source="x", step=i, values={})) for i in range(100)]
    finally:
        pusher.close(linger_s=0)
    assert time.monotonic() - started < 1.0
    assert results.count(False) == pusher.dropped > 0
    assert pusher.sent + pusher.dropped == 100


def test_ipc_endpoints_work(tmp_path: Any) -> None:
    server = Server(ipc_endpoint(tmp_path / "hub.sock"), handler)
    with ServerThread(server, poll_s=0.01):
        client = Client(server.endpoint)
        try:
            assert client.request(heartbeat(8), 5.0, Ack) == echo(8)
        finally:
            client.close()


def test_endpoint_helpers() -> None:
    assert tcp_endpoint("127.0.0.1", 5555) == "tcp://127.0.0.1:5555"
    assert tcp_endpoint("::1") == "tcp://[::1]:*"
    assert tcp_host("tcp://[::1]:5555") == "::1"
    assert [is_loopback(h) for h in ("127.0.0.1", "127.255.0.9", "::1", "localhost", "[::1]")] == [
        True
    ] * 5
    assert [is_loopback(h) for h in ("0.0.0.0", "*", "10.1.2.3", "::", "eth0", "example.org")] == [
        False
    ] * 6
    with pytest.raises(ValueError, match="transport://address"):
        tcp_host("127.0.0.1:5555")


def ipv6_loopback_available() -> bool:
    try:
        with pysocket.socket(pysocket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not ipv6_loopback_available(), reason="no IPv6 loopback on this machine")
def test_ipv6_loopback_endpoints_work() -> None:
    server = Server(tcp_endpoint("::1"), handler)
    with ServerThread(server, poll_s=0.01):
        client = Client(server.endpoint)
        try:
            assert client.request(heartbeat(9), 5.0, Ack) == echo(9)
        finally:
            client.close()
