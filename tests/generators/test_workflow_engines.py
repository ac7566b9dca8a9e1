"""Workflow episodes run on every engine in this process: each turn is one request with the
token ids so far, and the episode's tokens, log-probs and versions are the turns' own,
with a weight swap between turns showing in the versions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relay.generators.engine import GroupRequest
from relay.generators.sampling import SamplingParams
from relay.generators.workflow import (Episode, EpisodeBuilder, EpisodeRow, WorkflowRunner,
                                       play_episodes)

from .test_engines import build, weights

INSERTED = [5, 6, 7]


@pytest.mark.parametrize("kind", ["lean", "torch", "hf"])
def test_a_two_turn_episode_on_each_engine(kind: str, random_model_dir: Path) -> None:
    engine = build(kind, random_model_dir, eos=-1)  # nothing stops early
    new = {name: value + 0.01 for name, value in weights(engine).items()}
    turns = []

    async def two_turns(handle, row: EpisodeRow) -> Episode:
        episode = EpisodeBuilder(handle.response_length)
        first = await handle.generate(row.prompt_ids, max_new_tokens=4)
        episode.sampled(first)
        engine.load_weights(1, new)  # between turns: the compute loop's thread is waiting
        episode.inserted(INSERTED, handle.version)
        second = await handle.generate([*row.prompt_ids, *first.token_ids, *INSERTED],
                                       max_new_tokens=5)
        episode.sampled(second)
        turns.append((first, second))
        return episode.episode

    runner = WorkflowRunner(two_turns, tokenizer=None, response_length=20,
                            engine_version=lambda: engine.version)
    prompt = [1, 271, 201, 273, 272, 223]
    row = EpisodeRow(prompt_id="p", messages=[], data_source="", ground_truth=None,
                     extra_info={}, prompt_ids=prompt, sample_index=0)
    try:
        (episodes,) = play_episodes(runner, engine, [
            (GroupRequest("g", prompt, 1, SamplingParams(max_new_tokens=8)), row)])
    finally:
        runner.close()
    (episode,), ((first, second),) = episodes, turns
    assert episode.token_ids.tolist() == [*first.token_ids, *INSERTED, *second.token_ids]
    assert episode.loss_mask.tolist() == [True] * 4 + [False] * 3 + [True] * 5
    assert episode.versions.tolist() == [0] * 4 + [1] * 3 + [1] * 5
    assert torch.equal(episode.logprobs, torch.tensor(
        [*first.logprobs, 0.0, 0.0, 0.0, *second.logprobs]))
    assert episode.logprobs[episode.loss_mask].lt(0).all()
