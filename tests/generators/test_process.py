"""relay.generators.process: the loop's settings come from the run's sections; its heartbeats
name the leases it holds, a lease whose reply was lost parks no prompt, and leases and
weight versions do not flood its log."""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import msgspec
import pytest

from relay.buffer.hub import Hub
from relay.configs.run_schema import BufferConfig, DataConfig, RolloutConfig
from relay.generators import process
from relay.generators.process import sampling_params
from relay.generators.sampling import SamplingParams
from relay.transport.messages import Heartbeat, LeaseRequest, Message, PromptLease
from relay.transport.sockets import Peer

from .test_attach import loop, make_hub, serve
from .test_attach import weights as weights  # noqa: F401 - the fixture


def test_sampling_params_come_from_the_rollout_section() -> None:
    rollout = RolloutConfig(temperature=0.7, top_p=0.9, top_k=20, response_length=64)
    assert sampling_params(rollout) == SamplingParams(max_new_tokens=64, temperature=0.7,
                                                      top_p=0.9, top_k=20)


NOBODY_LISTENS = "tcp://127.0.0.1:9"  # the discard port: no buffer answers there


def test_prompt_limits_and_waits_come_from_the_data_and_buffer_sections(weights: str) -> None:
    """``buffer.weights_timeout_s = 0`` waits for weights as long as a lease lives, and
    ``data.truncation = "error"`` keeps a longer prompt's end, as "left" does (the buffer
    measured it with another tokenizer)."""
    data = DataConfig(train_files=[], max_prompt_length=7, truncation="error")
    buffer = BufferConfig(lease_timeout_s=40.0, weights_timeout_s=0.0, client_patience_s=3.0)
    generator = loop(NOBODY_LISTENS, weights, data=data, buffer=buffer)
    assert (generator.max_prompt_length, generator.truncation_side) == (7, "left")
    assert (generator.weights_timeout_s, generator.patience_s) == (40.0, 3.0)
    assert generator.sender.patience_s == 3.0


# -- leases over real sockets: the heartbeats name them, a lost reply parks nothing ---------

LEASE_TIMEOUT_S = 2.5


def leasing_hub() -> Hub:
    """A hub whose leases expire after ``LEASE_TIMEOUT_S`` unless a heartbeat renews them."""
    hub = make_hub()
    hub.config = BufferConfig(lease_timeout_s=LEASE_TIMEOUT_S, heartbeat_timeout_s=30.0)
    hub.leases.timeout_s = LEASE_TIMEOUT_S
    hub.registry.heartbeat_timeout_s = 30.0
    return hub


class LosesOneLeaseReply:
    """The buffer's handler, but the reply to the first granted lease is sent too late: the
    generator's request timed out, and its retry (``patient_request``) is what it hears.
    ``honour_request_ids=False`` is a buffer that takes the retry for a new request; every
    heartbeat's named leases are kept, and leases expire as the buffer's timer would."""

    def __init__(self, hub: Hub, honour_request_ids: bool) -> None:
        self.hub, self.honour_request_ids = hub, honour_request_ids
        self.lost: PromptLease | None = None
        self.named: list[list[str]] = []

    def __call__(self, msg: Message, peer: Peer) -> Message:
        if isinstance(msg, Heartbeat) and msg.leases is not None:
            self.named.append(list(msg.leases))
        if isinstance(msg, LeaseRequest) and not self.honour_request_ids:
            msg = msgspec.structs.replace(msg, request_id="")
        reply = self.hub.handle(msg, peer)
        if isinstance(reply, PromptLease) and reply.prompts and self.lost is None:
            self.lost = reply
            time.sleep(REPLY_LATE_S)
        self.hub.tick()
        return reply


REQUEST_TIMEOUT_S = 0.3  # the generator's, here
REPLY_LATE_S = 0.6


@pytest.mark.parametrize("honour_request_ids", [True, False])
def test_a_lease_whose_reply_was_lost_parks_no_prompt_past_the_lease_timeout(
        weights: str, monkeypatch: pytest.MonkeyPatch, honour_request_ids: bool) -> None:
    """The retry of a lease request whose reply was lost gets the same lease; a buffer that
    grants a second one instead lets the first expire within the lease timeout, since the
    generator's heartbeats never name it, while the leases it holds stay renewed."""
    monkeypatch.setattr(process, "REQUEST_TIMEOUT_S", REQUEST_TIMEOUT_S)
    hub = leasing_hub()
    handler = LosesOneLeaseReply(hub, honour_request_ids)
    stop = threading.Event()
    with serve(handler) as endpoint:
        generator = loop(endpoint, weights)
        worker = threading.Thread(target=generator.run, args=(stop,))
        worker.start()
        try:
            time.sleep(REPLY_LATE_S + 2 * LEASE_TIMEOUT_S)  # renewed twice over
            held = set(generator.held_lease_ids())
            open_leases = {lid for lid, lease in hub.leases._leases.items()
                           if lease.generator_id == "gen0"}
            expired = hub.counts["prompts/expired"]
        finally:
            stop.set()
            worker.join(30.0)
    assert handler.lost is not None and not worker.is_alive()
    assert open_leases == held  # nothing parked with the buffer that the generator lacks
    assert handler.named and set(handler.named[-1]) == held
    if honour_request_ids:
        assert handler.lost.lease_id in held and expired == 0
    else:
        assert handler.lost.lease_id not in held
        assert expired == len(handler.lost.prompts)  # the lost lease's, and only those


def test_only_the_first_lease_and_the_first_weight_version_are_logged_at_info(
        weights: str, caplog: pytest.LogCaptureFixture) -> None:
    """A lease every few seconds and a version every step flooded the log (1,600 lease lines
    in one default run): the first of each says that leasing and the weight stream work,
    the rest go to DEBUG."""
    hub = make_hub()
    stop = threading.Event()
    with caplog.at_level(logging.DEBUG, logger="relay.generators.process"):
        with serve(hub.handle) as endpoint:
            generator = loop(endpoint, weights)
            worker = threading.Thread(target=generator.run, args=(stop,))
            worker.start()
            deadline = time.monotonic() + 10.0
            while hub.counts["leases/granted"] < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            stop.set()
            worker.join(30.0)
        for version in (1, 2, 3):
            generator._load(SimpleNamespace(version=version, tensors={}))
    leases = [r for r in caplog.records if r.getMessage().startswith("lease ")]
    assert len(leases) >= 2, caplog.text
    assert [r.levelno for r in leases] == [logging.INFO] + [logging.DEBUG] * (len(leases) - 1)
    assert leases[0].getMessage().endswith("; later leases are logged at DEBUG")
    versions = [r for r in caplog.records if "now generating with weights version" in
                r.getMessage()]
    assert [r.levelno for r in versions] == [logging.INFO, logging.DEBUG, logging.DEBUG]
