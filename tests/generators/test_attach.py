"""A generator's membership at a real hub over real sockets: a name held by a live process
(``GeneratorLoop._attach``) and leaving (``GeneratorLoop.run`` stopped).

A generator restarted under its name before the buffer noticed its old process die waits
until the buffer declares that process silent, then attaches, unless both are of one
lineage (the launcher's ``--lineage``): then it attaches at once; a name
whose holder keeps talking stops the generator with ``NameInUse``. A generator that is
stopped returns its leases and detaches.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import pytest
import torch

from relay.buffer.hub import Hub
from relay.buffer.prompt_source import PromptSource
from relay.buffer.store import FifoStore
from relay.buffer.validation import GroupLimits
from relay.configs.prompt_data import ChatMessage, PromptDataset, PromptRow, RewardSpec
from relay.configs.run_schema import BufferConfig, DataConfig, OverlongBufferConfig, RolloutConfig
from relay.generators.engine import Completion, Engine, FinishedGroup, StepHook
from relay.generators.process import GeneratorLoop, NameInUse
from relay.generators.sampling import SamplingParams
from relay.transport.messages import Attach, Heartbeat, Message, WeightManifest
from relay.transport.sockets import Peer, Server, ServerThread

HEARTBEAT_TIMEOUT_S = 0.5  # the hub's; a dead holder's name is free after this and a second


class EndlessEngine(Engine):
    """An engine whose groups never finish: every lease stays in flight until the loop
    stops."""

    name = "endless"

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 between_steps: StepHook | None = None) -> list[Completion]:
        raise AssertionError("step never generates")

    def reseed(self, seed: int) -> None:
        pass

    def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        self.version = version

    def step(self, between_steps: StepHook | None = None) -> list[FinishedGroup]:
        time.sleep(0.01)
        return []


class FixedTokenizer:
    def apply_chat_template(self, messages, **_kwargs) -> list[int]:
        return [1, 2, 3]


def make_hub() -> Hub:
    rows = [PromptRow(prompt=(ChatMessage(role="user", content=f"What is {i} + 1?"),),
                      data_source="relay/arithmetic",
                      reward_model=RewardSpec(style="rule", ground_truth=str(i + 1)))
            for i in range(32)]
    return Hub(BufferConfig(heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S),
               PromptSource(PromptDataset(rows), seed=0), FifoStore(), batch_size=4,
               limits=GroupLimits(n=2, vocab_size=32, response_length=8), prompts_per_lease=2,
               total_steps=10)


@contextmanager
def serve(handler) -> Iterator[str]:
    server = Server("tcp://127.0.0.1:*", handler)
    with ServerThread(server, poll_s=0.01):
        yield server.endpoint


@pytest.fixture
def hub() -> Hub:
    return make_hub()


@pytest.fixture
def weights() -> Iterator[str]:
    """A learner's weight server that has nothing newer than version 0."""
    with serve(lambda _msg, _peer: WeightManifest(version=0)) as endpoint:
        yield endpoint


NOBODY_STREAMS = "tcp://127.0.0.1:9"  # the discard port: no weight stream listens there


def loop(buffer_endpoint: str, weights_endpoint: str, data: DataConfig | None = None,
         buffer: BufferConfig | None = None, lineage: str = "") -> GeneratorLoop:
    return GeneratorLoop(generator_id="gen0", buffer_endpoint=buffer_endpoint,
                         weights_endpoint=weights_endpoint,
                         weights_stream_endpoint=NOBODY_STREAMS, engine=EndlessEngine(),
                         tokenizer=FixedTokenizer(), scorer=None,
                         rollout=RolloutConfig(n=2, prompts_per_lease=2, max_num_seqs=8),
                         data=data or DataConfig(train_files=[], max_prompt_length=16),
                         buffer=buffer or BufferConfig(client_patience_s=5.0,
                                                       weights_timeout_s=60.0),
                         overlong=OverlongBufferConfig(), lineage=lineage)


