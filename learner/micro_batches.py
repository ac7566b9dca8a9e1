"""How a global batch is cut: mini-batches for the optimizer steps, micro-batches per rank.

Every rank holds the whole batch (rank 0 broadcast it). A mini-batch is a run of whole
prompt groups: one optimizer step each. Within a mini-batch, rank r of W takes rows
r, r + W, r + 2W, ..., orders them by length and cuts them into micro-batches: one forward
(and backward) pass each, padded only to its own longest row, so rows of like length share
a pass and little compute goes to padding. The cut is either

- by count (``micro_batch_size`` rows at most, verl's ``ppo_micro_batch_size_per_gpu``), or
- by token budget (``max_token_len``: rows x longest row <= budget per pass, verl's
  ``use_dynamic_bsz`` with ``ppo_max_token_len_per_gpu``); a row longer than the budget
  gets a pass of its own.

With ``share_prompts`` (``actor.share_prompts``) the rows of a prompt group stay together so
their prompt can be computed once (``relay.learner.shared_prompts``): rank r takes groups
r, r + W, ..., orders them by packed length (prompt + all responses) and fills passes with
whole groups, up to ``micro_batch_size`` rows or ``max_token_len`` packed tokens (sequences
x longest sequence) a pass; a group bigger than that is split, and its parts still share
the prompt within their pass.

Losses are normalised by mini-batch totals, so how rows are grouped into passes changes no
gradient. FSDP2's collectives need every rank to make the same number of passes, so the
count is the largest any rank needs, and a rank that has no rows left makes a stand-in pass
over one real row with ``weight`` 0: every loss and diagnostic of the pass is multiplied by
the weight, so it changes nothing.

Under Ulysses sequence parallelism (``relay.learner.ulysses``) "rank" above means a data-parallel
rank (``group``: one rank of each SP group); the ranks of an SP group take the same passes
and split their tokens (``sp``). ``max_token_len`` stays a budget per GPU, as verl's
``ppo_max_token_len_per_gpu`` is: each of the P ranks of an SP group runs 1/P of a pass's
tokens, so the group's pass may hold P times as many,

    rows x longest row <= max_token_len x P

(verl's ``dp_actor``: ``max_token_len = ppo_max_token_len_per_gpu *
ulysses_sequence_parallel_size``; the critic's passes scale the same way). FSDP2 averages
gradients over every rank, so a pass's loss is multiplied by ``grad_scale``, the whole
world's size, before its backward.

The actor's update, its up-front log-prob passes, the critic and the implicit PRM all walk
their batches with ``MicroBatches``.

The cut is decided on the host from one read of the mini-batch's lengths (and group ids with
``share_prompts``); the rows of each pass are slices of index tensors on the batch's device,
and a pass's width is known without reading its mask again, so walking a mini-batch costs
one host sync (two when the ranks compare their pass counts), whatever its number of passes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import msgspec
import torch
import torch.distributed as dist

from relay.learner.batch import TrainBatch
from relay.learner.ulysses import SequenceParallel


class MiniBatchTotals(msgspec.Struct, frozen=True):
    """A mini-batch's loss denominators: its response tokens and the rows that have any."""

    tokens: float
    sequences: int


def mini_batch_totals(batch: TrainBatch, minis: list[torch.Tensor]) -> list[MiniBatchTotals]:
    """``MiniBatchTotals`` of each mini-batch (row indices), read in one host sync."""
    if not minis:
        return []
    masks = [batch.response_mask[mini] for mini in minis]
    counts = torch.stack([torch.stack([mask.sum(), (mask.sum(-1) > 0).sum().to(mask.dtype)])
                          for mask in masks]).tolist()
    return [MiniBatchTotals(tokens=tokens, sequences=int(sequences))
            for tokens, sequences in counts]


class _Chunk(msgspec.Struct, frozen=True):
    """A pass's rows (indices on the batch's device) and its longest row's length (None:
    not read yet)."""

    rows: torch.Tensor
    width: int | None


