"""relay.bench_engine (``relay bench engine``): the engine benchmark's contenders all decode
the full length, its compute ceiling uses the stated FLOP count (attention over heads *
head_dim channels), and its continuous-batching stream keeps the slots fuller than static
batches would."""

from __future__ import annotations

import math

import pytest
from pathlib import Path

from transformers import AutoModelForCausalLM

from relay.bench_engine import (compare_engines, continuous_batching, forward_flops_per_token,
                                tool_episodes)
from relay.generators.torch_engine import TorchEngine

from ...conftest import save_random_model


def test_forward_flops_per_token_counts_weights_and_attention(random_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    parameters = sum(p.numel() for p in model.parameters())
    # the conftest model: 2 layers of hidden 64 (4 heads of 16)
    assert forward_flops_per_token(model, context=10) == 2 * parameters + 4 * 2 * 64 * 10


def test_forward_flops_per_token_attends_over_heads_times_head_dim(tmp_path: Path) -> None:
    """An explicit head_dim (32 on hidden 64 and 4 heads, as the tiny model's 32 on 128 and 8):
    attention runs on 4 * 32 = 128 channels, not the hidden size's 64."""
    model = AutoModelForCausalLM.from_pretrained(save_random_model(tmp_path, head_dim=32))
    parameters = sum(p.numel() for p in model.parameters())
    assert forward_flops_per_token(model, context=10) == 2 * parameters + 4 * 2 * 128 * 10


def test_every_contender_is_measured_on_the_same_shape(random_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    result = compare_engines(model, batch=4, prompt_len=5, new_tokens=4, samples_per_prompt=2,
                             repeats=1)
    assert (result.batch, result.prompt_len, result.new_tokens) == (4, 5, 4)
    rates = [result.lean, result.torch, result.hf_generate, result.floor,
             result.compute_ceiling]
    assert all(math.isfinite(r) and r > 0 for r in rates)
    assert result.other is None and result.other_over_lean is None


def test_another_engine_is_measured_beside_the_others(random_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    other = TorchEngine(model, eos_ids=[], pad_id=0)  # vLLM in tools/bench-engine.py --vllm
    result = compare_engines(model, batch=4, prompt_len=5, new_tokens=4, repeats=1,
                             other=other)
    assert result.other is not None and result.other > 0
    assert result.other_over_lean == result.other / result.lean


def test_continuous_batching_keeps_the_slots_full(random_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    result = continuous_batching(model, max_num_seqs=16, prompt_len=5, new_tokens=12,
                                 samples_per_prompt=4, groups=24)
    assert result.continuous_fraction >= 0.9
    assert result.static_fraction < result.continuous_fraction
    assert result.tokens_per_s > 0


def test_a_stream_too_short_to_queue_is_refused(random_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    with pytest.raises(ValueError, match="do not fill 16 slots twice"):
        continuous_batching(model, max_num_seqs=16, prompt_len=5, new_tokens=12,
                            samples_per_prompt=4, groups=6)


def test_a_tool_that_sleeps_2_s_leaves_the_other_sequences_decoding(tmp_path: Path) -> None:
    """Issue 33: a quarter of 192 two-turn episodes call a tool that sleeps 2 s. While a
    sleep is pending the batch stays (nearly) full, and the run is slower than with an
    instant tool by at most about one sleep (the sleeps overlap the others' decoding and
    each other), not by a sleep per batch as a lockstep batcher's would be."""
    model = AutoModelForCausalLM.from_pretrained(
        save_random_model(tmp_path / "model", hidden=256, layers=4))
    o = tool_episodes(model, max_num_seqs=8, prompt_len=16, new_tokens=24, episodes=192,
                      sleepy_every=4, sleep_s=2.0)
    print(f"\n{o.sleepy} of {o.episodes} episodes' tools slept {o.sleep_s:g} s: "
          f"{o.occupancy_while_sleeping:.1f} of {o.max_num_seqs} sequences in flight over "
          f"{o.steps_while_sleeping} decode steps while a sleep was pending; "
          f"{o.sleepy_s:.2f} s against {o.instant_s:.2f} s with an instant tool "
          f"(+{o.extra_s:.2f} s; lockstep batches would add {o.lockstep_extra_s:.0f} s)")
    assert o.steps_while_sleeping > 100  # the others decoded through the sleeps
    assert o.occupancy_while_sleeping >= 0.75 * o.max_num_seqs
    assert o.extra_s < o.sleep_s + 1.0  # noise allowance on a shared machine
    assert o.lockstep_extra_s >= 10 * o.sleep_s
