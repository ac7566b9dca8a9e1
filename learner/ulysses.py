"""Ulysses sequence parallelism for Hugging Face causal LMs, without editing model files.

DeepSpeed-Ulysses (Jacobs et al., 2023, arXiv:2309.14509), the way verl runs it: the
learner's ``W`` ranks form a ``D x P`` mesh (``data_parallel x sequence_parallel``, rank
``d * P + p``); the ``P`` ranks of a sequence-parallel (SP) group take the same rows and
split their tokens.

A pass's rows are packed without padding into one sequence of ``T`` tokens, each row's
position ids restarting at 0, padded to a multiple of ``P`` (each padding token a sequence
of its own) and cut into ``P`` slices of ``C = T / P`` tokens: SP rank ``p`` runs the model
on tokens ``[p C, (p + 1) C)``. Every layer but attention works token by token, and RoPE
reads the slice's own position ids. Attention (``ulysses_attention``, which
``relay.learner.attention`` runs when a forward is given ``ulysses``) swaps the split:

    (C tokens, H heads) --all-to-all--> (T tokens, H / P heads)
    causal attention within each packed row, tokens [cu_seqlens[s], cu_seqlens[s + 1]):
    one variable-length kernel call on CUDA in bf16/fp16, one SDPA call (``is_causal``)
    per row elsewhere (``relay.learner.varlen``)
    (T tokens, H / P heads) --all-to-all--> (C tokens, H heads)

The rows' cumulative lengths ``cu_seqlens`` (flash-attention's varlen convention) say where
each row starts, so no T x T mask is ever built: attention memory grows with the longest
row, not with the packed length. (Nor does transformers build its own mask for the packed
forward: ``relay.learner.attention.relay_mask``.)

Per-token results (log-probs, entropies, values) are computed on the slice and gathered
(``gather_tokens``) into the row layout ``(B, L - 1)``, so every loss is computed as
without SP, identically on the ``P`` ranks. The gather's backward hands each rank the
gradient of its own slice only: summed over the SP group (FSDP's reduce-scatter over
every rank), the gradient is that of the whole sequence.

Heads: the query heads ``H`` must divide by ``P``. Key/value heads ``H_kv`` (grouped-query
attention) either divide by ``P``, or divide ``P``, when each is repeated ``P / H_kv``
times before the all-to-all (as verl does); anything else is refused by
``check_heads`` naming the key.
"""

from __future__ import annotations

import itertools
import math

import msgspec
import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig

from relay.learner.batch import TrainBatch
from relay.learner.shared_prompts import unsupported
from relay.learner.varlen import PackedSequences, packed_causal_attention

KEY = "actor.ulysses_sequence_parallel_size"


class SequenceParallel:
    """One SP group: ``size`` ranks that split a pass's tokens; ``rank`` is this one's
    place in it, ``group`` the process group."""

    def __init__(self, group: dist.ProcessGroup, size: int, rank: int) -> None:
        self.group, self.size, self.rank = group, size, rank


class Parallelism:
    """How the learner's ranks share the work: ``data_group`` holds the ranks that train
    on different rows (one per SP group, the same position in each; None: every rank),
    ``sequence`` this rank's SP group (None without sequence parallelism)."""

    def __init__(self, data_group: dist.ProcessGroup | None = None,
                 sequence: SequenceParallel | None = None) -> None:
        self.data_group, self.sequence = data_group, sequence


def learner_parallelism(device: torch.device, sp_size: int, *, packed: bool = False,
                        key: str = KEY,
                        ranks: str = "topology learner: len(hosts) x nproc_per_node"
                        ) -> Parallelism:
    """The ``D x P`` mesh of the initialised world for ``P = sp_size`` (module docstring);
    with ``packed`` and P = 1 each rank is an SP group of one, so its passes run packed
    without padding through the same path (SFT's ``use_remove_padding``). ValueError naming
    ``key`` and where the world size comes from (``ranks``) when ``P`` does not divide it."""
    world = dist.get_world_size()
    if sp_size == 1 and not packed:
        return Parallelism()
    if world % sp_size:
        raise ValueError(f"{key} = {sp_size} does not divide the learner's {world} ranks "
                         f"({ranks})")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world // sp_size, sp_size),
                            mesh_dim_names=("dp", "sp"))
    return Parallelism(data_group=mesh.get_group("dp"),
                       sequence=SequenceParallel(mesh.get_group("sp"), sp_size,
                                                 mesh.get_local_rank("sp")))


