"""What one GPU of a generator holds, planned from the model's config alone (no weights):
its share of the engine's weights, its KV cache and the workspace of a step.

Relay's engines size their cache as ``relay.generators.kv_cache`` does at start: the lean engine
every row at full length when ``gpu_memory_utilization`` of the GPU holds that, else a paged
pool of what it leaves after the weights and the workspace (``plan_cache``); the torch and
hf engines grow transformers' cache up to every row at full length. On CUDA each of them
also assembles the next weight version in a second copy of its weights on the device
(``relay.generators.weight_receiver.DeviceCopy``), made at the first version, after the cache
was sized: outside ``gpu_memory_utilization``'s share. vLLM and SGLang claim
``gpu_memory_utilization`` of the GPU and give the cache what their weights and their
profiled activations leave; the lean engine's workspace bound stands in for the latter. The
caller counts the parameters (``relay.learner.memory_plan.count_parameters``: generators do not
import the learner).
"""

from __future__ import annotations

import math

import msgspec
import torch
from transformers import PretrainedConfig

from relay.generators.kv_cache import (
    BLOCK_SIZE,
    CacheShape,
    budget_from_free_memory,
    plan_cache,
    workspace_bytes,
)

OWN_POOL_ENGINES = ("vllm", "sglang")  # claim gpu_memory_utilization of the GPU for a pool
# An allowance, not a measurement: the CUDA context a process holds outside torch's
# allocator (~0.5 GiB with torch on an H100); Relay's engines take their share of what is
# free after it.
CUDA_CONTEXT_BYTES = 1 << 29


class EngineMemory(msgspec.Struct, frozen=True, kw_only=True):
    """One GPU of an engine: bytes of each part, the positions its cache holds against the
    ``max_num_seqs x max_len`` of every sequence at full length, and what stops it from
    starting (None when nothing does)."""

    weights: int
    next_version: int  # the weights' second copy a version is assembled in (0: on the host)
    kv_cache: int
    workspace: int
    cache_positions: int
    wanted_positions: int
    problem: str | None = None


def kv_heads_per_gpu(kv_heads: int, tensor_parallel: int) -> int:
    """Key/value heads one GPU holds: ceil(kv_heads / tensor_parallel) (vLLM and SGLang
    replicate a head over the GPUs that share it when tensor_parallel > kv_heads)."""
    return math.ceil(kv_heads / tensor_parallel)


def plan_engine(config: PretrainedConfig, *, engine: str, numel: int, dtype: torch.dtype,
                max_num_seqs: int, max_len: int, gpu_bytes: int, utilization: float,
                tensor_parallel: int = 1, max_num_batched_tokens: int = 8192) -> EngineMemory:
    """One GPU of ``engine`` serving the model ``config`` describes (``numel`` parameters)
    in ``dtype``, ``max_num_seqs`` sequences of at most ``max_len`` positions, on a GPU of
    ``gpu_bytes`` (module docstring). Weights: numel x itemsize / tensor_parallel; the
    cache: ``kv_cache.CacheShape.bytes_per_position`` (2 x layers x kv heads on this GPU x
    head_dim x itemsize) a position; the budget: ``utilization`` x (the GPU's memory, less
    ``CUDA_CONTEXT_BYTES`` for Relay's engines, which read what is free) - weights -
    workspace."""
    heads = config.num_attention_heads
    shape = CacheShape(layers=config.num_hidden_layers,
                       kv_heads=kv_heads_per_gpu(getattr(config, "num_key_value_heads", None)
                                                 or heads, tensor_parallel),
                       heads=math.ceil(heads / tensor_parallel),
                       head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                       rows=max_num_seqs, max_len=max_len)
    per_position = shape.bytes_per_position(dtype)
    wanted = max_num_seqs * max_len
    weights = math.ceil(numel * dtype.itemsize / tensor_parallel)
    workspace = workspace_bytes(shape, hidden=config.hidden_size,
                                intermediate=math.ceil(config.intermediate_size / tensor_parallel),
                                vocab=config.vocab_size, dtype=dtype, cache_dtype=dtype,
                                prefill_tokens=max(max_num_batched_tokens, max_len))
    free = gpu_bytes if engine in OWN_POOL_ENGINES else gpu_bytes - CUDA_CONTEXT_BYTES
    budget = budget_from_free_memory(free, utilization, weights, workspace)
    problem = None
    if engine == "lean":
        try:
            blocks = plan_cache(shape, cache_dtype=dtype, budget_bytes=budget,
                                prefill_tokens=None).blocks
        except ValueError as exc:
            blocks, problem = 0, str(exc)
        cache = wanted * per_position if blocks is None else blocks * BLOCK_SIZE * per_position
    elif engine in OWN_POOL_ENGINES:
        cache = max(budget, 0)
    else:  # torch, hf: transformers' cache grows to every row at full length
        cache = wanted * per_position
    positions = cache // per_position
    if problem is None and positions < max_len:
        problem = (f"the KV cache holds {positions:,} positions, less than one sequence's "
                   f"{max_len:,}: {utilization:.0%} of the GPU (gpu_memory_utilization) "
                   f"leaves {max(budget, 0) / 2**30:.2f} GiB after the weights and workspace")
    return EngineMemory(weights=weights, next_version=0 if engine in OWN_POOL_ENGINES else weights,
                        kv_cache=cache, workspace=workspace, cache_positions=positions,
                        wanted_positions=wanted, problem=problem)
