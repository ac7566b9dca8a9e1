"""Roles at the hub, over real sockets: only the learner may ask for batches, report
versions, ask for checkpoints and end the run; only generators may attach, lease, return
and send rollouts. A refused request is answered ``forbidden``, counted, and changes
nothing. Under CURVE the key decides: a generator key never acts as the learner, and a peer
without a key is never heard."""

from __future__ import annotations

import runpy
from collections.abc import Iterator
from pathlib import Path

import pytest

from relay.buffer.hub import SENDERS, Hub
from relay.transport.messages import (
    Ack,
    Attach,
    AttachAck,
    BufferCheckpointRequest,
    ErrorReply,
    Heartbeat,
    LeaseRequest,
    LeaseReturn,
    Message,
    PromptLease,
    RolloutAck,
    SampleBatch,
    SampleRequest,
    Shutdown,
    VersionUpdate,
)
from relay.transport.security import ClientKeys, ServerKeys, load_keypair, load_public_key
from relay.transport.sockets import Client, PeerTimeout, Server, ServerThread

from .conftest import make_group

ROOT = Path(__file__).resolve().parents[2]
MAKE_KEYS = ROOT / "tools" / "make-curve-keys.py"
TIMEOUT_S = 5.0
REFUSED_S = 0.5

LEARNER_ONLY: list[Message] = [SampleRequest(num_groups=1), VersionUpdate(version=10**12,
                                                                          step=10**12),
                               BufferCheckpointRequest(step=1), Shutdown(reason="hostile")]


def ask(client: Client, msg: Message) -> Message:
    return client.request(msg, TIMEOUT_S)


def forbidden(reply: Message) -> bool:
    return isinstance(reply, ErrorReply) and reply.code == "forbidden"


def unchanged(hub: Hub) -> None:
    """Nothing a refused learner message could do has happened."""
    assert not hub.finished and hub.learner_version == 0 and hub.counts["groups/served"] == 0


def test_every_request_names_the_role_that_may_send_it(make_hub) -> None:
    assert set(SENDERS) == set(make_hub()._handlers)


@pytest.fixture
def served(make_hub) -> Iterator[tuple[Hub, Server]]:
    hub = make_hub(batch_size=2, per_lease=2)
    server = Server("tcp://127.0.0.1:*", hub.handle)
    with ServerThread(server, poll_s=0.01):
        yield hub, server


def test_a_generator_connection_cannot_act_as_the_learner(served) -> None:
    hub, server = served
    generator = Client(server.endpoint)
    try:
        assert isinstance(ask(generator, Attach(generator_id="g0", engine="t", device="cpu")),
                          AttachAck)
        granted = ask(generator, LeaseRequest(generator_id="g0", max_prompts=2))
        assert isinstance(granted, PromptLease) and len(granted.prompts) == 2
        refusals = [ask(generator, msg) for msg in LEARNER_ONLY]
        assert all(forbidden(r) for r in refusals), refusals
        assert "acts as the generator" in refusals[0].detail
        reply = ask(generator, make_group(granted.lease_id, granted.prompts[0], 2))
        assert isinstance(reply, RolloutAck) and reply.accepted  # still a generator
    finally:
        generator.close()
    assert hub.counts["rejected/forbidden"] == len(LEARNER_ONLY)
    unchanged(hub)
    assert hub.accounting_problems() == []


def test_the_learner_connection_cannot_act_as_a_generator(served) -> None:
    hub, server = served
    learner = Client(server.endpoint)
    try:
        assert isinstance(ask(learner, SampleRequest(num_groups=2)), SampleBatch)
        refusals = [ask(learner, msg) for msg in (
            Attach(generator_id="g9", engine="t", device="cpu"),
            LeaseRequest(generator_id="g0", max_prompts=2),
            Heartbeat(generator_id="g0", version=0),
            LeaseReturn(generator_id="g0", lease_id="L1", prompt_ids=["e0-1"]))]
        assert all(forbidden(r) for r in refusals), refusals
        assert isinstance(ask(learner, VersionUpdate(version=1, step=1)), Ack)
    finally:
        learner.close()
    assert hub.counts["rejected/forbidden"] == 4
    assert "g9" not in hub.registry.generators and hub.counts["prompts/leased"] == 0


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    keys = tmp_path / "keys"
    assert runpy.run_path(str(MAKE_KEYS))["main"]([str(keys)]) == 0
    return keys


def client_keys(folder: Path) -> ClientKeys:
    return ClientKeys(keypair=load_keypair(folder / "client.key_secret"),
                      server_public_key=load_public_key(folder / "server.key"))


@pytest.fixture
def curve_served(make_hub, keys: Path) -> Iterator[tuple[Hub, Server]]:
    hub = make_hub(batch_size=2, per_lease=2)
    control = keys / "control"
    server_keys = ServerKeys(keypair=load_keypair(control / "server.key_secret"),
                             authorized_clients=control / "authorized")
    server = Server("tcp://127.0.0.1:*", hub.handle, keys=server_keys)
    with ServerThread(server, poll_s=0.01):
        yield hub, server


@pytest.mark.parametrize("hostile", LEARNER_ONLY, ids=lambda m: type(m).__name__)
def test_a_generator_key_never_acts_as_the_learner(curve_served, keys: Path,
                                                   hostile: Message) -> None:
    hub, server = curve_served
    intruder = Client(server.endpoint, keys=client_keys(keys / "generator"))
    try:
        reply = ask(intruder, hostile)  # its first message: it declares itself the learner
        assert forbidden(reply) and "key 'generator' may act as generator" in reply.detail
        attached = ask(intruder, Attach(generator_id="g7", engine="t", device="cpu"))
        assert isinstance(attached, AttachAck) and attached.accepted  # what the key may do
    finally:
        intruder.close()
    assert hub.counts["rejected/forbidden"] == 1
    unchanged(hub)


def test_the_learner_key_drives_the_run_and_a_peer_without_keys_is_never_heard(
        curve_served, keys: Path) -> None:
    hub, server = curve_served
    learner = Client(server.endpoint, keys=client_keys(keys / "control"))
    stranger = Client(server.endpoint)
    try:
        with pytest.raises(PeerTimeout):
            stranger.request(Shutdown(reason="hostile"), REFUSED_S)
        assert isinstance(ask(learner, VersionUpdate(version=1, step=1)), Ack)
        assert isinstance(ask(learner, SampleRequest(num_groups=2)), SampleBatch)
        assert isinstance(ask(learner, Shutdown(reason="done")), Ack)
    finally:
        learner.close()
        stranger.close()
    assert hub.finished and hub.learner_version == 1 and hub.counts["rejected/forbidden"] == 0
