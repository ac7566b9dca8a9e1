"""A sharded model's parameters, gathered onto rank 0 one bucket at a time.

``plan_buckets`` cuts the parameters, from their metadata alone (names, global shapes, the
publish dtype) and so identically on every rank, into buckets of at most ``bucket_bytes``:
each parameter in rows along its first dimension, so a parameter larger than a bucket
spans several buckets (only a single row larger than a bucket makes a larger one). What
the engines get is the Hugging Face checkpoint's names in the publish dtype: our engines,
vLLM's ``load_weights`` and SGLang's ``update_weights_from_tensor`` all take those names and
fuse (q/k/v, gate/up) or cut (tensor parallel) on their side, where the layout is known.

``gather_buckets`` is a collective over the learner's ranks, by the route the parameters'
device allows:

- CUDA: a piece's parameter, cast to the publish dtype, is gathered whole on the device over
  its mesh's collective (NCCL, ``DTensor.full_tensor``; once for a parameter split across
  buckets) and its rows are copied once to the host. This runs one bucket ahead
  (``relay.learner.bucket_staging``): the device gathers bucket i+1 while rank 0's host sends i.
- CPU (CPU-offloaded shards too): FSDP2 shards each parameter along dim 0 in
  ``torch.chunk`` pieces over the last dimension of its mesh: with ``S`` ranks there and
  ``n`` rows, the rank at shard index ``s`` holds rows ``[s*c, min((s+1)*c, n))``,
  ``c = ceil(n / S)``; under HSDP (a 2-D mesh, ``relay.learner.model.sharding_mesh``) every
  replica holds all ``S`` shards, and the first replica's ranks (rank 0's) send them.
  Every sending rank casts the rows it holds of the bucket's pieces to the publish dtype
  and sends them to rank 0 (gloo), which receives them straight into the bucket's tensors:
  no copy beyond the cast.

Rank 0's bucket tensors are views of the caller's ``HostBuffers`` (the publish: reused from
version to version), or new tensors without them. Nothing else stays: rank 0 holds one
bucket beyond its shards (two on CUDA), another rank its own share of one bucket (on CUDA:
the parameter being gathered, whole).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping

import msgspec
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from relay.learner.bucket_staging import BufferSpec, HostBuffers, Wait, copy_to_host, pipelined
from relay.transport.messages import WeightBucket, WeightEntry, WeightManifest

DEVICE_AHEAD = 1  # buckets the device gathers beyond the one rank 0 sends


class Piece(msgspec.Struct, frozen=True):
    """Rows ``[start, stop)`` of parameter ``name`` (a 0-dimensional one: start 0, stop 1)."""

    name: str
    start: int
    stop: int


class BucketPlan(msgspec.Struct, frozen=True):
    entries: list[WeightEntry]
    buckets: list[list[Piece]]
    total_bytes: int
    sizes: list[int]  # bytes of each bucket
    adapters: bool = False  # a LoRA policy's adapters alone (``published_tensors``)

    def manifest(self, version: int, step: int) -> WeightManifest:
        return WeightManifest(version=version, entries=self.entries,
                              num_buckets=len(self.buckets), total_bytes=self.total_bytes,
                              step=step)


def published_shapes(model: nn.Module, adapters: bool = False) -> list[tuple[str, torch.Size]]:
    """The names and shapes the engines get of ``model``: its parameters'; for a LoRA model,
    its base parameters' under their Hugging Face names, or with ``adapters`` its adapters'
    alone under peft's file names (``relay.learner.lora``, ``relay.configs.lora_publish``)."""
    if getattr(model, "peft_config", None) is not None:
        from relay.learner.lora import adapter_shapes, base_shapes  # peft: the lora extra
        return adapter_shapes(model) if adapters else base_shapes(model)
    if adapters:
        raise ValueError("an adapters-only publish needs a LoRA policy (model.lora_rank > 0)")
    return [(name, param.shape) for name, param in model.named_parameters()]


def published_tensors(model: nn.Module, adapters: bool = False) -> Mapping[str, torch.Tensor]:
    """The tensors of ``published_shapes`` by name, sharded as the parameters are; for a
    LoRA model its merged weights, W + (alpha / r) B A (``relay.learner.lora.MergedWeights``:
    a collective, made on every rank), or with ``adapters`` its adapters' A and B."""
    if getattr(model, "peft_config", None) is not None:
        from relay.learner.lora import MergedWeights, adapter_parameters  # peft: lora extra
        return adapter_parameters(model) if adapters else MergedWeights(model)
    if adapters:
        raise ValueError("an adapters-only publish needs a LoRA policy (model.lora_rank > 0)")
    return dict(model.named_parameters())


