"""relay.generators.tool_loop: an episode calls tools over several turns and is one sample,
its loss mask 1 exactly on the policy's tokens; malformed calls, unknown tools and limits
end turns, never the episode's generator; verl's tool YAML builds the loop."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from relay.configs import CONFIG_DIR
from relay.configs.chat_turns import inserted_ids
from relay.configs.run_schema import MultiTurnConfig, RolloutConfig
from relay.generators.engine import Completion, Engine, GroupRequest
from relay.generators.sampling import SamplingParams
from relay.generators.tool_loop import ToolLoop, configured_workflow
from relay.generators.tools import load_tools
from relay.generators.workflow import (EpisodeCompletion, EpisodeRow, WorkflowError,
                                       WorkflowRunner, play_episodes)
from relay.learner.tiny_model.tokenizer import build_tokenizer

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "123*45"}}</tool_call>'
ANSWER = "<answer>5535</answer>"
PARAMS = SamplingParams(max_new_tokens=200, temperature=1.0)


class ScriptedEngine(Engine):
    """Answers each turn with the text ``script(prompt text)`` returns, ending at eos; every
    token's log-prob is -0.5 and its version the engine's."""

    name = "scripted"

    def __init__(self, tokenizer, script: Callable[[str], str]) -> None:
        super().__init__()
        self.tokenizer, self.script = tokenizer, script
        self.prompts: list[list[int]] = []

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 between_steps=None) -> list[Completion]:
        out = []
        for prompt in prompts:
            self.prompts.append(list(prompt))
            text = self.script(self.tokenizer.decode(list(prompt)))
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            ids = (ids + [self.tokenizer.eos_token_id])[:params.max_new_tokens]
            stopped = ids[-1] == self.tokenizer.eos_token_id
            out.append(Completion(token_ids=torch.tensor(ids, dtype=torch.int32),
                                  logprobs=torch.full((len(ids),), -0.5),
                                  versions=torch.full((len(ids),), self.version,
                                                      dtype=torch.int32),
                                  finish_reason="stop" if stopped else "length"))
        return out

    def reseed(self, seed: int) -> None:
        pass

    def load_weights(self, version, tensors) -> None:
        self.version = version


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def calculator_loop(**limits) -> ToolLoop:
    return ToolLoop(MultiTurnConfig(enable=True, **limits),
                    load_tools(CONFIG_DIR / "tools" / "calculator.yaml"))


def play(tokenizer, loop: ToolLoop, engine: Engine, n: int = 1,
         response_length: int = 400) -> list[EpisodeCompletion]:
    runner = WorkflowRunner(loop, tokenizer=tokenizer, response_length=response_length,
                            engine_version=lambda: engine.version)
    messages = [{"role": "user", "content": "What is 123 * 45?"}]
    prompt = loop.render_prompt(tokenizer, messages)
    row = EpisodeRow(prompt_id="p0", messages=messages, data_source="test", ground_truth="5535",
                     extra_info={}, prompt_ids=prompt, sample_index=0)
    try:
        (episodes,) = play_episodes(runner, engine, [(GroupRequest("g", prompt, n, PARAMS), row)])
    finally:
        runner.close()
    return episodes


def calls_then_answers(prompt_text: str) -> str:
    return ANSWER if "<|im_start|>tool" in prompt_text else CALL


def test_an_episode_calls_the_tool_then_answers_as_one_sample(tokenizer) -> None:
    engine = ScriptedEngine(tokenizer, calls_then_answers)
    (episode,) = play(tokenizer, calculator_loop(), engine)
    call_ids = tokenizer.encode(CALL, add_special_tokens=False) + [tokenizer.eos_token_id]
    answer_ids = tokenizer.encode(ANSWER, add_special_tokens=False) + [tokenizer.eos_token_id]
    messages = [{"role": "user", "content": "What is 123 * 45?"},
                {"role": "assistant", "content": tokenizer.decode(call_ids,
                                                                  skip_special_tokens=True)}]
    between = inserted_ids(tokenizer, messages, [{"role": "tool", "content": "5535"}])
    assert episode.token_ids.tolist() == call_ids + between + answer_ids
    assert episode.loss_mask.tolist() == ([True] * len(call_ids) + [False] * len(between)
                                          + [True] * len(answer_ids))
    assert episode.logprobs[~episode.loss_mask].eq(0).all()
    assert episode.logprobs[episode.loss_mask].eq(-0.5).all()
    assert (episode.stats.turns, episode.stats.tool_calls, episode.stats.tool_failures) == (2, 1, 0)
    assert len(episode.stats.tool_latencies_s) == 1
    assert episode.finish_reason == "stop"
    # the second turn was prompted with everything so far: prompt, call, tool response
    assert engine.prompts[1] == engine.prompts[0] + call_ids + between
    assert "5535" in tokenizer.decode(between)


def test_a_malformed_call_is_a_failed_call_the_model_reads(tokenizer) -> None:
    broken = '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'
    engine = ScriptedEngine(tokenizer, lambda text: ANSWER if "<|im_start|>tool" in text
                            else broken)
    (episode,) = play(tokenizer, calculator_loop(), engine)
    assert (episode.stats.tool_calls, episode.stats.tool_failures) == (1, 1)
    reply = tokenizer.decode(engine.prompts[1][len(engine.prompts[0]):])
    assert "malformed tool call" in reply


def test_an_unknown_tool_is_a_failed_call(tokenizer) -> None:
    wrong = '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>'
    engine = ScriptedEngine(tokenizer, lambda text: ANSWER if "<|im_start|>tool" in text
                            else wrong)
    (episode,) = play(tokenizer, calculator_loop(), engine)
    assert episode.stats.tool_failures == 1
    assert "unknown tool 'search'" in tokenizer.decode(engine.prompts[1])


def test_max_assistant_turns_ends_an_episode_that_keeps_calling(tokenizer) -> None:
    engine = ScriptedEngine(tokenizer, lambda text: CALL)
    (episode,) = play(tokenizer, calculator_loop(max_assistant_turns=3), engine)
    assert (episode.stats.turns, episode.stats.tool_calls) == (3, 2)
    assert len(engine.prompts) == 3


def test_max_user_turns_bounds_the_tool_responses(tokenizer) -> None:
    engine = ScriptedEngine(tokenizer, lambda text: CALL)
    (episode,) = play(tokenizer, calculator_loop(max_user_turns=1), engine)
    assert (episode.stats.turns, episode.stats.tool_calls) == (2, 1)


def test_the_response_length_bounds_the_whole_episode(tokenizer) -> None:
    engine = ScriptedEngine(tokenizer, lambda text: CALL)
    (episode,) = play(tokenizer, calculator_loop(), engine, response_length=120)
    assert episode.token_ids.numel() <= 120
    assert episode.finish_reason == "length"
    assert episode.loss_mask.any()


def test_each_of_n_samples_is_its_own_episode(tokenizer) -> None:
    engine = ScriptedEngine(tokenizer, calls_then_answers)
    episodes = play(tokenizer, calculator_loop(), engine, n=3)
    assert len(episodes) == 3
    assert all(e.stats.turns == 2 for e in episodes)
    assert len(engine.prompts) == 6


def test_a_workflow_that_raises_names_itself_and_the_prompt(tokenizer) -> None:
    async def broken(engine, row):
        raise KeyError("nope")

    runner = WorkflowRunner(broken, tokenizer=tokenizer, response_length=10,
                            engine_version=lambda: 0, name="rollout.workflow 'x:broken'")
    row = EpisodeRow(prompt_id="p7", messages=[], data_source="d", ground_truth=None,
                     extra_info={}, prompt_ids=[1], sample_index=0)
    try:
        with pytest.raises(WorkflowError, match=r"'x:broken' raised on prompt p7: KeyError"):
            play_episodes(runner, ScriptedEngine(tokenizer, str),
                          [(GroupRequest("g", [1], 1, PARAMS), row)])
    finally:
        runner.close()


def test_configured_workflow_builds_the_loop_from_verl_keys(tmp_path: Path) -> None:
    rollout = RolloutConfig(multi_turn=MultiTurnConfig(
        enable=True, tool_config_path=str(CONFIG_DIR / "tools" / "calculator.yaml")))
    configured = configured_workflow(rollout)
    assert isinstance(configured.function, ToolLoop)
    assert list(configured.function.tools) == ["calculator"]
    assert configured_workflow(RolloutConfig()) is None
    with pytest.raises(WorkflowError, match="choose one"):
        configured_workflow(RolloutConfig(workflow="x:y", multi_turn=MultiTurnConfig(enable=True)))


def test_a_simulated_user_replies_until_the_answer_is_right(tokenizer) -> None:
    """verl's GSM8K interaction: a turn that calls no tool gets the user's verdict; a wrong
    answer gets another turn, the right one ends the episode."""
    from relay.generators.tools.interaction import Gsm8kInteraction

    answers = iter(["#### 5535", "#### 5536"][::-1])
    engine = ScriptedEngine(tokenizer, lambda text: next(answers))
    loop = ToolLoop(MultiTurnConfig(enable=True, max_user_turns=3), {},
                    {"gsm8k": Gsm8kInteraction({"name": "gsm8k"})})
    runner = WorkflowRunner(loop, tokenizer=tokenizer, response_length=400,
                            engine_version=lambda: engine.version)
    messages = [{"role": "user", "content": "What is 123 * 45?"}]
    prompt = loop.render_prompt(tokenizer, messages)
    row = EpisodeRow(prompt_id="p0", messages=messages, data_source="test", ground_truth="5535",
                     extra_info={"interaction_kwargs": {"name": "gsm8k", "ground_truth": "5535"}},
                     prompt_ids=prompt, sample_index=0)
    try:
        ((episode,),) = play_episodes(runner, engine,
                                      [(GroupRequest("g", prompt, 1, PARAMS), row)])
    finally:
        runner.close()
    assert episode.stats.turns == 2 and episode.stats.tool_calls == 0
    reply = tokenizer.decode(engine.prompts[1][len(engine.prompts[0]):])
    assert "<|im_start|>user\nYour response is incorrect!" in reply
    assert episode.reward_info == {"interaction/last_turn_score": 1.0}
    assert episode.loss_mask.sum() < episode.token_ids.numel()
