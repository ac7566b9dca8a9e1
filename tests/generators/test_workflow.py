"""relay.generators.workflow: an episode's builder keeps tokens and mask within the response
budget, an unusable episode is named for what is wrong, a workflow spec that is not an async
function is refused, ``generate`` bounds a turn, ``close`` cancels the episodes in progress,
and a two-turn episode plays through vLLM's CPU build with each turn's request carrying the
whole sequence so far."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import threading
from pathlib import Path

import pytest
import torch

from relay.generators.engine import Engine, GroupRequest
from relay.generators.sampling import SamplingParams
from relay.generators.workflow import (Episode, EpisodeBuilder, EpisodeRow, Turn, WorkflowError,
                                       WorkflowRunner, episode_problem, load_workflow,
                                       play_episodes)
from relay.learner.tiny_model.tokenizer import build_tokenizer

from ..conftest import save_random_model
from .test_tool_loop import ScriptedEngine

PARAMS = SamplingParams(max_new_tokens=200, temperature=1.0)


def turn(ids: list[int], logprob: float = -0.5, version: int = 3) -> Turn:
    return Turn(token_ids=ids, logprobs=[logprob] * len(ids), versions=[version] * len(ids),
                finish_reason="stop")


def row(prompt_ids: list[int], prompt_id: str = "p0") -> EpisodeRow:
    return EpisodeRow(prompt_id=prompt_id, messages=[], data_source="test", ground_truth=None,
                      extra_info={}, prompt_ids=prompt_ids, sample_index=0)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


# -- EpisodeBuilder ----------------------------------------------------------------------------


def test_the_builder_masks_sampled_and_inserted_tokens_within_the_budget() -> None:
    builder = EpisodeBuilder(budget=8)
    builder.sampled(turn([5, 6, 7]))
    assert builder.inserted([9, 9], version=4) is True
    assert builder.remaining == 3
    e = builder.episode
    assert e.response_ids == [5, 6, 7, 9, 9]
    assert e.loss_mask == [True, True, True, False, False]
    assert e.logprobs == [-0.5, -0.5, -0.5, 0.0, 0.0]
    assert e.versions == [3, 3, 3, 4, 4] and e.finish_reason == "stop"


def test_inserted_tokens_past_the_budget_are_cut_and_end_the_episode_by_length() -> None:
    builder = EpisodeBuilder(budget=5)
    builder.sampled(turn([5, 6]))
    assert builder.inserted([9, 8, 7, 6], version=0) is False
    assert builder.episode.response_ids == [5, 6, 9, 8, 7]  # what fits is kept
    assert builder.remaining == 0 and builder.episode.finish_reason == "length"


def test_a_sampled_turn_past_the_budget_is_a_workflow_error() -> None:
    builder = EpisodeBuilder(budget=2)
    with pytest.raises(WorkflowError, match=r"3 tokens do not fit the 2 left of the episode's 2 "
                                            r"\(rollout.response_length\)"):
        builder.sampled(turn([1, 2, 3]))
    assert builder.episode.response_ids == []


# -- episode_problem ---------------------------------------------------------------------------


def episode(**changes) -> Episode:
    fields = dict(response_ids=[5, 9, 6], loss_mask=[True, False, True],
                  logprobs=[-0.5, 0.0, -0.25], versions=[1, 1, 1])
    return Episode(**{**fields, **changes})


@pytest.mark.parametrize("value, problem", [
    (episode(), ""),
    ({"response_ids": [1]}, "expected a relay.generators.workflow.Episode, got dict"),
    (episode(versions=[1]), "3 response ids but loss_mask, logprobs and versions have 3, 3 and "
                            "1 entries"),
    (episode(response_ids=[1] * 5, loss_mask=[True] * 5, logprobs=[0.0] * 5, versions=[0] * 5),
     "5 response tokens, more than rollout.response_length = 4"),
    (episode(loss_mask=[False] * 3, logprobs=[0.0] * 3),
     "no token the policy sampled (loss_mask is all false)"),
    (episode(logprobs=[-0.5, -1.0, -0.25]),
     "a log-prob on an inserted token (loss_mask false) must be 0"),
    (episode(reward=float("nan")), "reward nan is not finite"),
])
def test_episode_problem_names_what_makes_an_episode_unusable(value, problem: str) -> None:
    assert episode_problem(value, response_length=4) == problem


def test_an_unusable_episode_fails_naming_the_workflow_and_the_prompt(tokenizer) -> None:
    async def empty(engine, r):
        return Episode(response_ids=[], loss_mask=[], logprobs=[], versions=[])

    runner = WorkflowRunner(empty, tokenizer=tokenizer, response_length=8,
                            engine_version=lambda: 0, name="rollout.workflow 'u:empty'")
    try:
        with pytest.raises(WorkflowError, match=r"'u:empty' returned an unusable episode for "
                                                r"prompt p3: no token the policy sampled"):
            play_episodes(runner, ScriptedEngine(tokenizer, str),
                          [(GroupRequest("g", [1], 1, PARAMS), row([1], "p3"))])
    finally:
        runner.close()


# -- load_workflow -----------------------------------------------------------------------------


@pytest.fixture
def user_file(tmp_path: Path) -> Path:
    path = tmp_path / "agent.py"
    path.write_text("async def run_episode(engine, row):\n    pass\n\n"
                    "def plain(engine, row):\n    pass\n")
    return path


def test_load_workflow_takes_an_async_function_by_file_path(user_file: Path) -> None:
    assert load_workflow(f"{user_file}:run_episode").__name__ == "run_episode"


def test_load_workflow_refuses_a_function_that_is_not_async(user_file: Path) -> None:
    with pytest.raises(WorkflowError, match=r"plain is not an async function \(async def "
                                            r"run_episode\(engine, row\)\)"):
        load_workflow(f"{user_file}:plain")


def test_load_workflow_names_a_missing_attribute_and_what_the_file_defines(
        user_file: Path) -> None:
    with pytest.raises(WorkflowError, match=r"has no attribute 'missing'; functions it "
                                            r"defines: plain, run_episode"):
        load_workflow(f"{user_file}:missing")


# -- EngineHandle.generate ---------------------------------------------------------------------


def play_one(tokenizer, workflow, engine: Engine, prompt: list[int],
             response_length: int = 100):
    runner = WorkflowRunner(workflow, tokenizer=tokenizer, response_length=response_length,
                            engine_version=lambda: engine.version)
    try:
        ((completion,),) = play_episodes(runner, engine,
                                         [(GroupRequest("g", prompt, 1, PARAMS), row(prompt))])
    finally:
        runner.close()
    return completion


def test_generate_stops_a_turn_at_max_new_tokens(tokenizer) -> None:
    turns: list[Turn] = []

    async def short_turn(engine, r):
        builder = EpisodeBuilder(engine.response_length)
        turns.append(await engine.generate(r.prompt_ids, max_new_tokens=3))
        builder.sampled(turns[-1])
        return builder.episode

    engine = ScriptedEngine(tokenizer, lambda text: "a long answer")
    completion = play_one(tokenizer, short_turn, engine, [1, 2])
    assert len(turns[0].token_ids) == 3 and turns[0].finish_reason == "length"
    assert completion.token_ids.numel() == 3


@pytest.mark.parametrize("kwargs, ids, message", [
    (dict(max_new_tokens=0), [1], "max_new_tokens 0: must be at least 1"),
    ({}, [], "generate needs at least one token id")])
def test_generate_refuses_a_bad_request(tokenizer, kwargs, ids, message: str) -> None:
    async def bad(engine, r):
        await engine.generate(ids, **kwargs)

    with pytest.raises(WorkflowError, match=f"raised on prompt p0: ValueError: {message}"):
        play_one(tokenizer, bad, ScriptedEngine(tokenizer, str), [1])


# -- WorkflowRunner.close ----------------------------------------------------------------------


def test_close_cancels_the_episodes_in_progress_and_stops_the_thread(tokenizer) -> None:
    started, cancelled = threading.Event(), threading.Event()

    async def waits_forever(engine, r):
        started.set()
        try:
            await asyncio.Event().wait()  # a tool that never answers
        except asyncio.CancelledError:
            cancelled.set()
            raise

    runner = WorkflowRunner(waits_forever, tokenizer=tokenizer, response_length=8,
                            engine_version=lambda: 0)
    runner.start(GroupRequest("g", [1], 2, PARAMS), row([1]))
    assert started.wait(5.0)
    gc.collect()  # an episode awaiting what only it references is kept alive by the runner
    runner.close()
    assert cancelled.is_set()
    assert not runner._thread.is_alive()
    assert runner.finished() == []  # a cancelled group is not a result


# -- vLLM's CPU build: one request per turn with the token ids so far --------------------------

INSERTED = [201, 1, 278, 201]  # tokens the workflow puts between the turns (mask 0)


async def two_turns(engine, r) -> Episode:
    builder = EpisodeBuilder(engine.response_length)
    builder.sampled(await engine.generate(r.prompt_ids, max_new_tokens=6))
    builder.inserted(INSERTED, engine.version)
    builder.sampled(await engine.generate(r.prompt_ids + builder.episode.response_ids,
                                          max_new_tokens=6))
    return builder.episode


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_a_two_turn_episode_plays_through_vllm(tokenizer, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU build starts in about 10 s."""
    from relay.generators.vllm_engine import VLLMEngine

    model = save_random_model(tmp_path / "model", hidden=128)  # heads of 32 for vLLM's CPU
    engine = VLLMEngine.from_pretrained(str(model), dtype=torch.float32,
                                        eos_ids=[tokenizer.eos_token_id],
                                        pad_id=tokenizer.pad_token_id, seed=0, max_num_seqs=4,
                                        max_len=64)
    requests: list[list[int]] = []
    submit = engine.submit
    monkeypatch.setattr(engine, "submit", lambda request: (
        requests.append(list(request.prompt_ids)), submit(request))[1])
    prompt = [1, 271, 201, 24, 2, 201]
    episode = play_one(tokenizer, two_turns, engine, prompt, response_length=32)
    assert len(requests) == 2  # one request per turn
    first = len(requests[1]) - len(prompt) - len(INSERTED)
    assert requests[0] == prompt
    # the second turn's request: the prompt, the first turn as sampled, the inserted tokens
    assert requests[1] == prompt + episode.token_ids[:first].tolist() + INSERTED
    mask = episode.loss_mask
    assert mask.tolist() == [True] * first + [False] * len(INSERTED) + \
        [True] * (len(mask) - first - len(INSERTED))
    assert torch.isfinite(episode.logprobs).all()
    assert (episode.logprobs[mask] <= 0).all() and episode.logprobs[~mask].eq(0).all()
    assert episode.versions.eq(engine.version).all() and engine.version >= 0
