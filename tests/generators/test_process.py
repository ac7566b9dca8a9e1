"""generators.process: the loop's settings come from the run's sections, and the buffer's
verdict on each group is counted and logged by its name."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from configs.run_schema import OverlongBufferConfig, RolloutConfig
from generators.process import GeneratorLoop, sampling_params
from generators.sampling import SamplingParams
from transport.messages import ErrorReply, Message, RolloutAck, RolloutGroup, Sample
from transport.sockets import Server, ServerThread

VERDICTS = {"r-ok": "accepted", "r-stale": "stale", "r-dup": "duplicate"}


def buffer(msg: Message, _identity: bytes) -> Message:
    """A buffer that judges each group by its rollout id."""
    assert isinstance(msg, RolloutGroup)
    if msg.rollout_id not in VERDICTS:
        return ErrorReply(code="unexpected", detail="no verdict for it")
    verdict = VERDICTS[msg.rollout_id]
    return RolloutAck(rollout_id=msg.rollout_id, verdict=verdict,
                      detail="" if verdict == "accepted" else f"{verdict} detail")


@pytest.fixture
def loop() -> Iterator[GeneratorLoop]:
    server = Server("tcp://127.0.0.1:*", buffer)
    with ServerThread(server, poll_s=0.01):
        loop = GeneratorLoop(generator_id="g0", buffer_endpoint=server.endpoint,
                             weights_endpoint="tcp://127.0.0.1:1", engine=None, tokenizer=None,
                             scorer=None, rollout=RolloutConfig(n=1), max_prompt_length=16,
                             overlong=OverlongBufferConfig())
        yield loop
        loop._buffer.close()


def group(rollout_id: str) -> RolloutGroup:
    sample = Sample(prompt_ids=torch.tensor([1], dtype=torch.int32),
                    response_ids=torch.tensor([2], dtype=torch.int32),
                    logprobs=torch.zeros(1), versions=torch.zeros(1, dtype=torch.int32),
                    reward=1.0)
    return RolloutGroup(rollout_id=rollout_id, lease_id="l", prompt_id="p", generator_id="g0",
                        samples=[sample])


def test_sampling_params_come_from_the_rollout_section() -> None:
    rollout = RolloutConfig(temperature=0.7, top_p=0.9, top_k=20, response_length=64)
    assert sampling_params(rollout) == SamplingParams(max_new_tokens=64, temperature=0.7,
                                                      top_p=0.9, top_k=20)


def test_each_verdict_is_counted_and_refusals_are_logged_by_name(
        loop: GeneratorLoop, caplog: pytest.LogCaptureFixture) -> None:
    for rollout_id in ("r-ok", "r-stale", "r-dup", "r-other"):
        loop._send(group(rollout_id))
    assert (loop.counters.groups_sent, loop.counters.groups_rejected) == (1, 3)
    assert "buffer refused r-stale: stale stale detail" in caplog.text
    assert "buffer refused r-dup: duplicate duplicate detail" in caplog.text
    assert "buffer refused r-other: ErrorReply(code='unexpected'" in caplog.text
    assert "r-ok" not in caplog.text