class MicroBatch(msgspec.Struct, frozen=True):
    """One pass: ``rows`` of the batch (indices) and ``part``, those rows selected;
    ``weight`` is 1.0, or 0.0 for a stand-in pass whose results must not count."""

    rows: torch.Tensor
    part: TrainBatch
    weight: float

    def owned(self) -> bool:
        """Whether this pass's rows are this rank's to fill in batch-wide results."""
        return self.weight > 0


class MicroBatches:
    """This rank's walk through a batch: ``mini_batches`` then ``passes`` over each.

    ``group``: the data-parallel ranks (None: every rank), over which batch-wide results are
    summed; ``sp``: this rank's sequence-parallel group, None without SP. ``max_token_len``
    is per GPU: an SP group's passes hold ``sp.size`` times as many tokens (module
    docstring)."""

    def __init__(self, *, groups_per_mini_batch: int, micro_batch_size: int,
                 max_token_len: int | None = None, share_prompts: bool = False,
                 group: dist.ProcessGroup | None = None,
                 sp: SequenceParallel | None = None) -> None:
        self.groups_per_mini_batch = groups_per_mini_batch
        self.micro_batch_size = micro_batch_size
        scale = sp.size if sp is not None else 1  # an SP group's pass spans its P GPUs
        self.max_token_len = None if max_token_len is None else max_token_len * scale
        self.share_prompts = share_prompts and sp is None
        self.group, self.sp = group, sp
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.grad_scale = dist.get_world_size() if dist.is_initialized() else 1

    def mini_batches(self, batch: TrainBatch) -> list[torch.Tensor]:
        """Row indices of each mini-batch: ``groups_per_mini_batch`` whole groups, in order."""
        groups = torch.unique(batch.group_ids)
        per_mini = self.groups_per_mini_batch
        return [torch.isin(batch.group_ids, groups[start:start + per_mini]).nonzero().squeeze(-1)
                for start in range(0, len(groups), per_mini)]

    def passes(self, batch: TrainBatch, mini: torch.Tensor) -> Iterator[MicroBatch]:
        """This rank's micro-batches of the mini-batch ``mini``, as many as every rank's."""
        if self.share_prompts:
            chunks, stand_in = self._group_chunks(batch, mini)
            count = self._most(len(chunks), mini.device)
        else:
            chunks, stand_in, count = self._row_chunks(batch, mini)
        stand_in = stand_in or _Chunk(rows=mini[:1], width=None)  # width: a host read
        for index in range(count):
            # past this rank's passes, stand-ins (module docstring) over one row whose
            # length the cut read
            chunk, weight = (chunks[index], 1.0) if index < len(chunks) else (stand_in, 0.0)
            yield MicroBatch(rows=chunk.rows, part=batch.select(chunk.rows, chunk.width),
                             weight=weight)

    def _row_chunks(self, batch: TrainBatch, mini: torch.Tensor
                    ) -> tuple[list[_Chunk], _Chunk | None, int]:
        """This rank's rows of ``mini`` by length in passes, a row for its stand-in passes
        (None when it has no rows), and every rank's pass count."""
        mine = mini[self.rank::self.world]
        lengths = batch.attention_mask[mine].sum(-1)
        order = lengths.argsort(stable=True)
        mine = mine[order]
        sorted_lengths = lengths[order].tolist()  # the mini-batch's one host read
        if self.max_token_len is None:
            most = math.ceil(len(mini) / self.world)
            count = math.ceil(most / self.micro_batch_size)
            spans = _even_spans(len(sorted_lengths), count)
        else:
            spans = _by_token_budget(sorted_lengths, self.max_token_len)
            count = self._most(len(spans), mini.device)
        stand_in = _Chunk(rows=mine[:1], width=sorted_lengths[0]) if sorted_lengths else None
        return [_Chunk(rows=mine[start:end], width=sorted_lengths[end - 1])
                for start, end in spans], stand_in, count

    def _group_chunks(self, batch: TrainBatch, mini: torch.Tensor
                      ) -> tuple[list[_Chunk], _Chunk]:
        """This rank's rows of ``mini`` in passes of whole prompt groups (``share_prompts``),
        and a row for its stand-in passes. The rows are sorted by group (stable: a group's
        rows keep their order), so that a group, and each part of a split group, is a slice
        of them."""
        ids = batch.group_ids[mini]
        order = ids.argsort(stable=True)
        by_group = mini[order]
        group_of, total, response = torch.stack([
            ids[order], batch.attention_mask[by_group].sum(-1),
            batch.response_lengths[by_group]]).tolist()  # the mini-batch's one host read
        spans = _runs(group_of)[self.rank::self.world]  # this rank's groups
        units: list[tuple[int, int, int]] = []  # (packed length, start, end) in by_group
        for start, end in spans:
            prompt = total[start] - response[start]
            for part_start, part_end in self._split_group(prompt, response[start:end]):
                units.append((prompt + sum(response[start + part_start:start + part_end]),
                              start + part_start, start + part_end))
        units.sort(key=lambda unit: unit[0])
        chunks: list[_Chunk] = []
        current: list[tuple[int, int, int]] = []
        rows_in = 0
        for unit in units:
            length, start, end = unit
            fits = (rows_in + end - start <= self.micro_batch_size
                    if self.max_token_len is None
                    else (len(current) + 1) * length <= self.max_token_len)
            if current and not fits:
                chunks.append(_packed_chunk(by_group, current, total))
                current, rows_in = [], 0
            current.append(unit)
            rows_in += end - start
        if current:
            chunks.append(_packed_chunk(by_group, current, total))
        return chunks, _Chunk(rows=by_group[:1], width=total[0])

    def _split_group(self, prompt: int, response_lengths: list[int]) -> list[tuple[int, int]]:
        """A group's rows (with these response lengths) in parts that fit one pass (one row
        at least per part), as (start, end) offsets."""
        parts: list[tuple[int, int]] = []
        start, length = 0, prompt
        for end, extra in enumerate(response_lengths):
            fits = (end - start < self.micro_batch_size if self.max_token_len is None
                    else length + extra <= self.max_token_len)
            if end > start and not fits:
                parts.append((start, end))
                start, length = end, prompt
            length += extra
        parts.append((start, len(response_lengths)))
        return parts

    def _most(self, count: int, device: torch.device) -> int:
        """The largest ``count`` over the ranks (a collective on ``device``, the batch's:
        NCCL's on a GPU)."""
        if self.world == 1:
            return count
        value = torch.tensor([count], device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return int(value)


def _packed_chunk(rows: torch.Tensor, units: list[tuple[int, int, int]],
                  lengths: list[int]) -> _Chunk:
    """The pass of ``units`` ((packed length, start, end) slices of ``rows``, whose lengths
    are ``lengths``)."""
    return _Chunk(rows=torch.cat([rows[start:end] for _, start, end in units]),
                  width=max(max(lengths[start:end]) for _, start, end in units))


def _runs(values: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of equal neighbours in ``values``."""
    bounds = [0] + [i for i in range(1, len(values)) if values[i] != values[i - 1]]
    return list(zip(bounds, bounds[1:] + [len(values)]))


def _even_spans(size: int, count: int) -> list[tuple[int, int]]:
    """``torch.tensor_split``'s cut of ``size`` items into ``count`` parts (the first
    ``size % count`` one longer), as (start, end), leaving out the empty parts (there are
    ``count`` passes all the same: the missing ones are stand-ins)."""
    base, longer = divmod(size, count)
    sizes = [base + (part < longer) for part in range(count)]
    return [(end - n, end) for n, end in zip(sizes, itertools.accumulate(sizes)) if n]


def _by_token_budget(lengths: list[int], budget: int) -> list[tuple[int, int]]:
    """Cut rows sorted by ascending ``lengths`` into runs whose size times their longest
    (last) row's length stays within ``budget``, as (start, end)."""
    spans, start = [], 0
    for end in range(1, len(lengths) + 1):
        if end < len(lengths) and (end + 1 - start) * lengths[end] <= budget:
            continue
        spans.append((start, end))
        start = end
    return spans
