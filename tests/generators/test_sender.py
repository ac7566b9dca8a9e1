"""relay.generators.sender: the buffer's verdict on each group is counted and logged by its name;
a failure in the sender's thread reaches the compute loop; a reward model scores each group
once, combined with the rule reward."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from relay.algorithms.rewards.result import RewardResult
from relay.configs.run_schema import OverlongBufferConfig, RewardModelConfig
from relay.generators.engine import Completion
from relay.generators.sender import Counters, FinishedPrompt, GroupSender
from relay.transport.messages import ErrorReply, Message, Prompt, RolloutAck, RolloutGroup, Sample
from relay.transport.sockets import Client, Server, ServerThread

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
def endpoint() -> Iterator[str]:
    server = Server("tcp://127.0.0.1:*", buffer)
    with ServerThread(server, poll_s=0.01):
        yield server.endpoint


def sender(endpoint: str, scorer=None) -> GroupSender:
    return GroupSender(generator_id="g0", buffer_endpoint=endpoint, scorer=scorer,
                       counters=Counters(), max_new_tokens=4, overlong=OverlongBufferConfig(),
                       patience_s=5.0)


def group(rollout_id: str) -> RolloutGroup:
    sample = Sample(prompt_ids=torch.tensor([1], dtype=torch.int32),
                    response_ids=torch.tensor([2], dtype=torch.int32),
                    logprobs=torch.zeros(1), versions=torch.zeros(1, dtype=torch.int32),
                    reward=1.0)
    return RolloutGroup(rollout_id=rollout_id, lease_id="l", prompt_id="p", generator_id="g0",
                        samples=[sample])


def test_each_verdict_is_counted_and_refusals_are_logged_by_name(
        endpoint: str, caplog: pytest.LogCaptureFixture) -> None:
    one = sender(endpoint)
    client = Client(endpoint)
    for rollout_id in ("r-ok", "r-stale", "r-dup", "r-other"):
        one.send(client, group(rollout_id))
    client.close()
    assert (one.counters.groups_sent, one.counters.groups_rejected) == (1, 3)
    assert "buffer refused r-stale: stale stale detail" in caplog.text
    assert "buffer refused r-dup: duplicate duplicate detail" in caplog.text
    assert "buffer refused r-other: ErrorReply(code='unexpected'" in caplog.text
    assert "r-ok" not in caplog.text


class BrokenScorer:
    def score(self, items):
        raise OSError("the reward worker is gone")


def test_a_failure_in_the_thread_is_raised_in_the_compute_loop(endpoint: str) -> None:
    one = sender(endpoint, scorer=BrokenScorer()).start()
    completion = Completion(token_ids=torch.tensor([5], dtype=torch.int32),
                            logprobs=torch.zeros(1), versions=torch.zeros(1, dtype=torch.int32),
                            finish_reason="length")
    prompt = Prompt(prompt_id="p", messages=[], data_source="arithmetic")
    one.put(FinishedPrompt(rollout_id="r-ok", lease_id="l", prompt=prompt, prompt_ids=[1],
                           completions=[completion], texts=["x"]))
    one.stop()
    with pytest.raises(RuntimeError, match="scoring or sending a group failed") as caught:
        one.raise_if_failed()
    assert "the reward worker is gone" in str(caught.value.__cause__)


class FixedRules:
    def score(self, items):
        return [RewardResult(score=1.0 if item.solution_str == "7" else 0.0) for item in items]


class StubRewardModel:
    """Scores a response by its length; records each call's prompt ids and responses."""

    def __init__(self, combine: str) -> None:
        self.config = RewardModelConfig(combine=combine)
        self.calls: list[tuple[list[int], list[list[int]]]] = []

    def score(self, messages, prompt_ids, responses, texts):
        self.calls.append((list(prompt_ids), [list(r) for r in responses]))
        return [0.5 * len(r) for r in responses]


@pytest.mark.parametrize("combine, rewards", [("replace", [0.5, 1.0]), ("add", [1.5, 1.0])])
def test_a_reward_model_scores_each_group_once_beside_the_rule(
        endpoint: str, combine: str, rewards: list[float]) -> None:
    rm = StubRewardModel(combine)
    one = GroupSender(generator_id="g0", buffer_endpoint=endpoint, scorer=FixedRules(),
                      counters=Counters(), max_new_tokens=4, overlong=OverlongBufferConfig(),
                      patience_s=5.0, reward_model=rm)
    completions = [Completion(token_ids=torch.tensor(ids, dtype=torch.int32),
                              logprobs=torch.zeros(len(ids)),
                              versions=torch.zeros(len(ids), dtype=torch.int32),
                              finish_reason="stop") for ids in ([5], [6, 7])]
    prompt = Prompt(prompt_id="p", messages=[{"role": "user", "content": "3+4"}],
                    data_source="arithmetic")
    built = one.build(FinishedPrompt(rollout_id="r", lease_id="l", prompt=prompt,
                                     prompt_ids=[1, 2], completions=completions,
                                     texts=["7", "8"]))
    assert rm.calls == [([1, 2], [[5], [6, 7]])]
    assert [s.reward for s in built.samples] == rewards
    assert [s.reward_info for s in built.samples] == [{"rule_score": 1.0, "rm_score": 0.5},
                                                      {"rule_score": 0.0, "rm_score": 1.0}]
