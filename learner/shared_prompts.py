"""One sequence per prompt group: the prompt once, its responses after it.

The ``n`` samples of a GRPO group share their prompt. Run as ``n`` rows, the prompt's ``p``
tokens go through the model ``n`` times. Packed, the rows of a group that share a prompt
become one sequence

    prompt, response_1, ..., response_k

with position ids ``0..p-1`` for the prompt and ``p..p+l_i-1`` for every response (they
restart after the prompt). Every layer but attention works token by token, so it runs the
prompt once. Attention (``shared_prompt_attention``, which ``relay.learner.attention`` runs when
a forward is given ``shared_prompt_rows``) goes back to rows, of two kinds: a prompt row
per sequence holds the prompt's queries, keys and values, and a response row per sample
holds the queries of ``response_i`` and the keys and values of ``prompt, response_i``
(gathered from the packed sequence), causal by position. So each token sees exactly what
it sees in the row layout, at no more than the attention cost of the row layout (a
prompt's queries are asked once, in rows padded only to the longest prompt), and the
gradient reaching a shared prompt position is the sum over the group's
responses, as it is across rows: the update is the same (up to float summation order) for
``p (k - 1)`` fewer tokens a group through every other layer. This is the shared-prefix
forward of Prefix Grouper (Liu et al., 2025, arXiv:2506.05433).

``pack`` builds the packed inputs of a pass: all its groups in one sequence, and the N
packed positions whose logits predict a response token under the response mask
(``PackedRows.predictors``: the forward computes logits there only, never over the prompts
nor over a multi-turn episode's inserted tokens, which are context only);
``PackedRows.to_grid`` puts per-prediction values (log-probs, entropies) back in the row
layout ``(B, L - 1)``, so losses are computed exactly as before. ``unsupported`` says which
models cannot be run this way.
"""

from __future__ import annotations

import msgspec
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from relay.learner.batch import TrainBatch, host_index

# families whose attention is plain causal softmax attention over RoPE'd queries and keys
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
# Rows with at most this many keys attend through explicit matmuls on the CPU (measured
# there: 3-5x faster than SDPA's CPU kernel forward + backward at 50-128 keys, slower
# from about 300 keys on)
EXPLICIT_ATTENTION_MAX_KEYS = 256


class AttentionRows(msgspec.Struct, frozen=True):
    """Where row attention reads and writes, for packed sequences (S of length Lp, flattened
    to S * Lp positions; ``pack`` makes one) and R rows of at most Q queries and K keys.
    Every layer of a pass reads the same layout, so what can be is computed here, once."""

    query_index: torch.Tensor  # (R, Q) long: the packed position of each query (padding: 0)
    query_valid: torch.Tensor  # (R, Q) bool
    key_index: torch.Tensor  # (R, K) long: the packed position of each key (padding: 0)
    attend: torch.Tensor  # (R, 1, Q, K) bool: query q may attend to key k
    # (R, 1, Q, K) float32, 0 where ``attend``, -inf elsewhere: for the explicit CPU path
    # (``row_attention``), so only for rows of at most EXPLICIT_ATTENTION_MAX_KEYS keys
    bias: torch.Tensor | None
    valid_queries: torch.Tensor  # (n,) long: the flat (R * Q) index of each real query
    query_targets: torch.Tensor  # (n,) long: its packed position


