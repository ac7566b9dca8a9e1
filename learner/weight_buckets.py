"""A sharded model's parameters, gathered onto rank 0 one bucket at a time.

``plan_buckets`` cuts the parameters, from their metadata alone (names, global shapes, the
publish dtype) and so identically on every rank, into buckets of at most ``bucket_bytes``:
each parameter in rows along its first dimension, so a parameter larger than a bucket
spans several buckets (only a single row larger than a bucket makes a larger one). What
the engines get is the Hugging Face checkpoint's names in the publish dtype: our engines,
vLLM's ``load_weights`` and SGLang's ``update_weights_from_tensor`` all take those names and
fuse (q/k/v, gate/up) or cut (tensor parallel) on their side, where the layout is known.

``gather_buckets`` is a collective over the learner's ranks. FSDP2 shards each parameter
along dim 0 in ``torch.chunk`` pieces over the last dimension of its mesh: with ``S`` ranks
there and ``n`` rows, the rank at shard index ``s`` holds rows ``[s*c, min((s+1)*c, n))``,
``c = ceil(n / S)``; under HSDP (a 2-D mesh, ``learner.model.sharding_mesh``) every replica
holds all ``S`` shards, and the first replica's ranks (rank 0's) send them. For each bucket
every sending rank casts the rows it holds of the bucket's pieces to the publish dtype and
sends them to rank 0, which receives them straight into the bucket's tensors and yields
the bucket. Nothing else stays: rank 0 holds one bucket beyond its shards, another rank its
own share of one bucket.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import msgspec
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from transport.messages import WeightBucket, WeightEntry, WeightManifest


class Piece(msgspec.Struct, frozen=True):
    """Rows ``[start, stop)`` of parameter ``name`` (a 0-dimensional one: start 0, stop 1)."""

    name: str
    start: int
    stop: int


class BucketPlan(msgspec.Struct, frozen=True):
    entries: list[WeightEntry]
    buckets: list[list[Piece]]
    total_bytes: int

    def manifest(self, version: int, step: int) -> WeightManifest:
        return WeightManifest(version=version, entries=self.entries,
                              num_buckets=len(self.buckets), total_bytes=self.total_bytes,
                              step=step)


def plan_buckets(model: nn.Module, dtype: torch.dtype, bucket_bytes: int) -> BucketPlan:
    """Cut ``model``'s parameters, in order, into buckets of at most ``bucket_bytes`` in
    ``dtype`` (module docstring)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    item = torch.empty((), dtype=dtype).element_size()
    entries: list[WeightEntry] = []
    buckets: list[list[Piece]] = [[]]
    room = bucket_bytes
    total = 0
    for name, param in model.named_parameters():
        shape = list(param.shape)
        entries.append(WeightEntry(name=name, dtype=str(dtype).removeprefix("torch."),
                                   shape=shape))
        rows = shape[0] if shape else 1
        row_bytes = item * (math.prod(shape[1:]) if shape else 1)
        total += rows * row_bytes
        if rows == 0:  # nothing to send, but the engine must hear of it
            buckets[-1].append(Piece(name=name, start=0, stop=0))
        start = 0
        while start < rows:
            fits = room // row_bytes if row_bytes else rows
            if fits <= 0 and buckets[-1]:  # start a new bucket for this row
                buckets.append([])
                room = bucket_bytes
                continue
            stop = min(rows, start + max(fits, 1))
            buckets[-1].append(Piece(name=name, start=start, stop=stop))
            room -= (stop - start) * row_bytes
            start = stop
    if not buckets[-1]:
        buckets.pop()
    return BucketPlan(entries=entries, buckets=buckets, total_bytes=total)


