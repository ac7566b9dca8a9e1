"""A DTensor put together from every rank's saved shard (``relay import-verl``'s weights and
optimizer moments).

Along a ``Shard(d)`` mesh dimension the rank-local tensors are concatenated on dim d in mesh
order (uneven shards as ``torch.chunk`` cuts them); along a ``Replicate`` one the first index
is taken (HSDP's ``("ddp", "fsdp")`` mesh: the first replica group), and a tensor replicated
over every rank is checked equal on all of them; the result must have the DTensor's global
shape. Meshes with more than one sharded dimension (tensor parallelism) and ``Partial``
placements are refused.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from relay.learner.hf_export import StateMismatch


def merge_dtensor(name: str, pieces: list[DTensor]) -> torch.Tensor:
    """The full tensor of ``name`` from every rank's DTensor (module docstring)."""
    first = pieces[0]
    placements = tuple(first.placements)
    if any(tuple(piece.placements) != placements for piece in pieces):
        raise StateMismatch(f"{name}: placements differ across the ranks")
    if any(placement.is_partial() for placement in placements):
        raise StateMismatch(f"{name}: a Partial placement ({placements}) is not a saved shard")
    sharded = [dim for dim, placement in enumerate(placements) if placement.is_shard()]
    if len(sharded) > 1:
        raise StateMismatch(f"{name}: sharded over {len(sharded)} mesh dimensions "
                            f"{first.device_mesh.mesh_dim_names} (FSDP with tensor "
                            "parallelism), which this import does not merge")
    mesh = first.device_mesh.mesh
    locals_ = [piece.to_local() for piece in pieces]
    if not sharded:
        for rank, local in enumerate(locals_):
            if not torch.equal(local, locals_[0]):
                raise StateMismatch(f"{name}: replicated, but rank {rank}'s copy differs "
                                    "from rank 0's")
        full = locals_[0]
    else:
        index = tuple(slice(None) if dim == sharded[0] else 0 for dim in range(mesh.ndim))
        ranks = mesh[index].tolist()
        if max(ranks) >= len(pieces):
            raise StateMismatch(f"{name}: its mesh names rank {max(ranks)}, but there are "
                                f"{len(pieces)} shards")
        full = torch.cat([locals_[rank] for rank in ranks], dim=placements[sharded[0]].dim)
    if full.shape != first.shape:
        raise StateMismatch(f"{name}: the shards put together are {tuple(full.shape)}, the "
                            f"DTensor says {tuple(first.shape)}")
    return full.contiguous()