def check_heads(config: PretrainedConfig, sp_size: int) -> None:
    """ValueError naming ``KEY`` and the head counts when ``sp_size`` does not fit the
    model's attention heads (module docstring), or the model's attention is not plain
    causal softmax attention (``relay.learner.shared_prompts.unsupported``: families other than
    Llama, Qwen2, Qwen3 and Mistral, sliding windows)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % sp_size:
        raise ValueError(f"{KEY} = {sp_size} must divide the model's {heads} attention heads")
    if kv_heads % sp_size and sp_size % kv_heads:
        raise ValueError(f"{KEY} = {sp_size} must divide the model's {kv_heads} key/value "
                         f"heads or be a multiple of them")
    family = unsupported(config)  # the same plain causal attention shared prompts need
    if family:
        raise ValueError(f"{KEY} = {sp_size}: not for this model's {family}")


class PackedTokens(msgspec.Struct, frozen=True):
    """A pass's B rows packed into one sequence of T tokens (a multiple of the SP size)."""

    input_ids: torch.Tensor  # (1, T) long
    position_ids: torch.Tensor  # (1, T) long: restart at 0 with each row (and padding)
    labels: torch.Tensor  # (1, T) long: the next token of the same row (0 past a row's end)
    cu_seqlens: tuple[int, ...]  # (S + 1,): sequence s is tokens [cu_seqlens[s], cu_seqlens[s + 1])
    source: torch.Tensor  # (B, L - 1) long: the packed position of each row-grid entry
    valid: torch.Tensor  # (B, L - 1) bool: grid entries of a row's tokens (not padding)

    def local(self, tensor: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
        """This SP rank's slice of a (1, T, ...) tensor along the tokens."""
        width = tensor.shape[1] // sp.size
        return tensor[:, sp.rank * width:(sp.rank + 1) * width]

    def to_grid(self, per_token: torch.Tensor) -> torch.Tensor:
        """(1, T) per packed position -> (B, L - 1) row grid; 0 off the rows' tokens."""
        return torch.where(self.valid, per_token[0][self.source], 0.0)


def pack_tokens(batch: TrainBatch, multiple: int) -> PackedTokens:
    """Pack ``batch``'s rows (module docstring); grid entry (b, j) is row b's position j,
    which predicts its token j + 1. One host read (the rows' lengths, for the packed length
    and ``cu_seqlens``); every tensor is placed on the batch's device by tensor ops."""
    length = batch.attention_mask.sum(-1)
    lengths = length.tolist()  # the pass's one host read
    total = sum(lengths)
    padded = math.ceil(total / multiple) * multiple
    rows, width = batch.input_ids.shape
    grid = batch.response_mask.shape[1]
    column = torch.arange(width, device=length.device)[None]  # (1, L)
    place = (length.cumsum(0) - length)[:, None] + column  # the packed position of (b, j)
    # each row's tokens to their packed places, padding to a spare last slot (dropped)
    target = torch.where(column < length[:, None], place, padded).flatten()
    valid = column[:, :grid] < (length - 1)[:, None]  # (B, L - 1): j + 1 is in the row
    source = torch.where(valid, place[:, :grid], 0)

    def packed(index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """(1, T) with ``values`` at the packed positions ``index`` (``padded``: nowhere)."""
        return values.new_zeros(padded + 1).scatter_(0, index, values.flatten())[None, :padded]

    ends = itertools.accumulate(lengths + [1] * (padded - total))  # padding: one token each
    return PackedTokens(input_ids=packed(target, batch.input_ids),
                        position_ids=packed(target, column.expand(rows, -1)),
                        labels=packed(torch.where(valid, source, padded).flatten(),
                                      batch.input_ids[:, 1:grid + 1]),
                        cu_seqlens=(0, *ends), source=source, valid=valid)


def _all_to_all(tensor: torch.Tensor, scatter_dim: int, gather_dim: int,
                sp: SequenceParallel) -> torch.Tensor:
    """Cut ``tensor`` in ``sp.size`` along ``scatter_dim``, send piece p to SP rank p, and
    join the pieces received along ``gather_dim`` (in rank order)."""
    pieces = torch.stack(tensor.tensor_split(sp.size, dim=scatter_dim)).contiguous()
    received = torch.empty_like(pieces)
    dist.all_to_all_single(received, pieces, group=sp.group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """``_all_to_all`` whose backward is the inverse exchange."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scatter_dim: int, gather_dim: int,
                sp: SequenceParallel) -> torch.Tensor:
        ctx.dims, ctx.sp = (scatter_dim, gather_dim), sp
        return _all_to_all(tensor, scatter_dim, gather_dim, sp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad.contiguous(), gather_dim, scatter_dim, ctx.sp), None, None, None


class _GatherTokens(torch.autograd.Function):
    """(1, C, ...) slices of the SP group -> (1, T, ...); the backward keeps this rank's
    slice of the gradient (every rank computes the same loss from the gathered whole)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
        ctx.sp = sp
        pieces = [torch.empty_like(local) for _ in range(sp.size)]
        dist.all_gather(pieces, local.contiguous(), group=sp.group)
        return torch.cat(pieces, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        sp = ctx.sp
        return grad.tensor_split(sp.size, dim=1)[sp.rank].contiguous(), None


def gather_tokens(local: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """The SP group's per-token results (1, C, ...) joined into (1, T, ...)."""
    return _GatherTokens.apply(local, sp)


class UlyssesAttention(msgspec.Struct, frozen=True):
    """What ``ulysses_attention`` needs from outside the model: the group and where each
    packed sequence starts (``PackedTokens.cu_seqlens``, on the host and the device)."""

    sp: SequenceParallel
    sequences: PackedSequences


def ulysses_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      scaling: float | None = None, dropout: float = 0.0,
                      ulysses: UlyssesAttention | None = None,
                      sliding_window: int | None = None,
                      **_: object) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over a slice of a packed sequence: causal
    attention within each packed sequence (``relay.learner.varlen.packed_causal_attention``);
    ``attention_mask`` is not read (transformers builds none: ``relay.learner.attention``).

    ``query`` (1, H, C, D), ``key``/``value`` (1, H_kv, C, D) -> (1, C, H, D)."""
    if ulysses is None:
        raise RuntimeError("Ulysses attention runs only on packed slices "
                           "(relay.learner.ulysses.pack_tokens)")
    if sliding_window is not None:
        raise RuntimeError("Ulysses attention does not implement sliding-window attention")
    sp = ulysses.sp
    kv_heads = key.shape[1]
    if kv_heads % sp.size:  # fewer key/value heads than ranks: repeat each (check_heads)
        key = key.repeat_interleave(sp.size // kv_heads, dim=1)
        value = value.repeat_interleave(sp.size // kv_heads, dim=1)
    query, key, value = (_AllToAll.apply(t, 1, 2, sp)[0].transpose(0, 1)
                         for t in (query, key, value))  # (T, H / P, D)
    out = packed_causal_attention(query, key, value, ulysses.sequences,
                                  scale=query.shape[-1] ** -0.5 if scaling is None else scaling,
                                  dropout=dropout if module.training else 0.0)
    return _AllToAll.apply(out.transpose(0, 1)[None], 2, 1, sp).transpose(1, 2), None


def packed_inputs(batch: TrainBatch, sp: SequenceParallel
                  ) -> tuple[PackedTokens, dict[str, object]]:
    """Pack ``batch``; the packing and the keyword arguments of this rank's forward on its
    slice (``input_ids``, ``position_ids``, ``ulysses``), for a model attending with
    ``relay.learner.attention``."""
    packed = pack_tokens(batch, sp.size)
    sequences = PackedSequences.of(packed.cu_seqlens, device=packed.input_ids.device)
    return packed, dict(input_ids=packed.local(packed.input_ids, sp),
                        position_ids=packed.local(packed.position_ids, sp),
                        ulysses=UlyssesAttention(sp=sp, sequences=sequences))


def packed_forward(model: nn.Module, batch: TrainBatch, sp: SequenceParallel,
                   **inputs: object) -> tuple[PackedTokens, object]:
    """Pack ``batch``, run ``model`` on this rank's slice (``packed_inputs``, and
    ``inputs``); the packing and the model's output."""
    packed, slice_inputs = packed_inputs(batch, sp)
    return packed, model(**slice_inputs, **inputs)
