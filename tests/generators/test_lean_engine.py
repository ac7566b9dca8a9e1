"""relay.generators.lean_engine: continuous batching admits groups as slots free, keeps the batch
full, shares a prompt's prefill among its samples and returns every group whole; a model
whose head_dim is not hidden / heads (Relay's tiny model) samples transformers' log-probs;
a paged KV cache smaller than every slot at full length admits groups as blocks free and
samples what the full cache samples."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from relay.configs.run_schema import ModelConfig
from relay.configs.topology_schema import GeneratorPlacement, LeanOptions
from relay.generators.build import build_engine
from relay.generators.engine import GroupRequest
from relay.generators.kv_cache import BLOCK_SIZE, PagedCache, SlotCache
from relay.generators.lean_engine import LeanEngine
from relay.generators.lean_model import CacheMemory
from relay.generators.sampling import SamplingParams
from relay.generators.torch_engine import TorchEngine
from ..conftest import save_random_model


def lean(path: Path, slots: int, eos: list[int], max_len: int = 48,
         memory: CacheMemory | None = None) -> LeanEngine:
    return LeanEngine.from_pretrained(str(path), dtype=torch.float32, eos_ids=eos, pad_id=0,
                                      seed=0, max_num_seqs=slots, max_len=max_len,
                                      memory=memory)


def run(engine: LeanEngine, requests: list[GroupRequest]) -> dict:
    """Every group's completions, by key, after submitting them all and stepping to the end."""
    for request in requests:
        engine.submit(request)
    finished = {}
    while engine.in_flight:
        for group in engine.step():
            finished[group.key] = group.completions
    return finished


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


def two_block_groups(count: int) -> list[GroupRequest]:
    """Groups of 1 to 3 samples at temperature 1 whose prompt + max_new_tokens need exactly
    two blocks (17..32 positions), ending after different numbers of tokens."""
    rng = random.Random(3)
    requests = []
    for index in range(count):
        prompt = [1] + [rng.randrange(3, 280) for _ in range(rng.randrange(2, 12))]
        params = SamplingParams(max_new_tokens=rng.randrange(17 - len(prompt), 33 - len(prompt)))
        requests.append(GroupRequest(index, prompt, 1 + index % 3, params))
    assert all(17 <= len(r.prompt_ids) + r.params.max_new_tokens <= 2 * BLOCK_SIZE
               for r in requests)
    return requests


def test_a_paged_pool_smaller_than_the_slots_samples_what_the_full_cache_samples(
        random_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """8 rows of 48 positions over a pool of 6 blocks of 16 (96 positions, not 8 x 48):
    every sequence needs two blocks, so three are in flight at a time and each group waits
    for blocks that retired sequences give back. Sampled at temperature 1, every token,
    log-prob and version equals what 3 slots of the full cache give (the same groups are
    admitted at the same steps, so the same random draws are made), and blocks are reused."""
    requests = two_block_groups(24)
    full = run(lean(random_model_dir, slots=3, eos=[-1]), requests)
    paged_engine = lean(random_model_dir, slots=8, eos=[-1],
                        memory=CacheMemory(positions=6 * BLOCK_SIZE))
    cache = paged_engine.cache
    assert isinstance(cache, PagedCache) and cache.blocks == 6
    handed_out: list[int] = []
    reserve = cache.reserve

    def recording_reserve(first_row: int, positions: list[int]) -> None:
        reserve(first_row, positions)
        for row in range(first_row, first_row + len(positions)):
            handed_out.extend(cache._owned[row])
    monkeypatch.setattr(cache, "reserve", recording_reserve)
    paged = run(paged_engine, requests)
    assert sorted(paged) == sorted(full) == list(range(24))
    for key, completions in full.items():
        for expected, got in zip(completions, paged[key], strict=True):
            assert torch.equal(got.token_ids, expected.token_ids)
            assert torch.equal(got.logprobs, expected.logprobs)
            assert torch.equal(got.versions, expected.versions)
    assert len(handed_out) == 2 * sum(r.n for r in requests) > 6
    assert set(handed_out) == set(range(6))
    assert cache.free_blocks == 6  # every block back


def test_a_paged_pool_gives_transformers_log_probs_as_groups_of_any_length_wait(
        random_model_dir: Path) -> None:
    """Groups needing 1 to 3 blocks through a pool of 7 (positions 0..47 of 8 rows would
    need 24): admission waits for blocks, retired blocks are reused in another order, rows
    move, and every sampled token's log-prob is transformers' (fp32)."""
    model = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32).eval()
    engine = lean(random_model_dir, slots=8, eos=[-1], memory=CacheMemory(positions=7 * 16))
    rng = random.Random(5)
    batch = prompts(20, seed=4)
    requests = [GroupRequest(index, prompt, 1 + index % 2,
                             SamplingParams(max_new_tokens=rng.randrange(1, 48 - len(prompt))))
                for index, prompt in enumerate(batch)]
    finished = run(engine, requests)
    assert engine.occupancy.steps > 0 and engine.occupancy.mean < 8
    with torch.no_grad():
        for index, prompt in enumerate(batch):
            for sample in finished[index]:
                assert len(sample.token_ids) == requests[index].params.max_new_tokens
                ids = torch.tensor(prompt + sample.token_ids.tolist())
                logits = model(ids[None]).logits[0, len(prompt) - 1:-1]  # (R, V)
                expected = logits.log_softmax(-1).gather(-1, ids[len(prompt):, None])[:, 0]
                torch.testing.assert_close(sample.logprobs, expected, atol=1e-4, rtol=1e-4)


def test_a_group_the_pool_could_never_hold_is_refused_naming_the_knob(
        random_model_dir: Path) -> None:
    engine = lean(random_model_dir, slots=8, eos=[2], memory=CacheMemory(positions=4 * 16))
    with pytest.raises(ValueError, match="need 6 KV cache blocks of 16.*holds 4.*"
                                         "gpu_memory_utilization"):
        engine.submit(GroupRequest("big", list(range(1, 21)), 3, SamplingParams(max_new_tokens=8)))
    assert engine.in_flight == 0


def test_a_prefill_takes_at_most_max_num_batched_tokens(random_model_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefills of at most max(max_num_batched_tokens, max_len) = 48 padded tokens: six
    groups of 20-token prompts are prefilled two at a time."""
    engine = lean(random_model_dir, slots=16, eos=[-1],
                  memory=CacheMemory(max_num_batched_tokens=40))
    shapes = []
    prefill = engine.decoder.prefill

    def recording_prefill(tokens, *args):
        shapes.append(tuple(tokens.shape))
        return prefill(tokens, *args)
    monkeypatch.setattr(engine.decoder, "prefill", recording_prefill)
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    run(engine, [GroupRequest(i, [1] + [3 + i] * 19, 2, params) for i in range(6)])
    assert shapes == [(2, 20)] * 3


def test_build_engine_takes_the_placements_lean_options(random_model_dir: Path) -> None:
    """The topology's lean section reaches the engine: on the CPU every slot at full length,
    prefills bounded by max(max_num_batched_tokens, max_len)."""
    placement = GeneratorPlacement(name="g", lean=LeanOptions(max_num_batched_tokens=100,
                                                              gpu_memory_utilization=0.3))
    engine, _ = build_engine(ModelConfig(path=str(random_model_dir), dtype="float32"),
                             placement, 0, max_num_seqs=4, max_len=48)
    assert isinstance(engine, LeanEngine) and isinstance(engine.cache, SlotCache)
    assert engine.decoder.cache_plan.prefill_tokens == 100