def held_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """The rows ``[lo, hi)`` of an ``rows``-row parameter that FSDP2 gives ``rank``."""
    chunk = -(-rows // world)
    return min(rank * chunk, rows), min((rank + 1) * chunk, rows)


def _check_placements(param: DTensor) -> None:
    """FSDP2's layouts: Shard(0) over the mesh's last dimension, replicated over any other
    (HSDP)."""
    *replicated, sharded = param.placements
    if sharded != Shard(0) or not all(p.is_replicate() for p in replicated):
        raise NotImplementedError(f"publishing a parameter sharded as {param.placements}: "
                                  "only FSDP2's Shard(0) over the mesh's last dimension "
                                  "(replicated over the others: HSDP) is supported")


def _senders(param: torch.Tensor, group: dist.ProcessGroup | None) -> list[tuple[int, int, int]]:
    """(rank in ``group``, first row, end row) of each rank that sends rows of ``param``:
    the holder of each shard on the first replica (shard index s is mesh coordinate
    (0, ..., 0, s)), or rank 0 alone when ``param`` is not sharded."""
    if not isinstance(param, DTensor):
        return [(0, 0, param.shape[0] if param.dim() else 1)]
    mesh = param.device_mesh
    shards = mesh.size(mesh.ndim - 1)
    first_replica = mesh.mesh.reshape(-1, shards)[0].tolist()  # global ranks by shard index
    group = group if group is not None else dist.group.WORLD
    return [(dist.get_group_rank(group, holder), *held_rows(param.shape[0], shards, index))
            for index, holder in enumerate(first_replica)]


def _local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's rows of ``param`` (its FSDP2 shard, or the whole tensor when it is not
    sharded) and the index of the first one; a 0-dimensional parameter is one row."""
    if not isinstance(param, DTensor):
        local = param.detach()
        return (local.reshape(1) if local.dim() == 0 else local), 0
    local = param.to_local().detach()
    mesh = param.device_mesh
    index = mesh.get_local_rank(mesh.ndim - 1)
    lo, hi = held_rows(param.shape[0], mesh.size(mesh.ndim - 1), index)
    if local.shape[0] != hi - lo:
        raise RuntimeError(f"a shard of {tuple(param.shape)} holds {local.shape[0]} rows at "
                           f"shard index {index}, expected {hi - lo}")
    return local, lo


def gather_buckets(model: nn.Module, plan: BucketPlan, dtype: torch.dtype, version: int,
                   group: dist.ProcessGroup | None = None) -> Iterator[WeightBucket | None]:
    """Yield ``plan``'s buckets of ``version`` one at a time on rank 0 (``None`` on other
    ranks); a collective: every rank iterates to the end. Drop each bucket before asking
    for the next one, so that only one is alive."""
    params = dict(model.named_parameters())
    _check_mesh(params.values(), group)
    for index, pieces in enumerate(plan.buckets):
        yield _gather_bucket(params, pieces, dtype, version, index, group)


def _check_mesh(params, group: dist.ProcessGroup | None) -> None:
    """The shards' mesh must span the ranks of ``group``, FSDP2's way (``_check_placements``)."""
    for param in params:
        if isinstance(param, DTensor):
            _check_placements(param)
            mesh = param.device_mesh
            if mesh.size() != dist.get_world_size(group):
                raise RuntimeError(f"the parameters are sharded over a mesh of {mesh.size()} "
                                   f"ranks, the gathering group has "
                                   f"{dist.get_world_size(group)}")


def _gather_bucket(params: dict[str, nn.Parameter], pieces: list[Piece], dtype: torch.dtype,
                   version: int, index: int,
                   group: dist.ProcessGroup | None) -> WeightBucket | None:
    distributed = dist.is_initialized() and dist.get_world_size(group) > 1
    rank = dist.get_rank(group) if distributed else 0
    out: list[torch.Tensor] = []
    pending: list[dist.Work] = []
    for tag, piece in enumerate(pieces):
        param = params[piece.name]
        local, first = _local_rows(param)
        if rank == 0:
            shape = (piece.stop - piece.start, *param.shape[1:])
            out.append(torch.empty(shape, dtype=dtype))
        for holder, lo, hi in _senders(param, group):
            a, b = max(piece.start, lo), min(piece.stop, hi)
            if a >= b:
                continue
            if holder == rank == 0:
                out[-1][a - piece.start:b - piece.start].copy_(local[a - first:b - first])
            elif holder == rank:
                rows = local[a - first:b - first].to(device="cpu", dtype=dtype).contiguous()
                pending.append(dist.isend(rows, group_dst=0, group=group, tag=tag))
            elif rank == 0:
                pending.append(dist.irecv(out[-1][a - piece.start:b - piece.start],
                                          group_src=holder, group=group, tag=tag))
    for work in pending:
        work.wait()
    if rank != 0:
        return None
    tensors = [t.reshape(params[p.name].shape) if params[p.name].dim() == 0 else t
               for p, t in zip(pieces, out)]
    return WeightBucket(version=version, index=index, names=[p.name for p in pieces],
                        starts=[p.start for p in pieces], tensors=tensors)
