"""generators.lean_engine: continuous batching admits groups as slots free, keeps the batch
full, shares a prompt's prefill among its samples and returns every group whole; a model
whose head_dim is not hidden / heads (Relay's tiny model) samples transformers' log-probs."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from generators.engine import GroupRequest
from generators.lean_engine import LeanEngine
from generators.sampling import SamplingParams
from generators.torch_engine import TorchEngine
from ..conftest import save_random_model


def lean(path: Path, slots: int, eos: list[int]) -> LeanEngine:
    return LeanEngine.from_pretrained(str(path), dtype=torch.float32, eos_ids=eos, pad_id=0,
                                      seed=0, max_num_seqs=slots, max_len=48)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 280) for _ in range(rng.randrange(2, 20))]
            for _ in range(count)]


def test_groups_through_few_slots_decode_as_a_plain_batch_does(random_model_dir: Path) -> None:
    """30 groups of 3 greedy samples, each group with its own length limit, through 8
    slots (admission, shared prefill, retiring and compaction on most steps) give what
    the plain engine gives each prompt, cut at that limit."""
    engine = lean(random_model_dir, slots=8, eos=[-1])
    reference = TorchEngine.from_pretrained(str(random_model_dir), dtype=torch.float32,
                                            eos_ids=[-1], pad_id=0)
    batch = prompts(30)
    limits = [2 + index % 11 for index in range(30)]
    for index, prompt in enumerate(batch):
        params = SamplingParams(max_new_tokens=limits[index], temperature=0.0)
        engine.submit(GroupRequest(index, prompt, 3, params))
    finished = {}
    while engine.in_flight:
        for group in engine.step():
            finished[group.key] = group.completions
    expected = reference.generate(batch, SamplingParams(max_new_tokens=12, temperature=0.0))
    assert sorted(finished) == list(range(30))
    for index, completion in enumerate(expected):
        assert len(finished[index]) == 3
        for sample in finished[index]:
            assert sample.token_ids.tolist() == completion.token_ids[:limits[index]].tolist()
            assert sample.finish_reason == "length"


def test_the_batch_stays_full_while_groups_wait(random_model_dir: Path) -> None:
    eos = [int(t) for t in range(3, 280, 7)]
    engine = lean(random_model_dir, slots=64, eos=eos)
    params = SamplingParams(max_new_tokens=16, temperature=1.0)
    for index, prompt in enumerate(prompts(120, seed=1)):
        engine.submit(GroupRequest(index, prompt, 4, params))
    done = 0
    while engine.in_flight:
        done += len(engine.step())
    assert done == 120
    assert engine.occupancy.steps > 10
    assert engine.occupancy.mean >= 0.9 * 64


def test_samples_of_one_prompt_are_independent_draws(random_model_dir: Path) -> None:
    engine = lean(random_model_dir, slots=16, eos=[-1])
    engine.submit(GroupRequest("g", prompts(1)[0], 16, SamplingParams(max_new_tokens=8)))
    finished = []
    while engine.in_flight:
        finished += engine.step()
    (group,) = finished
    assert len({tuple(c.token_ids.tolist()) for c in group.completions}) > 8


def test_requests_that_cannot_fit_are_refused_by_name(random_model_dir: Path) -> None:
    engine = lean(random_model_dir, slots=4, eos=[2])
    params = SamplingParams(max_new_tokens=16)
    with pytest.raises(ValueError, match="exceed the engine's 4 slots"):
        engine.submit(GroupRequest("wide", [1, 2, 3], 5, params))
    with pytest.raises(ValueError, match="exceed the engine's 48 positions"):
        engine.submit(GroupRequest("long", list(range(40)), 1, params))
    assert engine.in_flight == 0


def test_an_explicit_head_dim_samples_the_transformers_log_probs(tmp_path: Path) -> None:
    """head_dim 32 on hidden 64 and 4 heads (q/k/v project 64 -> 128, 64, 64), as the tiny
    model's head_dim 32 on hidden 128 and 8 heads: every sampled token's log-prob is the one
    transformers' forward gives it."""
    folder = save_random_model(tmp_path, head_dim=32)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert model.config.head_dim * model.config.num_attention_heads != model.config.hidden_size
    engine = lean(folder, slots=4, eos=[-1])
    batch = prompts(3, seed=2)
    for index, prompt in enumerate(batch):
        engine.submit(GroupRequest(index, prompt, 2, SamplingParams(max_new_tokens=10)))
    finished = {}
    while engine.in_flight:
        for group in engine.step():
            finished[group.key] = group.completions
    with torch.no_grad():
        for index, prompt in enumerate(batch):
            for sample in finished[index]:
                ids = torch.tensor(prompt + sample.token_ids.tolist())
                logits = model(ids[None]).logits[0, len(prompt) - 1:-1]  # (R, V)
                expected = logits.log_softmax(-1).gather(-1, ids[len(prompt):, None])[:, 0]
                torch.testing.assert_close(sample.logprobs, expected, atol=1e-4, rtol=1e-4)