def old_process(hub: Hub, host: str = "elsewhere", pid: int = 1, lineage: str = "") -> None:
    """``gen0`` attached from another process, which may then die or keep talking."""
    hub.handle(Attach(generator_id="gen0", engine="lean", device="cpu", host=host, pid=pid,
                      lineage=lineage))


def talking(hub: Hub):
    """A handler for ``hub`` before which ``gen0``'s old process heartbeats: never silent."""

    def holder_alive(msg: Message, peer: Peer) -> Message:
        hub.handle(Heartbeat(generator_id="gen0", version=0))  # the old process's heartbeat
        return hub.handle(msg, peer)

    return holder_alive


def test_a_generator_restarted_in_place_of_its_dead_process_attaches_at_once(
        hub: Hub, weights: str) -> None:
    old_process(hub, pid=4242, lineage="feed0001")  # its last heartbeat just now, elsewhere
    with serve(talking(hub)) as endpoint:
        began = time.monotonic()
        assert loop(endpoint, weights, lineage="feed0001")._attach()
    assert time.monotonic() - began < HEARTBEAT_TIMEOUT_S  # no wait for it to fall silent
    assert hub.registry.generators["gen0"].pid == os.getpid()
    assert hub.counts["generators/replaced"] == 1 and hub.counts["rejected/name_in_use"] == 0


def test_another_lineage_than_the_holders_takes_nothing(hub: Hub, weights: str) -> None:
    old_process(hub, pid=4242, lineage="feed0001")
    with serve(talking(hub)) as endpoint:
        with pytest.raises(NameInUse, match=r"of another lineage than this process's"):
            loop(endpoint, weights, lineage="feed0002")._attach()
    assert hub.registry.generators["gen0"].pid == 4242
    assert hub.counts["generators/replaced"] == 0


def test_a_restarted_generator_attaches_once_its_old_process_falls_silent(
        hub: Hub, weights: str, caplog: pytest.LogCaptureFixture) -> None:
    old_process(hub)  # ... which dies
    with caplog.at_level(logging.INFO):
        with serve(hub.handle) as endpoint:
            began = time.monotonic()
            assert loop(endpoint, weights)._attach()
    assert HEARTBEAT_TIMEOUT_S < time.monotonic() - began < HEARTBEAT_TIMEOUT_S + 3.0
    assert hub.registry.generators["gen0"].pid == os.getpid()
    assert hub.counts["rejected/name_in_use"] == 1
    assert "not attached yet: the name 'gen0' belongs to a live generator (pid 1 on " \
           "elsewhere" in caplog.text


def test_a_name_whose_holder_keeps_talking_is_given_up_with_name_in_use(
        hub: Hub, weights: str) -> None:
    old_process(hub)
    with serve(talking(hub)) as endpoint:
        began = time.monotonic()
        with pytest.raises(NameInUse, match="the name 'gen0' belongs to a live generator "
                                            r"\(pid 1 on elsewhere"):
            loop(endpoint, weights)._attach()
    assert time.monotonic() - began < HEARTBEAT_TIMEOUT_S + 3.0  # one wait, then no more
    assert hub.counts["rejected/name_in_use"] == 2
    assert hub.registry.generators["gen0"].pid == 1  # never taken over


def test_a_stopped_generator_returns_its_leases_and_detaches(
        hub: Hub, weights: str, caplog: pytest.LogCaptureFixture) -> None:
    stop = threading.Event()
    with caplog.at_level(logging.INFO):
        with serve(hub.handle) as endpoint:
            generator = loop(endpoint, weights)
            worker = threading.Thread(target=generator.run, args=(stop,))
            worker.start()
            deadline = time.monotonic() + 10.0
            while hub.leases.running == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            stop.set()
            worker.join(30.0)
    assert not worker.is_alive()
    leased = hub.counts["prompts/leased"]
    assert leased > 0 and hub.counts["prompts/returned"] == leased
    assert hub.leases.running == 0 and "gen0" not in hub.registry.generators
    assert "generator gen0 returned 2 prompts of lease" in caplog.text
    assert "the generator is stopping" in caplog.text
    assert "generator gen0 detached (stopping)" in caplog.text
    assert hub.accounting_problems() == []
