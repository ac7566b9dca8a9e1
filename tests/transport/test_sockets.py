"""relay.transport.sockets: timeouts are typed and name the peer, replies never cross requests,
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

from relay.transport.codec import encode
from relay.transport.endpoints import ipc_endpoint, is_loopback, tcp_endpoint, tcp_host
from relay.transport.messages import (
    Ack,
    ErrorReply,
    Heartbeat,
    HeartbeatAck,
    Message,
    Metrics,
    Shutdown,
    WeightBucket,
)
from relay.transport.sockets import (
    Client,
    PeerTimeout,
    Publisher,
    Puller,
    Pusher,
    RemoteError,
    Server,
    ServerThread,
    Subscriber,
)

LATE_S = 0.6  # how long the handler sits on the request that the client gives up on


def free_port() -> int:
    """A loopback port that nothing listens on right now."""
    with pysocket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def handler(msg: Message, peer: bytes) -> Any:
    if isinstance(msg, Heartbeat):
        if msg.generator_id == "slow":
            time.sleep(LATE_S)
        return echo(msg.version)
    if isinstance(msg, Shutdown):
        raise RuntimeError(f"cannot shut down: {msg.reason}")
    if isinstance(msg, Metrics):
        return None  # a handler that forgets to reply
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
    assert time.monotonic() - started < 5.0  # its 0.2 s, not a hang (slack for a busy machine)
    assert info.value.endpoint == endpoint
    assert endpoint in str(info.value) and "Heartbeat" in str(info.value)


def test_late_reply_is_not_taken_for_the_next_one(server: Server, client: Client) -> None:
    with pytest.raises(PeerTimeout):
        client.request(heartbeat(1, generator_id="slow"), timeout_s=0.1)
    time.sleep(LATE_S)  # the server answers the abandoned request meanwhile
    assert client.request(heartbeat(2), 5.0, Ack) == echo(2)
    assert client.stale_replies == 0  # the late reply went to the discarded socket


def test_a_second_reply_to_an_old_request_is_skipped() -> None:
    """A peer that answers the first request twice: the extra answer is not taken for the
    reply to the next request."""
    with zmq.Context.instance().socket(zmq.ROUTER) as twice:
        twice.linger = 0
        twice.bind("tcp://127.0.0.1:*")

        def answer() -> None:
            for version, times in ((1, 2), (2, 1)):
                identity, envelope, *_ = twice.recv_multipart()
                for _ in range(times):
                    twice.send_multipart([identity, envelope, *encode(echo(version))])

        answering = threading.Thread(target=answer)
        answering.start()
        client = Client(twice.getsockopt_string(zmq.LAST_ENDPOINT))
        try:
            assert client.request(heartbeat(1), 5.0, Ack) == echo(1)
            assert client.request(heartbeat(2), 5.0, Ack) == echo(2)
            assert client.stale_replies == 1
        finally:
            client.close()
            answering.join(5)


def test_handler_failures_are_answered_counted_logged_and_survived(
    server: Server, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(RemoteError) as info:
        client.request(Shutdown(reason="test"), 5.0, Ack)
    assert (info.value.code, "cannot shut down: test" in info.value.detail) == ("handler", True)
    assert client.request(Metrics(source="x", step=1, values={}), 5.0) == ErrorReply(
        code="handler", detail="TypeError: handler returned NoneType, not a Message"
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
    assert time.monotonic() - started < 5.0  # no send waited (slack for a busy machine)
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


def greeted(publisher: Publisher, subscribers: list[Subscriber]) -> None:
    """Publish until every subscription has arrived (ZeroMQ drops what is published to a
    subscriber before then), then drain the greetings."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        publisher.send(Ack(detail="hello"))
        if all(s.receive(0.05) is not None for s in subscribers):
            break
    for s in subscribers:
        while s.receive(0.1) is not None:
            pass


def test_publish_reaches_every_subscriber_and_returns_once_written() -> None:
    publisher = Publisher("tcp://127.0.0.1:*")
    subscribers = [Subscriber(publisher.endpoint) for _ in range(2)]
    try:
        greeted(publisher, subscribers)
        big = torch.arange(100_000, dtype=torch.float32)
        assert publisher.send(WeightBucket(version=1, index=0, names=["w"], starts=[0],
                                           tensors=[big]), wait_s=10.0)
        for s in subscribers:
            bucket = s.receive(10.0)
            assert isinstance(bucket, WeightBucket) and torch.equal(bucket.tensors[0], big)
    finally:
        for s in subscribers:
            s.close()
        publisher.close()


def test_a_subscriber_counts_garbage_and_keeps_receiving() -> None:
    with zmq.Context.instance().socket(zmq.PUB) as vandal:
        vandal.linger = 0
        vandal.bind("tcp://127.0.0.1:*")
        subscriber = Subscriber(vandal.getsockopt_string(zmq.LAST_ENDPOINT))
        try:
            deadline = time.monotonic() + 10
            while subscriber.errors["version"] == 0 and time.monotonic() < deadline:
                vandal.send_multipart([b"RLY\x09", b"junk"])
                assert subscriber.receive(0.05) is None  # rejected, counted, not returned
            vandal.send_multipart(encode(Ack(detail="fine")))
            assert subscriber.receive(5.0) == Ack(detail="fine")
        finally:
            subscriber.close()
    assert subscriber.errors["version"] >= 1 and subscriber.received == 1
