"""How a global batch is cut: mini-batches for the optimizer steps, micro-batches per rank.

Every rank holds the whole batch (rank 0 broadcast it). A mini-batch is a run of whole
prompt groups: one optimizer step each. Within a mini-batch, rank r of W takes rows
r, r + W, r + 2W, ... and cuts them into micro-batches of at most ``micro_batch_size`` rows:
one forward (and backward) pass each. FSDP2's collectives need every rank to make the same
number of passes, so the count is set by the rank with the most rows, and a rank that has
no rows left makes a stand-in pass over one real row with ``weight`` 0: every loss and
diagnostic of the pass is multiplied by the weight, so it changes nothing.

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
    """This rank's walk through a batch: ``mini_batches`` then ``passes`` over each."""

    def __init__(self, *, groups_per_mini_batch: int, micro_batch_size: int,
                 group: dist.ProcessGroup | None = None) -> None:
        self.groups_per_mini_batch = groups_per_mini_batch
        self.micro_batch_size = micro_batch_size
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1

    def mini_batches(self, batch: TrainBatch) -> list[torch.Tensor]:
        """Row indices of each mini-batch: ``groups_per_mini_batch`` whole groups, in order."""
        groups = torch.unique(batch.group_ids)
        per_mini = self.groups_per_mini_batch
        return [torch.isin(batch.group_ids, groups[start:start + per_mini]).nonzero().squeeze(-1)
                for start in range(0, len(groups), per_mini)]

    def passes(self, batch: TrainBatch, mini: torch.Tensor) -> Iterator[MicroBatch]:
        """This rank's micro-batches of the mini-batch ``mini``, as many as every rank's."""
        most = math.ceil(len(mini) / self.world)
        count = math.ceil(most / self.micro_batch_size)
        mine = mini[self.rank::self.world]
        for index in range(count):
            chunk = mine[index::count]
            rows, weight = (chunk, 1.0) if len(chunk) else (mini[:1], 0.0)
            yield MicroBatch(rows=rows, part=batch.select(rows), weight=weight)
