"""relay.generators.memory_plan: an engine's GPU share of weights, KV cache and workspace, for
Qwen2.5-7B from its config alone, and the lean engine's own allocations on the CPU."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

from relay.generators.kv_cache import BLOCK_SIZE
from relay.generators.lean_model import CacheMemory, LeanDecoder
from relay.generators.memory_plan import CUDA_CONTEXT_BYTES, kv_heads_per_gpu, plan_engine

from ..qwen25_configs import QWEN25_7B, qwen2_parameters

GIB = 1 << 30
QWEN7B = AutoConfig.for_model(**QWEN25_7B)
NUMEL = qwen2_parameters(QWEN25_7B)
PER_POSITION = 2 * 28 * 4 * 128 * 2  # K and V, 28 layers, 4 kv heads of 128, bf16


def plan(engine: str, **settings: object):  # noqa: ANN201 - an EngineMemory
    kwargs = dict(engine=engine, numel=NUMEL, dtype=torch.bfloat16, max_num_seqs=256,
                  max_len=1024 + 4096, gpu_bytes=80 * GIB, utilization=0.5) | settings
    return plan_engine(QWEN7B, **kwargs)


def test_every_sequence_at_full_length_is_the_issues_75_gb() -> None:
    grown = plan("torch")  # transformers' cache grows to every row at full length
    assert grown.kv_cache == 256 * 5120 * PER_POSITION == 75_161_927_680
    assert grown.weights == NUMEL * 2
    assert grown.cache_positions == grown.wanted_positions and grown.problem is None


def test_the_lean_engine_pages_what_its_share_leaves() -> None:
    paged = plan("lean")
    budget = int((80 * GIB - CUDA_CONTEXT_BYTES) * 0.5) - paged.weights - paged.workspace
    assert paged.kv_cache == budget // (BLOCK_SIZE * PER_POSITION) * BLOCK_SIZE * PER_POSITION
    assert paged.cache_positions < paged.wanted_positions
    slots = plan("lean", max_num_seqs=16)  # 16 full rows fit: every row at full length
    assert slots.kv_cache == 16 * 5120 * PER_POSITION


def test_relays_engines_assemble_the_next_version_in_a_second_copy_of_the_weights() -> None:
    for engine in ("lean", "torch", "hf"):
        assert plan(engine).next_version == plan(engine).weights == NUMEL * 2
    assert plan("vllm").next_version == plan("sglang").next_version == 0  # host versions


def test_vllm_fills_its_share_and_tensor_parallelism_splits_weights_and_heads() -> None:
    alone = plan("vllm")
    assert alone.weights + alone.kv_cache + alone.workspace == 40 * GIB
    halves = plan("vllm", tensor_parallel=2)
    assert halves.weights == NUMEL  # bf16 / 2
    assert halves.kv_cache // halves.cache_positions == PER_POSITION // 2
    assert kv_heads_per_gpu(4, 8) == 1  # 8 GPUs share 4 heads: each holds one


def test_a_share_too_small_for_one_sequence_is_a_problem_naming_the_key() -> None:
    starved = plan("vllm", utilization=0.2)  # 16 GiB: less than the weights and workspace
    assert starved.cache_positions < 5120
    assert "gpu_memory_utilization" in starved.problem
    assert "gpu_memory_utilization" in plan("lean", utilization=0.2).problem


@pytest.mark.parametrize("rows, max_len", [(4, 96), (2, 200)])
def test_the_plan_is_what_the_lean_decoder_allocates(rows: int, max_len: int) -> None:
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                         tie_word_embeddings=False)
    decoder = LeanDecoder(config, slots=rows, max_len=max_len, dtype=torch.float32,
                          memory=CacheMemory())
    numel = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    planned = plan_engine(config, engine="lean", numel=numel, dtype=torch.float32,
                          max_num_seqs=rows, max_len=max_len, gpu_bytes=GIB, utilization=0.5)
    cache = decoder.cache
    assert cache.k.nbytes + cache.v.nbytes == planned.kv_cache
    tables = decoder.cos.nbytes + decoder.sin.nbytes  # rotary tables, not weights
    assert decoder.weights_bytes() - tables == planned.weights
