"""Where the lean engine keeps each sequence's keys and values, and how decode reads them.

The engine's sequences in flight sit in rows 0..active-1 (``relay.generators.lean_engine``). Two
layouts serve them behind one interface:

- ``SlotCache``: (layers, rows, kv_heads, max_len, head_dim). Row r's positions are one
  contiguous run, so decode attention reads the first ``active`` rows as one strided view,
  with no gather: the fastest read on a CPU (with every sequence admitted alike, the paged
  pool's gathers cost 8% of the lean engine's tokens/s on a 24M Qwen2 in bf16 and 27% on
  the tiny default model, batch 64, one thread). It holds every row at full length,
  ``rows x max_len`` positions; a row that moves (``move``) copies its positions.
- ``PagedCache``: a pool of ``blocks`` blocks of ``BLOCK_SIZE`` positions per layer and a
  block table per row (vLLM's paged layout). A sequence reserves the blocks of its prompt
  plus its ``max_new_tokens`` when it is admitted and gives them back when it retires, so
  memory follows the sequences' real lengths and a sequence never runs out mid-decode
  (nothing is preempted or truncated: a group waits in the queue until blocks are free). A
  row that moves moves its table row, not its positions. Decode attention gathers the active
  rows' blocks (``index_select``) per layer.

``plan_cache`` chooses: the slot cache when the budget holds ``rows x max_len`` positions
(always on the CPU, which has no free-memory query: today's sizing), else the paged cache.
On a GPU the budget is what ``gpu_memory_utilization`` (verl's key) of the memory free at
start leaves after the weights and the decode workspace (``workspace_bytes``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

BLOCK_SIZE = 16
"""Positions per block of the paged cache (vLLM's default block size)."""

SAMPLING_BUFFERS = 8
"""(rows, vocab) fp32 tensors alive at once while a step's tokens are drawn: the logits in
fp32, the tempered and filtered logits, top-p's sorted logits, order (int64: two) and
cumulative mass, the log-softmax and the inverse CDF (``relay.generators.sampling``)."""


@dataclass(frozen=True)
class CacheShape:
    """What the cache needs to know of the model and the engine."""

    layers: int
    kv_heads: int
    heads: int
    head_dim: int
    rows: int  # sequences in flight at most (rollout.max_num_seqs)
    max_len: int  # positions of one sequence: prompt + response at most

    def bytes_per_position(self, dtype: torch.dtype) -> int:
        """Keys and values of one position in every layer: 2 * layers * kv_heads * head_dim
        * itemsize."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype.itemsize


@dataclass(frozen=True)
class CachePlan:
    """The cache a decoder allocates: ``blocks`` of ``BLOCK_SIZE`` positions (paged), or
    None for the slot cache; ``prefill_tokens`` bounds the padded prompt tokens of one
    prefill."""

    blocks: int | None
    prefill_tokens: int


def workspace_bytes(shape: CacheShape, *, hidden: int, intermediate: int, vocab: int,
                    prefill_tokens: int, dtype: torch.dtype, cache_dtype: torch.dtype) -> int:
    """An upper bound of the memory a prefill or decode step allocates besides weights and
    cache, with T = prefill_tokens, R = rows, L = max_len, s = dtype's itemsize:

        prefill  T * (3 hidden + (2 heads + 2 kv_heads) head_dim + 3 intermediate) * s
        sampling R * vocab * 4 * SAMPLING_BUFFERS
        decode   R * L * (2 kv_heads head_dim * cache itemsize + 2 heads * 4)

    (the residual stream, norm and attention outputs, q/k/v, gate-up and its product; the
    step's logits and sampling buffers; one layer's gathered keys and values and its fp32
    scores and weights, every row at full length)."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    prefill = prefill_tokens * (3 * hidden + q + 2 * kv + q + 3 * intermediate) * dtype.itemsize
    sampling = shape.rows * vocab * 4 * SAMPLING_BUFFERS
    decode = shape.rows * shape.max_len * (2 * kv * cache_dtype.itemsize + 2 * shape.heads * 4)
    return prefill + sampling + decode


def plan_cache(shape: CacheShape, *, cache_dtype: torch.dtype, budget_bytes: int | None,
               prefill_tokens: int) -> CachePlan:
    """The slot cache when ``budget_bytes`` is None or holds ``rows x max_len`` positions,
    else ``floor(budget / (BLOCK_SIZE * bytes_per_position))`` blocks. Raises
    ``ValueError`` when the budget holds less than one full-length sequence."""
    per_position = shape.bytes_per_position(cache_dtype)
    if budget_bytes is None or budget_bytes >= shape.rows * shape.max_len * per_position:
        return CachePlan(blocks=None, prefill_tokens=prefill_tokens)
    blocks = max(budget_bytes, 0) // (BLOCK_SIZE * per_position)
    if blocks < blocks_for(shape.max_len):
        raise ValueError(
            f"the KV cache budget, {budget_bytes / 2**30:.2f} GiB, holds {blocks * BLOCK_SIZE} "
            f"positions, less than one sequence's {shape.max_len}: raise "
            "gpu_memory_utilization (the generator's lean section in the topology, or "
            "actor_rollout_ref.rollout.gpu_memory_utilization), or shorten the prompt and "
            "response lengths")
    return CachePlan(blocks=blocks, prefill_tokens=prefill_tokens)


def budget_from_free_memory(free_bytes: int, utilization: float, weights_bytes: int,
                            workspace: int) -> int:
    """The cache's bytes on a GPU: free_bytes * utilization - weights - workspace (free_bytes
    measured before the weights were allocated)."""
    return int(free_bytes * utilization) - weights_bytes - workspace


def blocks_for(positions: int) -> int:
    """Blocks holding ``positions`` positions: ceil(positions / BLOCK_SIZE)."""
    return -(-positions // BLOCK_SIZE)


@dataclass
class PrefillPlan:
    """Where one prefill's keys and values go, computed once for every layer."""

    rows: slice  # the rows the prefill fills
    repeats: torch.Tensor  # (P,) rows per prompt (its samples)
    width: int  # padded prompt width W
    source: torch.Tensor | None = None  # paged: (N,) index into the (P * W) prompt positions
    target: torch.Tensor | None = None  # paged: (N,) index into the pool's positions


@dataclass
class DecodePlan:
    """Where one decode step writes and reads, computed once for every layer."""

    active: int
    rows: torch.Tensor  # (A,) 0..active-1
    positions: torch.Tensor  # (A,) the position each row writes
    context: int  # C: positions 0..C-1 are read
    mask: torch.Tensor  # additive, 0 or -inf: (A, 1, 1, C) slot, (1, A, 1, C) paged
    target: torch.Tensor | None = None  # paged: (A,) index into the pool's positions
    blocks: torch.Tensor | None = None  # paged: (A * ceil(C / BLOCK_SIZE),) blocks read


class SlotCache:
    """Every row at full length, contiguous per row (module docstring)."""

    def __init__(self, shape: CacheShape, dtype: torch.dtype, device: torch.device) -> None:
        self.shape, self.dtype, self.device = shape, dtype, device
        size = (shape.layers, shape.rows, shape.kv_heads, shape.max_len, shape.head_dim)
        self.k = torch.zeros(size, dtype=dtype, device=device)
        self.v = torch.zeros(size, dtype=dtype, device=device)

    # -- room ---------------------------------------------------------------------------

    def capacity_error(self, n: int, positions: int) -> str | None:
        """Why ``n`` sequences of ``positions`` positions could never be held together, or
        None (rows are the engine's to count)."""
        return None

    def can_hold(self, positions: Sequence[int]) -> bool:
        return True

    def reserve(self, first_row: int, positions: Sequence[int]) -> None:
        pass

    def release(self, rows: Sequence[int]) -> None:
        pass

    def move(self, source: Sequence[int], target: Sequence[int], length: int) -> None:
        """Rows ``source`` become rows ``target``: their first ``length`` positions move."""
        src = torch.tensor(source, dtype=torch.long, device=self.device)
        dst = torch.tensor(target, dtype=torch.long, device=self.device)
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    # -- prefill ------------------------------------------------------------------------

    def plan_prefill(self, first_row: int, samples: Sequence[int], lengths: Sequence[int],
                     width: int) -> PrefillPlan:
        rows = slice(first_row, first_row + sum(samples))
        repeats = torch.tensor(samples, dtype=torch.long, device=self.device)
        return PrefillPlan(rows=rows, repeats=repeats, width=width)

    def write_prompts(self, layer: int, plan: PrefillPlan, k: torch.Tensor,
                      v: torch.Tensor) -> None:
        """k, v (P, Hkv, W, D) into every sample's row, padding included (the decode
        overwrites it); the slice assignment casts to the cache's dtype."""
        self.k[layer, plan.rows, :, :plan.width] = k.repeat_interleave(plan.repeats, dim=0)
        self.v[layer, plan.rows, :, :plan.width] = v.repeat_interleave(plan.repeats, dim=0)

    # -- decode -------------------------------------------------------------------------

    def plan_decode(self, positions: torch.Tensor, active: int, context: int) -> DecodePlan:
        rows = torch.arange(active, device=self.device)
        return DecodePlan(active=active, rows=rows, positions=positions, context=context,
                          mask=_causal_mask(positions, context)[:, None, None])

    def write(self, layer: int, plan: DecodePlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (A, Hkv, D) at each row's position."""
        self.k[layer, plan.rows, :, plan.positions] = k.to(self.dtype)
        self.v[layer, plan.rows, :, plan.positions] = v.to(self.dtype)

    def attend(self, layer: int, plan: DecodePlan, q: torch.Tensor, scale: float) -> torch.Tensor:
        """softmax(q K^T * scale + mask) V over each row's positions 0..C-1: q (A, Hkv, G, D)
        -> (A, Hkv, G, D), scores and softmax in fp32, products in the cache's dtype."""
        keys = self.k[layer, :plan.active, :, :plan.context]  # (A, Hkv, C, D): a view
        values = self.v[layer, :plan.active, :, :plan.context]
        return _attention(q.to(self.dtype), keys, values, plan.mask, scale)


class PagedCache:
    """A pool of blocks and a block table per row (module docstring)."""

    def __init__(self, shape: CacheShape, blocks: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.shape, self.blocks, self.dtype, self.device = shape, blocks, dtype, device
        # zeros: a masked position must hold a finite number (0 * inf is nan)
        size = (shape.layers, shape.kv_heads, blocks, BLOCK_SIZE, shape.head_dim)
        self.k = torch.zeros(size, dtype=dtype, device=device)
        self.v = torch.zeros(size, dtype=dtype, device=device)
        self.table = torch.zeros((shape.rows, blocks_for(shape.max_len)), dtype=torch.long,
                                 device=device)
        self._free = list(range(blocks - 1, -1, -1))  # pop() hands out low ids first
        self._owned: list[list[int]] = [[] for _ in range(shape.rows)]

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    # -- room ---------------------------------------------------------------------------

    def capacity_error(self, n: int, positions: int) -> str | None:
        """Why ``n`` sequences of ``positions`` positions could never be held together (they
        would wait forever), or None."""
        needed = n * blocks_for(positions)
        if needed <= self.blocks:
            return None
        return (f"{n} sequences of {positions} positions need {needed} KV cache blocks of "
                f"{BLOCK_SIZE}, and the cache holds {self.blocks}: raise "
                "gpu_memory_utilization (the generator's lean section in the topology) or "
                "lower rollout.n or the prompt and response lengths")

    def can_hold(self, positions: Sequence[int]) -> bool:
        """Whether the free blocks hold new sequences of ``positions`` positions each."""
        return sum(blocks_for(p) for p in positions) <= len(self._free)

    def reserve(self, first_row: int, positions: Sequence[int]) -> None:
        """Give rows first_row, first_row + 1, ... the blocks of ``positions[i]`` positions."""
        table = []
        for offset, count in enumerate(positions):
            owned = [self._free.pop() for _ in range(blocks_for(count))]
            self._owned[first_row + offset] = owned
            table.append(owned + [0] * (self.table.shape[1] - len(owned)))
        self.table[first_row:first_row + len(positions)] = torch.tensor(
            table, dtype=torch.long, device=self.device)

    def release(self, rows: Sequence[int]) -> None:
        """The blocks of ``rows`` (retired sequences) go back to the pool."""
        for row in rows:
            self._free.extend(reversed(self._owned[row]))
            self._owned[row] = []

    def move(self, source: Sequence[int], target: Sequence[int], length: int) -> None:
        """Rows ``source`` become rows ``target``: their table rows move (``length`` unused:
        no position is copied)."""
        del length
        for src, dst in zip(source, target, strict=True):
            self._owned[dst], self._owned[src] = self._owned[src], []
        src = torch.tensor(source, dtype=torch.long, device=self.device)
        dst = torch.tensor(target, dtype=torch.long, device=self.device)
        self.table[dst] = self.table[src]

    # -- prefill ------------------------------------------------------------------------

    def plan_prefill(self, first_row: int, samples: Sequence[int], lengths: Sequence[int],
                     width: int) -> PrefillPlan:
        """Every real prompt position (padding is not written) of every sample's row:
        source p * W + t, target block(t // BLOCK_SIZE) * BLOCK_SIZE + t % BLOCK_SIZE."""
        source, target = [], []
        row = first_row
        for prompt, (n, length) in enumerate(zip(samples, lengths, strict=True)):
            for _ in range(n):
                owned = self._owned[row]
                source += range(prompt * width, prompt * width + length)
                target += [owned[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE
                           for t in range(length)]
                row += 1
        return PrefillPlan(
            rows=slice(first_row, row), width=width,
            repeats=torch.tensor(samples, dtype=torch.long, device=self.device),
            source=torch.tensor(source, dtype=torch.long, device=self.device),
            target=torch.tensor(target, dtype=torch.long, device=self.device))

    def write_prompts(self, layer: int, plan: PrefillPlan, k: torch.Tensor,
                      v: torch.Tensor) -> None:
        """k, v (P, Hkv, W, D): each real position into its block."""
        for pool, new in ((self.k, k), (self.v, v)):
            positions = new.transpose(1, 2).flatten(0, 1).index_select(0, plan.source)
            pool[layer].view(self.shape.kv_heads, -1, self.shape.head_dim).index_copy_(
                1, plan.target, positions.transpose(0, 1).to(self.dtype))

    # -- decode -------------------------------------------------------------------------

    def plan_decode(self, positions: torch.Tensor, active: int, context: int) -> DecodePlan:
        rows = torch.arange(active, device=self.device)
        block = self.table[rows, positions // BLOCK_SIZE]
        read = self.table[:active, :blocks_for(context)].reshape(-1)
        return DecodePlan(active=active, rows=rows, positions=positions, context=context,
                          mask=_causal_mask(positions, context)[None, :, None],
                          target=block * BLOCK_SIZE + positions % BLOCK_SIZE, blocks=read)

    def write(self, layer: int, plan: DecodePlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (A, Hkv, D) at each row's position, in its block."""
        for pool, new in ((self.k, k), (self.v, v)):
            pool[layer].view(self.shape.kv_heads, -1, self.shape.head_dim).index_copy_(
                1, plan.target, new.transpose(0, 1).to(self.dtype))

    def attend(self, layer: int, plan: DecodePlan, q: torch.Tensor, scale: float) -> torch.Tensor:
        """As ``SlotCache.attend``, over each row's blocks gathered into (Hkv, A, C, D)."""
        heads, dim = self.shape.kv_heads, self.shape.head_dim
        keys = self.k[layer].index_select(1, plan.blocks).view(heads, plan.active, -1, dim)
        values = self.v[layer].index_select(1, plan.blocks).view(heads, plan.active, -1, dim)
        keys, values = keys[:, :, :plan.context], values[:, :, :plan.context]
        attended = _attention(q.to(self.dtype).transpose(0, 1), keys, values, plan.mask, scale)
        return attended.transpose(0, 1)  # (A, Hkv, G, D)


KVCache = SlotCache | PagedCache


def _causal_mask(positions: torch.Tensor, context: int) -> torch.Tensor:
    """(A, C) fp32: 0 where position c <= positions[a], -inf after."""
    hidden = torch.arange(context, device=positions.device)[None] > positions[:, None]
    return torch.zeros(hidden.shape, dtype=torch.float32, device=positions.device) \
        .masked_fill(hidden, float("-inf"))


def _attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
               scale: float) -> torch.Tensor:
    """softmax((q K^T).float() * scale + mask) V, the weights cast back to V's dtype; q
    (..., G, D), keys and values (..., C, D)."""
    scores = (q @ keys.transpose(-1, -2)).float() * scale + mask
    weights = torch.softmax(scores, dim=-1).to(values.dtype)
    return weights @ values
