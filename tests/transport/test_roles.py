"""relay.transport.roles and per-role CURVE keys: a connection keeps the role of its first
message; a generator key never acts as the learner, nor an evaluator or generator key as
any other role; the server (and a bound puller, for each message) learns each peer's key
name from ZAP; tools/make-curve-keys.py gives generator and evaluator hosts no secret but
their own."""

from __future__ import annotations

import logging
import runpy
from collections.abc import Iterator
from pathlib import Path

import pytest

from relay.transport.endpoints import ipc_endpoint
from relay.transport.messages import Ack, Heartbeat, Message, Metrics
from relay.transport.roles import PeerRoles, key_roles
from relay.transport.security import ClientKeys, ServerKeys, load_keypair, load_public_key
from relay.transport.sockets import Client, Peer, PeerTimeout, Puller, Pusher, Server, ServerThread

ROOT = Path(__file__).resolve().parents[2]
MAKE_KEYS = ROOT / "tools" / "make-curve-keys.py"
REFUSED_S = 0.5


def test_a_connection_keeps_the_role_of_its_first_message() -> None:
    roles = PeerRoles()
    learner, generator = Peer(b"L"), Peer(b"G")
    assert roles.admit(learner, "learner") == ""
    assert roles.admit(generator, "generator") == ""
    assert roles.admit(learner, "learner") == ""
    refusal = roles.admit(generator, "learner")
    assert "acts as the generator" in refusal and "cannot send learner" in refusal
    assert "acts as the learner" in roles.admit(learner, "generator")


def test_keys_bound_the_roles_a_connection_may_take(caplog: pytest.LogCaptureFixture) -> None:
    roles = PeerRoles()
    assert "may act as generator, not as the learner" in \
        roles.admit(Peer(b"a", key="generator"), "learner")
    assert roles.admit(Peer(b"a", key="generator"), "generator") == ""  # refusal bound nothing
    assert roles.admit(Peer(b"b", key="generator-7"), "generator") == ""
    assert roles.admit(Peer(b"c", key="learner"), "learner") == ""
    assert roles.admit(Peer(b"d", key="learner"), "generator") == ""  # a one-machine run
    with caplog.at_level(logging.WARNING, logger="relay.transport.roles"):
        assert roles.admit(Peer(b"e", key="client"), "learner") == ""  # keys made before roles
        assert roles.admit(Peer(b"f", key="client"), "generator") == ""
    assert [r.getMessage() for r in caplog.records if "names no role" in r.getMessage()] != []
    assert len(caplog.records) == 1  # warned once per key name
    assert key_roles("generator") == frozenset({"generator"}) and key_roles("client") is None


@pytest.mark.parametrize("key, allowed", [
    ("learner", {"learner", "generator", "evaluator", "buffer"}),  # the control hosts' key
    ("generator", {"generator"}),
    ("evaluator-2", {"evaluator"}),
    ("", {"learner", "generator", "evaluator", "buffer"}),  # no CURVE: a local socket
])
def test_only_the_evaluator_and_control_keys_steer_evaluation_and_metrics(
        key: str, allowed: set[str]) -> None:
    roles = PeerRoles()
    for role in ("learner", "generator", "evaluator", "buffer"):
        refusal = roles.may_act_as(key, role)
        assert (refusal == "") == (role in allowed), (key, role, refusal)
        assert (roles.admit(Peer(role.encode(), key=key), role) == "") == (role in allowed)
    assert "not as the x" in roles.may_act_as(key, "x")  # a metrics source that is no role


def test_forgotten_connections_are_the_least_recently_used() -> None:
    roles = PeerRoles(max_connections=2)
    for identity in (b"1", b"2"):
        roles.admit(Peer(identity), "generator")
    roles.admit(Peer(b"1"), "generator")  # 2 is now the longest unused
    roles.admit(Peer(b"3"), "generator")
    assert roles.admit(Peer(b"1"), "learner") != ""
    assert roles.admit(Peer(b"2"), "learner") == ""  # forgotten: it may bind afresh


def key_name(msg: Message, peer: Peer) -> Message:
    return Ack(detail=peer.key)


@pytest.fixture
def keys_dir(tmp_path: Path) -> Path:
    keys = tmp_path / "keys"
    assert runpy.run_path(str(MAKE_KEYS))["main"]([str(keys)]) == 0
    return keys


def server_keys(folder: Path) -> ServerKeys:
    return ServerKeys(keypair=load_keypair(folder / "server.key_secret"),
                      authorized_clients=folder / "authorized")


def client_keys(folder: Path) -> ClientKeys:
    """The keys a process on a host with ``folder`` as its keys_dir connects with (the
    layout relay.configs.rundir reads)."""
    return ClientKeys(keypair=load_keypair(folder / "client.key_secret"),
                      server_public_key=load_public_key(folder / "server.key"))


