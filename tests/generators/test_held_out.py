"""Held-out evaluation (``relay.generators.held_out``): which responses
``trainer.log_val_generations`` logs, picked as verl picks them, and the dump of every
response (``trainer.validation_data_dir``)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import torch

from relay.algorithms.rewards.result import RewardResult
from relay.configs.prompt_data import ChatMessage, PromptRow, RewardSpec
from relay.generators.held_out import evaluate, sample_generations, write_generations
from relay.generators.sampling import SamplingParams
from relay.transport.messages import ValGeneration


def _generations(prompts: list[str], per_prompt: int = 1) -> list[ValGeneration]:
    return [ValGeneration(input=p, output=f"{p}-r{k}", score=float(k))
            for p in prompts for k in range(per_prompt)]


def test_the_logged_responses_are_verls_seeded_sample_not_the_first_rows() -> None:
    prompts = [f"p{i}" for i in range(10)]
    picked = sample_generations(_generations(prompts), 3)
    # numpy.random.RandomState(42).shuffle of 10 items puts items 8, 1, 5 first (verl's pick);
    # the first three rows, p0 p1 p2, are what a file-order pick would log
    assert [g.input for g in picked] == ["p8", "p1", "p5"]


def test_the_sample_depends_on_the_responses_not_on_their_order() -> None:
    generations = _generations([f"p{i}" for i in range(10)])
    shuffled = random.Random(7).sample(generations, len(generations))
    assert sample_generations(shuffled, 4) == sample_generations(generations, 4)


def test_a_prompts_responses_keep_their_order_before_the_shuffle() -> None:
    # 3 prompts x 2 responses, sorted by prompt: a-r0 a-r1 b-r0 b-r1 c-r0 c-r1; RandomState(42)
    # shuffles 6 items to positions 0, 1, 5, 2, 4, 3
    picked = sample_generations(_generations(["c", "a", "b"], per_prompt=2), 6)
    assert [g.output for g in picked] == ["a-r0", "a-r1", "c-r1", "b-r0", "c-r0", "b-r1"]


def test_nothing_is_kept_for_zero_and_everything_when_asking_for_more() -> None:
    generations = _generations(["x", "y"])
    assert sample_generations(generations, 0) == []
    assert sorted(g.input for g in sample_generations(generations, 5)) == ["x", "y"]


def test_every_response_is_dumped_as_verl_writes_validation_data(tmp_path: Path) -> None:
    rows = [PromptRow(prompt=(ChatMessage("user", "q"),), data_source="src",
                      reward_model=RewardSpec("rule", ["4", "four"]))]
    tokenizer = SimpleNamespace(apply_chat_template=lambda messages, **_: [1],
                                decode=lambda ids, **_: {1: "2+2?", 7: "4"}.get(int(ids[0]),
                                                                               "5"))
    # the row's two responses: "4", then "5"
    engine = SimpleNamespace(generate=lambda prompts, params: [
        SimpleNamespace(token_ids=torch.tensor([token])) for token in (7, 8)])
    scorer = SimpleNamespace(score=lambda items: [
        RewardResult(score=float(item.solution_str == "4"), info={"acc": 1.0}, pred="4")
        if item.solution_str == "4" else RewardResult(score=0.0) for item in items])
    result = evaluate(engine, tokenizer, rows, scorer, SamplingParams(max_new_tokens=1), n=2,
                      record=True)
    assert result.generations == []  # nothing asked for the trackers' table
    path = write_generations(tmp_path / "val", 6, result.records)
    assert path == tmp_path / "val" / "6.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [
        {"input": "2+2?", "output": "4", "gts": ["4", "four"], "score": 1.0, "acc": 1.0,
         "pred": "4", "step": 6},
        {"input": "2+2?", "output": "5", "gts": ["4", "four"], "score": 0.0, "step": 6}]
    assert not list((tmp_path / "val").glob("*.partial"))
    assert evaluate(engine, tokenizer, rows, scorer, SamplingParams(max_new_tokens=1), n=2,
                    keep=1).records == []  # without record: none kept
