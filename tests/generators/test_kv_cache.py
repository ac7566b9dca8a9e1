"""relay.generators.kv_cache: the lean engine's cache sizes against hand-computed numbers (Qwen2.5-7B
at 1k + 4k tokens, the review's example), the choice between every slot at full length and
a paged pool, and the paged pool's block bookkeeping."""

from __future__ import annotations

import pytest
import torch

from relay.generators.kv_cache import (
    BLOCK_SIZE,
    CacheShape,
    PagedCache,
    blocks_for,
    budget_from_free_memory,
    plan_cache,
    workspace_bytes,
)

# Qwen2.5-7B: 28 layers, 28 query heads and 4 key/value heads of 128, hidden 3584, MLP 18944
QWEN_7B = CacheShape(layers=28, kv_heads=4, heads=28, head_dim=128, rows=256, max_len=5120)
QWEN_7B_SIZES = dict(hidden=3584, intermediate=18944, vocab=152064)


def test_every_slot_at_full_length_is_the_reviews_75_gb() -> None:
    per_position = QWEN_7B.bytes_per_position(torch.bfloat16)
    assert per_position == 2 * 28 * 4 * 128 * 2 == 57_344
    assert QWEN_7B.rows * QWEN_7B.max_len * per_position == 75_161_927_680


def test_the_workspace_is_the_prefill_the_sampling_and_one_layers_gather() -> None:
    got = workspace_bytes(QWEN_7B, **QWEN_7B_SIZES, prefill_tokens=8192,
                          dtype=torch.bfloat16, cache_dtype=torch.bfloat16)
    prefill = 8192 * (3 * 3584 + 3584 + 2 * 512 + 3584 + 3 * 18944) * 2  # 1.24 GB
    sampling = 256 * 152064 * 4 * 8  # 1.25 GB
    decode = 256 * 5120 * (2 * 512 * 2 + 2 * 28 * 4)  # 2.98 GB
    assert got == prefill + sampling + decode == 5_465_178_112


def test_a_gpu_of_80_gib_at_half_holds_a_paged_pool_not_every_slot() -> None:
    """0.5 of 80 GiB free, less 15.2 GB of bf16 weights and the workspace, is 22.3 GB of
    cache: 24,254 blocks of 16 positions, 75 full-length sequences rather than 256."""
    workspace = workspace_bytes(QWEN_7B, **QWEN_7B_SIZES, prefill_tokens=8192,
                                dtype=torch.bfloat16, cache_dtype=torch.bfloat16)
    budget = budget_from_free_memory(80 * 2**30, 0.5, 15_231_233_024, workspace)
    assert budget == 42_949_672_960 - 15_231_233_024 - 5_465_178_112 == 22_253_261_824
    plan = plan_cache(QWEN_7B, cache_dtype=torch.bfloat16, budget_bytes=budget,
                      prefill_tokens=8192)
    assert plan.blocks == 22_253_261_824 // (16 * 57_344) == 24_254
    assert plan.blocks // blocks_for(5120) == 75
    assert plan.prefill_tokens == 8192


def test_no_budget_or_enough_for_every_slot_is_the_slot_cache() -> None:
    full = QWEN_7B.rows * QWEN_7B.max_len * QWEN_7B.bytes_per_position(torch.bfloat16)
    for budget in (None, full, 2 * full):
        plan = plan_cache(QWEN_7B, cache_dtype=torch.bfloat16, budget_bytes=budget,
                          prefill_tokens=8192)
        assert plan.blocks is None
    assert plan_cache(QWEN_7B, cache_dtype=torch.bfloat16, budget_bytes=full - 1,
                      prefill_tokens=8192).blocks == (full - 1) // (16 * 57_344)


def test_a_budget_below_one_sequence_names_gpu_memory_utilization() -> None:
    one_sequence = blocks_for(5120) * BLOCK_SIZE * 57_344
    plan = plan_cache(QWEN_7B, cache_dtype=torch.bfloat16, budget_bytes=one_sequence,
                      prefill_tokens=8192)
    assert plan.blocks == 320
    for budget in (one_sequence - 1, -5):
        with pytest.raises(ValueError, match="less than one sequence's 5120: raise "
                                             "gpu_memory_utilization"):
            plan_cache(QWEN_7B, cache_dtype=torch.bfloat16, budget_bytes=budget,
                       prefill_tokens=8192)


def test_blocks_go_out_to_rows_and_come_back_when_they_retire() -> None:
    shape = CacheShape(layers=1, kv_heads=1, heads=1, head_dim=2, rows=4, max_len=40)
    cache = PagedCache(shape, blocks=6, dtype=torch.float32, device=torch.device("cpu"))
    assert cache.can_hold([33, 17]) and not cache.can_hold([33, 33, 17])  # 3 + 2, 3 + 3 + 2
    cache.reserve(0, [33, 17])  # 3 blocks, then 2
    assert cache.table[:2].tolist() == [[0, 1, 2], [3, 4, 0]]
    assert cache.free_blocks == 1 and not cache.can_hold([17])
    cache.release([0])
    cache.move([1], [0], 17)
    assert cache.table[0].tolist() == [3, 4, 0] and cache.free_blocks == 4
    cache.reserve(1, [40])  # the blocks row 0 gave back, lowest first
    assert cache.table[1].tolist() == [0, 1, 2]
    assert cache.capacity_error(2, 48) is None
    assert "3 sequences of 48 positions need 9 KV cache blocks of 16" in \
        cache.capacity_error(3, 48)