class PackedRows(msgspec.Struct, frozen=True):
    """Packed inputs of a pass: B rows of length L as one sequence of T tokens, and the N
    positions whose logits predict a response token."""

    input_ids: torch.Tensor  # (1, T) long
    position_ids: torch.Tensor  # (1, T) long
    rows: tuple[AttentionRows, AttentionRows]  # the prompts' rows, the responses' rows
    source: torch.Tensor  # (B, L) long: the packed position of each row position
    # (N,) long: packed positions whose logits predict a token of the response mask
    predictors: torch.Tensor
    grid_rows: torch.Tensor  # (N,) long: where each prediction sits in the (B, L - 1) grid
    grid_columns: torch.Tensor  # (N,) long

    def labels(self, batch: TrainBatch) -> torch.Tensor:
        """(N,) the response token each of ``predictors`` predicts."""
        return batch.input_ids[self.grid_rows, self.grid_columns + 1]

    def to_grid(self, values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """(N,) values per prediction -> (B, L - 1) in the row layout, zero off the response
        mask (differentiable)."""
        return values.new_zeros(shape).index_put((self.grid_rows, self.grid_columns), values)


def unsupported(config: PretrainedConfig) -> str | None:
    """Why a model cannot share prompts (its attention is not plain causal attention), or
    None when it can."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return (f"model_type {config.model_type!r} (supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)})")
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "use_sliding_window", False) or any(
            kind != "full_attention" for kind in layer_types) or (
            config.model_type == "mistral" and getattr(config, "sliding_window", None)):
        return "sliding-window attention"
    return None


def pack(batch: TrainBatch) -> PackedRows:
    """Pack the rows of ``batch`` into one sequence: rows of one group with identical prompt
    tokens share a stretch of it (their prompt once, then each response); any other row gets
    a stretch of its own.

    Only the grouping is a Python loop over rows, on the host values of one read (each row's
    group, lengths, and whether its prompt is its group's first row's, compared on the
    batch's device); every position is placed by tensor ops on the batch's device: row r's
    position j sits at packed position ``base[r] + j`` in its prompt and
    ``start[r] + j - p[r]`` in its response (``source``); a sequence's prompt queries are
    asked by its prompt row, each response's by its response row."""
    device = batch.input_ids.device
    total = batch.attention_mask.sum(-1)
    response = batch.response_lengths
    prompt = total - response
    rows, row_width = batch.attention_mask.shape
    column = torch.arange(row_width, device=device)[None]  # (1, L)
    in_prompt = column < prompt[:, None]
    in_row = column < total[:, None]
    groups, prompts, lengths, same_prompt, policy = torch.stack(
        [batch.group_ids, prompt, response, _shares_first_prompt(batch, prompt, in_prompt),
         batch.response_mask.sum(-1).long()]).tolist()  # the pass's one host read
    sequences: dict[tuple, list[int]] = {}
    for row, (group, p) in enumerate(zip(groups, prompts)):
        # a row that differs from its group's first (rare) is keyed by its own tokens
        key = (group,) if same_prompt[row] else (group, *batch.input_ids[row, :p].tolist())
        sequences.setdefault(key, []).append(row)
    base, start, first_rows = [0] * rows, [0] * rows, []  # packed starts of prompt, response
    offset = 0
    for members in sequences.values():
        first_rows.append(members[0])
        sequence_base, offset = offset, offset + prompts[members[0]]
        for row in members:
            base[row] = sequence_base
            start[row], offset = offset, offset + lengths[row]
    base_t, start_t, firsts = host_index(base + start + first_rows, device).split(
        [rows, rows, len(first_rows)])
    source = torch.where(in_prompt, base_t[:, None] + column,
                         torch.where(in_row, start_t[:, None] + column - prompt[:, None],
                                     base_t[:, None]))
    # every real position to its packed place, padding to a spare last slot (dropped); a
    # shared prompt's rows write the same values to the same places
    target = torch.where(in_row, source, offset).flatten()
    input_ids = batch.input_ids.new_zeros(offset + 1).scatter_(
        0, target, batch.input_ids.flatten())[None, :offset]
    position_ids = batch.input_ids.new_zeros(offset + 1).scatter_(
        0, target, column.expand(rows, -1).flatten())[None, :offset]
    # row position p - 1 + i predicts response token i (as in relay.learner.batch.collate)
    grid_rows, within = _ranges(response, sum(lengths))
    grid_columns = prompt[grid_rows] - 1 + within
    if sum(policy) < len(grid_rows):  # multi-turn: inserted tokens are predicted by nobody
        grid_rows, grid_columns = _on_mask(batch.response_mask, grid_rows, grid_columns,
                                           sum(policy))
    first_prompts = [prompts[row] for row in first_rows]
    prompt_rows = _attention_rows(source[firsts], first_query=torch.zeros_like(firsts),
                                  queries=prompt[firsts], keys=prompt[firsts],
                                  sizes=(max(first_prompts, default=0), max(first_prompts,
                                                                            default=0),
                                         sum(first_prompts)))
    response_rows = _attention_rows(source, first_query=prompt, queries=response, keys=total,
                                    sizes=(max(lengths, default=0),
                                           max(map(sum, zip(prompts, lengths)), default=0),
                                           sum(lengths)))
    return PackedRows(input_ids=input_ids, position_ids=position_ids, source=source,
                      rows=(prompt_rows, response_rows),
                      predictors=source[grid_rows, grid_columns], grid_rows=grid_rows,
                      grid_columns=grid_columns)


def _shares_first_prompt(batch: TrainBatch, prompt: torch.Tensor,
                         in_prompt: torch.Tensor) -> torch.Tensor:
    """(B,) long: 1 where a row's prompt (length and tokens) is that of the first row of its
    group in the batch."""
    first = (batch.group_ids[:, None] == batch.group_ids[None, :]).long().argmax(-1)
    same_tokens = ((batch.input_ids == batch.input_ids[first]) | ~in_prompt).all(-1)
    return (same_tokens & (prompt == prompt[first])).long()


def _on_mask(mask: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor,
             count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid entries (``rows``, ``columns``) where ``mask`` (B, L - 1) is set, in their
    order; ``count`` of them, known on the host, so no host sync (a stable sort puts them
    first)."""
    dropped = (mask[rows, columns] == 0).to(torch.uint8)
    kept = dropped.argsort(stable=True)[:count]
    return rows[kept], columns[kept]


def _ranges(counts: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Items listed row by row, ``counts[r]`` of them in row r (``total`` in all, known on
    the host): (row, index within the row) of each, both (total,) long on ``counts``'s
    device, computed without a host sync."""
    row = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts,
                                  output_size=total)
    starts = counts.cumsum(0) - counts
    return row, torch.arange(total, device=counts.device) - starts[row]


def _attention_rows(source: torch.Tensor, *, first_query: torch.Tensor, queries: torch.Tensor,
                    keys: torch.Tensor, sizes: tuple[int, int, int]) -> AttentionRows:
    """Rows whose keys are their row positions ``0..keys[r]-1`` and whose queries are row
    positions ``first_query[r]..first_query[r]+queries[r]-1`` (``source`` maps row positions
    to packed positions); ``sizes``: the most queries and keys of a row and the number of
    queries, read on the host by ``pack``. Every row has at least one key (its first prompt
    token), which its padding queries attend to."""
    row_width = source.shape[1]
    most_keys, total_queries = sizes[1], sizes[2]
    most_queries = max(sizes[0], 1)
    index = torch.arange(most_queries, device=source.device)[None]
    query_valid = index < queries[:, None]
    query_position = first_query[:, None] + index
    query_index = torch.where(query_valid,
                              source.gather(1, query_position.clamp(max=row_width - 1)), 0)
    query_position = torch.where(query_valid, query_position, 0)
    key_position = torch.arange(most_keys, device=source.device)
    key_valid = key_position[None, :] < keys[:, None]
    attend = key_valid[:, None, :] & (key_position[None, None, :] <= query_position[:, :, None])
    query_rows, query_within = _ranges(queries, total_queries)
    valid_queries = query_rows * most_queries + query_within  # flat (R * Q) index
    return AttentionRows(query_index=query_index, query_valid=query_valid,
                         key_index=source[:, :most_keys], attend=attend[:, None],
                         bias=_additive_mask(attend[:, None])
                         if most_keys <= EXPLICIT_ATTENTION_MAX_KEYS else None,
                         valid_queries=valid_queries,
                         query_targets=query_index.flatten()[valid_queries])


def shared_prompt_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0,
                            shared_prompt_rows: tuple[AttentionRows, ...] | None = None,
                            sliding_window: int | None = None,
                            **_: object) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over packed sequences, computed in rows.

    ``query`` (S, H, Lp, D), ``key``/``value`` (S, Hkv, Lp, D) -> (S, Lp, H, D). Packed
    padding positions get zeros (nothing reads them)."""
    if shared_prompt_rows is None:
        raise RuntimeError("shared-prompt attention runs only on packed prompt groups "
                           "(relay.learner.shared_prompts.pack)")
    if sliding_window is not None:
        raise RuntimeError("shared-prompt attention does not implement sliding-window "
                           "attention")
    sequences, heads, width, dim = query.shape
    flat = [states.transpose(1, 2).reshape(sequences * width, -1)
            for states in (query, key, value)]  # (S * Lp, h * D)
    packed = flat[0].new_zeros(sequences * width, heads * dim)
    for layout in shared_prompt_rows:
        picked = _attend_rows(*flat, layout, heads, dim,
                              scale=dim ** -0.5 if scaling is None else scaling,
                              dropout=dropout if module.training else 0.0)
        packed = packed.index_copy(0, layout.query_targets, picked)
    return packed.view(sequences, width, heads, dim), None


def _attend_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 layout: AttentionRows, heads: int, dim: int, *, scale: float,
                 dropout: float) -> torch.Tensor:
    """``row_attention`` over the rows of ``layout``, from packed (S * Lp, h * D) states: the
    outputs (n, H * D) of its n real queries. Gathers are one ``index_select`` each (their
    backward an ``index_add``, far cheaper on the CPU than advanced indexing's accumulating
    ``index_put``)."""
    def gather(states: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """(S * Lp, h * D) at packed positions ``index`` (R, n) -> (R, h, n, D)."""
        return states.index_select(0, index.flatten()).view(*index.shape, -1, dim) \
            .transpose(1, 2)

    rows, queries = layout.query_index.shape
    out = row_attention(gather(query, layout.query_index), gather(key, layout.key_index),
                        gather(value, layout.key_index), layout.attend, scale=scale,
                        dropout=dropout, bias=layout.bias)
    return out.transpose(1, 2).reshape(rows * queries, heads * dim) \
        .index_select(0, layout.valid_queries)


def row_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attend: torch.Tensor, *, scale: float, dropout: float = 0.0,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale, over the keys ``attend`` allows) v for R rows:
    ``query`` (R, H, Q, D), ``key``/``value`` (R, Hkv, K, D) with H a multiple of Hkv (query
    head h reads key/value head h // (H / Hkv), as transformers' ``repeat_kv``), ``attend``
    (R, 1, Q, K) bool; ``bias``, when given, is ``attend`` as an additive float mask (0 or
    -inf), computed once for all layers; returns (R, H, Q, D) in the query's dtype.

    Short rows on the CPU (K <= ``EXPLICIT_ATTENTION_MAX_KEYS``, no dropout) are computed
    with explicit matmuls in the inputs' dtype, the scores scaled, masked and softmaxed in
    fp32, the weights cast back for the product with v: in fp32 everything is fp32; in bf16
    this is transformers' eager attention (3x faster than fp32 matmuls here, whose small
    batched products run at a fifth of bf16's rate on AVX-512-bf16 and AMX CPUs). SDPA's CPU
    kernel spends far longer on bookkeeping than on arithmetic at these sizes, mostly in its
    backward. Everything else goes through SDPA. Every query must be allowed at least one
    key (``pack``'s padding queries attend to their row's first key)."""
    rows, heads, queries, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    if query.device.type != "cpu" or keys > EXPLICIT_ATTENTION_MAX_KEYS or dropout:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attend,
                                              dropout_p=dropout, scale=scale,
                                              enable_gqa=kv_heads != heads)
    if bias is None:
        bias = _additive_mask(attend)
    group = heads // kv_heads
    grouped = query.reshape(rows, kv_heads, group * queries, dim)
    scores = (grouped @ key.transpose(-1, -2)).view(rows, kv_heads, group, queries, keys)
    scores = scores.float() * scale + bias[:, :, None]
    weights = torch.softmax(scores, dim=-1).to(value.dtype)
    out = weights.view(rows, kv_heads, group * queries, keys) @ value
    return out.view(rows, heads, queries, dim).to(query.dtype)


def _additive_mask(attend: torch.Tensor) -> torch.Tensor:
    """A bool mask as float32 to add to scores: 0 where ``attend``, -inf elsewhere."""
    return torch.zeros(attend.shape, device=attend.device).masked_fill(~attend, float("-inf"))