def test_generator_hosts_get_no_secret_but_their_own(keys_dir: Path) -> None:
    control = keys_dir / "control"
    assert sorted(p.name for p in (control / "authorized").iterdir()) == \
        ["evaluator.key", "generator.key", "learner.key"]
    for host in ("generator", "evaluator"):
        assert sorted(p.name for p in (keys_dir / host).iterdir()) == \
            ["client.key", "client.key_secret", "server.key"]
        assert load_public_key(control / "authorized" / f"{host}.key") == \
            load_keypair(keys_dir / host / "client.key_secret").public
        assert load_public_key(keys_dir / host / "server.key") == \
            load_keypair(control / "server.key_secret").public
    assert load_keypair(keys_dir / "generator" / "client.key_secret").public != \
        load_keypair(keys_dir / "evaluator" / "client.key_secret").public
    assert load_public_key(control / "authorized" / "learner.key") == \
        load_keypair(control / "client.key_secret").public
    assert runpy.run_path(str(MAKE_KEYS))["main"]([str(keys_dir)]) == 1  # never overwrites


@pytest.fixture
def curve_server(keys_dir: Path) -> Iterator[Server]:
    server = Server("tcp://127.0.0.1:*", key_name, keys=server_keys(keys_dir / "control"))
    with ServerThread(server, poll_s=0.01):
        yield server


@pytest.mark.parametrize("host, name", [("control", "learner"), ("generator", "generator"),
                                        ("evaluator", "evaluator")])
def test_the_server_hears_which_key_each_peer_holds(curve_server: Server, keys_dir: Path,
                                                    host: str, name: str) -> None:
    client = Client(curve_server.endpoint, keys=client_keys(keys_dir / host))
    try:
        reply = client.request(Heartbeat(generator_id="g", version=0), 5.0, Ack)
        assert reply.detail == name
    finally:
        client.close()


def test_a_bound_puller_hears_which_key_each_message_came_with(keys_dir: Path,
                                                              tmp_path: Path) -> None:
    """The metrics address is a PULL socket: no connections to bind a role to, so the
    launcher judges each message by the key it came with."""
    puller = Puller(ipc_endpoint(tmp_path / "metrics"), keys=server_keys(keys_dir / "control"))
    pushers = [Pusher(puller.endpoint, keys=client_keys(keys_dir / host))
               for host in ("generator", "control")]
    try:
        heard = []
        for pusher, step in zip(pushers, (1, 2)):
            pusher.send(Metrics(source="learner", step=step, values={}))
            received = puller.receive_from(5.0)
            assert received is not None
            heard.append((received.key, received.message.step))
        assert heard == [("generator", 1), ("learner", 2)]
    finally:
        for pusher in pushers:
            pusher.close(linger_s=0.0)
        puller.close()
    plain = Puller(ipc_endpoint(tmp_path / "plain"))
    pusher = Pusher(plain.endpoint)
    try:
        pusher.send(Metrics(source="buffer", step=0, values={}))
        received = plain.receive_from(5.0)
        assert received is not None and received.key == ""
    finally:
        pusher.close(linger_s=0.0)
        plain.close()


def test_a_peer_without_a_key_is_refused(curve_server: Server) -> None:
    client = Client(curve_server.endpoint)
    try:
        with pytest.raises(PeerTimeout):
            client.request(Heartbeat(generator_id="g", version=0), REFUSED_S)
        assert curve_server.served == 0
    finally:
        client.close()


def test_without_curve_peers_have_no_key_and_one_identity_per_connection() -> None:
    seen: list[Peer] = []

    def remember(msg: Message, peer: Peer) -> Message:
        seen.append(peer)
        return Ack()

    server = Server("tcp://127.0.0.1:*", remember)
    with ServerThread(server, poll_s=0.01):
        clients = [Client(server.endpoint), Client(server.endpoint)]
        try:
            for client in clients + clients:
                client.request(Heartbeat(generator_id="g", version=0), 5.0, Ack)
        finally:
            for client in clients:
                client.close()
    assert all(peer.key == "" for peer in seen)
    assert seen[0].identity == seen[2].identity != seen[1].identity == seen[3].identity


def test_a_frame_over_the_limit_drops_its_sender_and_is_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    server = Server("tcp://127.0.0.1:*", key_name, max_message_bytes=1024)
    with caplog.at_level(logging.DEBUG, logger="relay.transport.sockets"), \
            ServerThread(server, poll_s=0.01):
        big, small = Client(server.endpoint), Client(server.endpoint)
        try:
            with pytest.raises(PeerTimeout, match="max_message_bytes"):
                big.request(Heartbeat(generator_id="g" * 4096, version=0), REFUSED_S)
            assert small.request(Heartbeat(generator_id="g", version=0), 5.0, Ack) == Ack()
        finally:
            big.close()
            small.close()
    assert server.served == 1
    dropped = [r for r in caplog.records if "1024-byte limit" in r.getMessage()]
    assert dropped and "max_message_bytes" in dropped[0].getMessage()
    # a peer closing its socket at an orderly shutdown is the same event: not above DEBUG
    assert {r.levelno for r in dropped} == {logging.DEBUG}