def plan_buckets(model: nn.Module, dtype: torch.dtype, bucket_bytes: int, *,
                 adapters: bool = False) -> BucketPlan:
    """Cut ``model``'s published parameters (``published_shapes``; a LoRA policy's adapters
    alone with ``adapters``), in order, into buckets of at most ``bucket_bytes`` in
    ``dtype`` (module docstring)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    item = torch.empty((), dtype=dtype).element_size()
    entries: list[WeightEntry] = []
    buckets: list[list[Piece]] = [[]]
    sizes = [0]
    room = bucket_bytes
    total = 0
    for name, param_shape in published_shapes(model, adapters):
        shape = list(param_shape)
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
                sizes.append(0)
                room = bucket_bytes
                continue
            stop = min(rows, start + max(fits, 1))
            buckets[-1].append(Piece(name=name, start=start, stop=stop))
            room -= (stop - start) * row_bytes
            sizes[-1] += (stop - start) * row_bytes
            start = stop
    if not buckets[-1]:
        buckets.pop()
        sizes.pop()
    return BucketPlan(entries=entries, buckets=buckets, total_bytes=total, sizes=sizes,
                      adapters=adapters)


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
    group = group if group is not None else dist.group.WORLD
    return [(dist.get_group_rank(group, holder), *held_rows(param.shape[0], shards, index))
            for index, holder in enumerate(_first_replica(mesh))]


@functools.cache
def _first_replica(mesh: DeviceMesh) -> tuple[int, ...]:
    """The global ranks of the first replica's shards, by shard index; once per mesh, as
    ``DeviceMesh.mesh`` rebuilds its rank tensor on each call (0.5 ms: a publish of the 24M
    bench model took 8 ms longer when asked it for every piece)."""
    return tuple(mesh.mesh.reshape(-1, mesh.size(mesh.ndim - 1))[0].tolist())


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


def parameters_on_cuda(model: nn.Module) -> bool:
    """Whether this rank's shards of ``model``'s parameters are on a CUDA device."""
    param = next(model.parameters(), None)
    local = param.to_local() if isinstance(param, DTensor) else param
    return local is not None and local.is_cuda


def buffer_spec(model: nn.Module, plan: BucketPlan) -> BufferSpec:
    """The host buffers rank 0 sends ``plan``'s buckets of ``model`` from: one pinned buffer
    per bucket in flight on CUDA, one pageable buffer on the CPU."""
    on_cuda = parameters_on_cuda(model)
    return BufferSpec(nbytes=max(plan.sizes, default=0),
                      count=DEVICE_AHEAD + 1 if on_cuda else 1, pinned=on_cuda)


def gather_buckets(model: nn.Module, plan: BucketPlan, dtype: torch.dtype, version: int,
                   group: dist.ProcessGroup | None = None,
                   buffers: HostBuffers | None = None) -> Iterator[WeightBucket | None]:
    """Yield ``plan``'s buckets of ``version`` one at a time on rank 0 (``None`` on other
    ranks); a collective: every rank iterates to the end. A bucket's tensors are views of
    ``buffers`` (rank 0's, made with ``buffer_spec``) when given: its sender must call
    ``buffers.sent`` before asking for the next bucket. Otherwise they are new; either way
    drop each bucket before asking for the next one, so that only one is alive."""
    params = published_tensors(model, plan.adapters)
    shapes = {entry.name: tuple(entry.shape) for entry in plan.entries}
    distributed = dist.is_initialized() and dist.get_world_size(group) > 1
    rank0 = not distributed or dist.get_rank(group) == 0
    if parameters_on_cuda(model):
        gather, ahead = _DeviceGather(params, dtype), DEVICE_AHEAD
    else:
        _check_mesh(model.parameters(), group)
        gather, ahead = _HostGather(params, dtype, group), 0

    def start(index: int):
        pieces = plan.buckets[index]
        out = _bucket_tensors(shapes, pieces, dtype, buffers.take() if buffers else None) \
            if rank0 else None
        wait = gather(pieces, out)

        def finish() -> WeightBucket | None:
            wait()
            return _bucket(shapes, pieces, out, version, index) if out is not None else None
        return finish

    return pipelined(len(plan.buckets), start, ahead)


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


def _bucket_tensors(shapes: dict[str, tuple[int, ...]], pieces: list[Piece],
                    dtype: torch.dtype, buffer: torch.Tensor | None) -> list[torch.Tensor]:
    """Rank 0's tensors for ``pieces`` (rows, the trailing dimensions of their parameter,
    whose shape ``shapes`` gives; a 0-dimensional one as one row): views laid end to end
    in ``buffer``, or new tensors."""
    rows = [(p.stop - p.start, *shapes[p.name][1:]) for p in pieces]
    if buffer is None:
        return [torch.empty(shape, dtype=dtype, device="cpu") for shape in rows]
    sizes = [math.prod(shape) * dtype.itemsize for shape in rows]
    if sum(sizes) > buffer.numel():
        raise ValueError(f"a bucket of {sum(sizes)} bytes does not fit a host buffer of "
                         f"{buffer.numel()}: make the buffers with buffer_spec for this plan")
    views, offset = [], 0
    for shape, size in zip(rows, sizes):
        views.append(buffer[offset:offset + size].view(dtype).view(shape))
        offset += size
    return views


def _bucket(shapes: dict[str, tuple[int, ...]], pieces: list[Piece], out: list[torch.Tensor],
            version: int, index: int) -> WeightBucket:
    tensors = [t.reshape(shapes[p.name]) if not shapes[p.name] else t
               for p, t in zip(pieces, out)]
    return WeightBucket(version=version, index=index, names=[p.name for p in pieces],
                        starts=[p.start for p in pieces], tensors=tensors)


class _DeviceGather:
    """The CUDA route (module docstring): a piece's rows sliced from its parameter gathered
    whole in the publish dtype, kept while the next pieces are of the same parameter."""

    def __init__(self, params: Mapping[str, torch.Tensor], dtype: torch.dtype) -> None:
        self._params, self._dtype = params, dtype
        self._name: str | None = None
        self._full: torch.Tensor | None = None

    def __call__(self, pieces: list[Piece], out: list[torch.Tensor] | None) -> Wait:
        rows = [self._rows(piece) for piece in pieces]
        return copy_to_host(out, rows) if out is not None else (lambda: None)

    def _rows(self, piece: Piece) -> torch.Tensor:
        if piece.name != self._name:
            self._name, self._full = piece.name, None  # the previous one freed first
            cast = self._params[piece.name].detach().to(self._dtype)
            self._full = cast.full_tensor() if isinstance(cast, DTensor) else cast
        full = self._full
        return full.reshape(1) if full.dim() == 0 else full[piece.start:piece.stop]


class _HostGather:
    """The CPU route (module docstring): every rank sends rank 0 the rows it holds (under
    HSDP, the ranks of rank 0's replica: ``_senders``)."""

    def __init__(self, params: Mapping[str, torch.Tensor], dtype: torch.dtype,
                 group: dist.ProcessGroup | None) -> None:
        self._params, self._dtype, self._group = params, dtype, group
        distributed = dist.is_initialized() and dist.get_world_size(group) > 1
        self._rank = dist.get_rank(group) if distributed else 0

    def __call__(self, pieces: list[Piece], out: list[torch.Tensor] | None) -> Wait:
        rank, group = self._rank, self._group
        pending: list[dist.Work] = []
        for tag, piece in enumerate(pieces):
            param = self._params[piece.name]
            local, first = _local_rows(param)
            for holder, lo, hi in _senders(param, group):
                a, b = max(piece.start, lo), min(piece.stop, hi)
                if a >= b:
                    continue
                if holder == rank == 0:
                    out[tag][a - piece.start:b - piece.start].copy_(local[a - first:b - first])
                elif holder == rank:
                    rows = local[a - first:b - first].to(device="cpu", dtype=self._dtype)
                    pending.append(dist.isend(rows.contiguous(), group_dst=0, group=group,
                                              tag=tag))
                elif rank == 0:
                    pending.append(dist.irecv(out[tag][a - piece.start:b - piece.start],
                                              group_src=holder, group=group, tag=tag))

        def wait() -> None:
            for work in pending:
                work.wait()
        return wait
