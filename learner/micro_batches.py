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
their prompt can be computed once (``learner.shared_prompts``): rank r takes groups
r, r + W, ..., orders them by packed length (prompt + all responses) and fills passes with
whole groups, up to ``micro_batch_size`` rows or ``max_token_len`` packed tokens (sequences
x longest sequence) a pass; a group bigger than that is split, and its parts still share
the prompt within their pass.

Losses are normalised by mini-batch totals, so how rows are grouped into passes changes no
gradient. FSDP2's collectives need every rank to make the same number of passes, so the
count is the largest any rank needs, and a rank that has no rows left makes a stand-in pass
over one real row with ``weight`` 0: every loss and diagnostic of the pass is multiplied by
the weight, so it changes nothing.

Under Ulysses sequence parallelism (``learner.ulysses``) "rank" above means a data-parallel
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
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import msgspec
import torch
import torch.distributed as dist

from learner.batch import TrainBatch
from learner.ulysses import SequenceParallel


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
            chunks = self._group_chunks(batch, mini)
            count = self._most(len(chunks))
        else:
            chunks, count = self._row_chunks(batch, mini)
        for index in range(count):
            chunk = chunks[index] if index < len(chunks) else mini[:0]
            rows, weight = (chunk, 1.0) if len(chunk) else (mini[:1], 0.0)
            yield MicroBatch(rows=rows, part=batch.select(rows), weight=weight)

    def _row_chunks(self, batch: TrainBatch, mini: torch.Tensor
                    ) -> tuple[list[torch.Tensor], int]:
        """This rank's rows of ``mini`` by length in passes, and every rank's pass count."""
        mine = mini[self.rank::self.world]
        lengths = batch.attention_mask[mine].sum(-1)
        order = lengths.argsort(stable=True)
        mine, lengths = mine[order], lengths[order]
        if self.max_token_len is None:
            most = math.ceil(len(mini) / self.world)
            count = math.ceil(most / self.micro_batch_size)
            return (list(torch.tensor_split(mine, count)) if len(mine) else []), count
        chunks = _by_token_budget(mine, lengths.tolist(), self.max_token_len)
        return chunks, self._most(len(chunks))

    def _group_chunks(self, batch: TrainBatch, mini: torch.Tensor) -> list[torch.Tensor]:
        """This rank's rows of ``mini`` in passes of whole prompt groups (``share_prompts``)."""
        ids = batch.group_ids[mini]
        groups = torch.unique(ids)[self.rank::self.world]
        total = batch.attention_mask.sum(-1)
        units: list[tuple[int, torch.Tensor]] = []  # (packed length, rows)
        for group in groups.tolist():
            rows = mini[ids == group]
            prompt = int(total[rows[0]] - batch.response_lengths[rows[0]])
            for part in self._split_group(rows, prompt, batch.response_lengths):
                units.append((prompt + int(batch.response_lengths[part].sum()), part))
        units.sort(key=lambda unit: unit[0])
        chunks: list[torch.Tensor] = []
        current: list[torch.Tensor] = []
        rows_in = 0
        for length, rows in units:
            fits = (rows_in + len(rows) <= self.micro_batch_size if self.max_token_len is None
                    else (len(current) + 1) * length <= self.max_token_len)
            if current and not fits:
                chunks.append(torch.cat(current))
                current, rows_in = [], 0
            current.append(rows)
            rows_in += len(rows)
        if current:
            chunks.append(torch.cat(current))
        return chunks

    def _split_group(self, rows: torch.Tensor, prompt: int,
                     response_lengths: torch.Tensor) -> list[torch.Tensor]:
        """A group's rows in parts that fit one pass (one row at least per part)."""
        parts: list[torch.Tensor] = []
        start, length = 0, prompt
        for end in range(len(rows)):
            extra = int(response_lengths[rows[end]])
            fits = (end - start < self.micro_batch_size if self.max_token_len is None
                    else length + extra <= self.max_token_len)
            if end > start and not fits:
                parts.append(rows[start:end])
                start, length = end, prompt
            length += extra
        parts.append(rows[start:])
        return parts

    def _most(self, count: int) -> int:
        """The largest ``count`` over the ranks."""
        if self.world == 1:
            return count
        value = torch.tensor([count])
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return int(value)


def _by_token_budget(rows: torch.Tensor, lengths: list[int], budget: int) -> list[torch.Tensor]:
    """Cut ``rows`` (sorted by ascending ``lengths``) into runs whose size times their
    longest (last) row's length stays within ``budget``."""
    chunks, start = [], 0
    for end in range(1, len(lengths) + 1):
        if end < len(lengths) and (end + 1 - start) * lengths[end] <= budget:
            continue
        chunks.append(rows[start:end])
        start = end
    return chunks
