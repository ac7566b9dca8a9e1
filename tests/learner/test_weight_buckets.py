"""relay.learner.weight_buckets: the bucket plan keeps every bucket within its size and covers
every row once, in order; the rows each rank holds are FSDP2's; the buckets gathered from
one process, from two FSDP2 ranks or from four hybrid-sharded ones (2 x 2; gloo, real
processes) rebuild, through the generators' ``VersionAssembler``, exactly the parameters
in the publish dtype; a version missing a bucket or carrying a wrong dtype is refused and
the next one still arrives.
(The stream: test_weights.py; the receiver: tests/generators/test_weight_receiver.py.)"""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import relay.learner.weight_buckets as weight_buckets
from relay.generators.weight_receiver import IncompleteVersion, VersionAssembler
from relay.learner.bucket_staging import HostBuffers
from relay.learner.model import shard, sharding_mesh
from relay.learner.weight_buckets import (
    BucketPlan,
    gather_buckets,
    held_rows,
    plan_buckets,
)
from relay.transport.codec import Decoder, encode
from relay.transport.messages import WeightBucket, WeightManifest

from ..conftest import exit_worker, free_port, gather_full_weights

DTYPE = torch.bfloat16


class Tiny(nn.Module):
    """Linear layers with odd row counts (7, then 1: fewer rows than two ranks), and
    optionally a 0-dimensional parameter (FSDP2 refuses those)."""

    def __init__(self, scalar: bool = True) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 7), nn.Linear(7, 12), nn.Linear(12, 1))
        if scalar:
            self.scale = nn.Parameter(torch.tensor(0.3))


def piece_bytes(shape: list[int], rows: int, dtype: torch.dtype = DTYPE) -> int:
    return rows * math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size()


def bucket_bytes_of(bucket: WeightBucket) -> int:
    return sum(t.numel() * t.element_size() for t in bucket.tensors)


def assemble(manifest: WeightManifest, buckets: list[WeightBucket]) -> dict[str, torch.Tensor]:
    assembler = VersionAssembler()
    *partial, staged = [assembler.feed(m) for m in [manifest, *buckets]]
    assert all(s is None for s in partial)
    assert staged.version == manifest.version
    return staged.tensors


def check_plan(model: nn.Module, plan: BucketPlan, bucket_bytes: int) -> None:
    shapes = {name: list(p.shape) for name, p in model.named_parameters()}
    pieces: dict[str, list[tuple[int, int, int]]] = {}  # name -> (bucket, start, stop)
    for index, bucket in enumerate(plan.buckets):
        assert bucket
        size = sum(piece_bytes(shapes[p.name], p.stop - p.start) for p in bucket)
        single_row = len(bucket) == 1 and bucket[0].stop - bucket[0].start == 1
        assert size <= bucket_bytes or single_row, (index, size, bucket)
        for p in bucket:
            pieces.setdefault(p.name, []).append((index, p.start, p.stop))
    assert list(pieces) == list(shapes)  # every parameter, in order
    for name, shape in shapes.items():
        indices, starts, stops = zip(*pieces[name])
        assert starts[0] == 0 and stops[-1] == (shape[0] if shape else 1), name
        assert list(starts[1:]) == list(stops[:-1]), name
        assert list(indices) == list(range(indices[0], indices[0] + len(indices))), name
    assert plan.total_bytes == sum(piece_bytes(s, s[0] if s else 1) for s in shapes.values())


@pytest.mark.parametrize("bucket_bytes", [20, 32, 100, 256, 10**6])
def test_the_plan_keeps_buckets_small_and_covers_every_row_once(bucket_bytes: int) -> None:
    """Buckets stay within bucket_bytes (or hold one oversized row); each parameter's pieces
    cover its rows once, in order, in consecutive buckets; the manifest describes them."""
    model = Tiny()
    plan = plan_buckets(model, DTYPE, bucket_bytes)
    check_plan(model, plan, bucket_bytes)
    assert [(p.start, p.stop) for b in plan.buckets for p in b if p.name == "scale"] == [(0, 1)]
    manifest = plan.manifest(version=3, step=5)
    assert (manifest.version, manifest.step) == (3, 5)
    assert manifest.num_buckets == len(plan.buckets)
    assert manifest.total_bytes == plan.total_bytes
    assert [(e.name, e.dtype, e.shape) for e in manifest.entries] == \
        [(name, "bfloat16", list(p.shape)) for name, p in model.named_parameters()]


def test_a_bucket_size_must_be_positive() -> None:
    """bucket_bytes of 0 or less is refused."""
    for bucket_bytes in (0, -1):
        with pytest.raises(ValueError, match="bucket_bytes must be positive"):
            plan_buckets(Tiny(), DTYPE, bucket_bytes)


@pytest.mark.parametrize("rows, world", [(1, 2), (3, 4), (5, 4), (6, 4), (7, 2), (10, 3),
                                         (8, 4), (5, 8), (12, 1)])
def test_held_rows_are_torch_chunks(rows: int, world: int) -> None:
    """Rank r holds exactly the r-th of torch.chunk's pieces (none beyond the last one)."""
    chunks = [c.tolist() for c in torch.arange(rows).chunk(world)]
    chunks += [[]] * (world - len(chunks))
    assert [list(range(*held_rows(rows, world, r))) for r in range(world)] == chunks


def test_buckets_of_one_process_rebuild_the_model_in_the_publish_dtype() -> None:
    """Without a process group, the buckets rebuild every parameter, a split one and a
    0-dimensional one included, cast to bf16."""
    torch.manual_seed(0)
    model = Tiny()
    bucket_bytes = 100  # layers.0.weight is 224 bytes in bf16: three buckets
    plan = plan_buckets(model, DTYPE, bucket_bytes)
    buckets = list(gather_buckets(model, plan, DTYPE, version=4))
    assert len(buckets) == len(plan.buckets) and all(b is not None for b in buckets)
    assert sum(name == "layers.0.weight" for b in buckets for name in b.names) > 1
    assert all(bucket_bytes_of(b) <= bucket_bytes for b in buckets)
    staged = assemble(plan.manifest(4, step=4), buckets)
    assert list(staged) == [name for name, _ in model.named_parameters()]
    for name, param in model.named_parameters():
        assert staged[name].dtype == DTYPE and staged[name].shape == param.shape, name
        assert torch.equal(staged[name], param.detach().to(DTYPE)), name


def gather_from_rank(rank: int, world: int, port: int, bucket_bytes: int, out_file: str,
                     fsdp_size: int = -1) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        torch.manual_seed(0)  # the same model on every rank, before FSDP2 shards it
        model = shard(Tiny(scalar=False), compute_dtype=torch.float32, blocks=(nn.Linear,),
                      mesh=sharding_mesh(torch.device("cpu"), fsdp_size))
        shards = model.layers[0].weight.device_mesh.shape
        assert shards == ((world,) if fsdp_size == -1 else (world // fsdp_size, fsdp_size))
        plan = plan_buckets(model, DTYPE, bucket_bytes)
        assembler, staged, sizes = VersionAssembler(), None, []
        assembler.feed(plan.manifest(version=1, step=1))
        for bucket in gather_buckets(model, plan, DTYPE, version=1):
            assert (bucket is None) == (rank != 0)
            if bucket is not None:
                sizes.append(bucket_bytes_of(bucket))
                staged = assembler.feed(bucket)
            del bucket  # one bucket alive at a time
        full = gather_full_weights(model, DTYPE)
        if rank == 0:
            torch.save({"staged": staged.tensors, "full": full, "sizes": sizes,
                        "num_buckets": len(plan.buckets)}, out_file)
    finally:
        dist.destroy_process_group()
    exit_worker()


@pytest.mark.parametrize("world, fsdp_size", [(2, -1), (4, 2)], ids=["2 ranks", "hsdp 2x2"])
def test_ranks_gather_the_full_weights_one_bucket_at_a_time(tmp_path: Path, world: int,
                                                            fsdp_size: int) -> None:
    """FSDP2 ranks with uneven shards (7 rows; 1 row) send rank 0 buckets, each within
    bucket_bytes, that rebuild exactly what gather_full_weights gathers whole; under HSDP
    (2 replicas of 2 shards) rank 0's replica sends them."""
    out, bucket_bytes = tmp_path / "gathered.pt", 100  # layers.0.weight spans three buckets
    mp.start_processes(gather_from_rank,
                       args=(world, free_port(), bucket_bytes, str(out), fsdp_size),
                       nprocs=world, start_method="spawn")
    result = torch.load(out, weights_only=False)
    assert result["num_buckets"] == len(result["sizes"]) > 1
    assert max(result["sizes"]) <= bucket_bytes
    assert sum(result["sizes"]) == sum(t.numel() * 2 for t in result["full"].values())
    staged, full = result["staged"], result["full"]
    assert list(staged) == list(full) == [n for n, _ in Tiny(scalar=False).named_parameters()]
    for name, tensor in full.items():
        assert staged[name].dtype == tensor.dtype == DTYPE, name
        assert torch.equal(staged[name], tensor), name


def test_a_broken_version_is_refused_and_the_next_one_arrives() -> None:
    """A skipped bucket or a piece of the wrong dtype raises IncompleteVersion; the
    manifest and every bucket fed again afterwards rebuild the version."""
    torch.manual_seed(0)
    model = Tiny()
    plan = plan_buckets(model, DTYPE, 100)
    manifest = plan.manifest(2, step=2)
    buckets = list(gather_buckets(model, plan, DTYPE, version=2))
    assert len(buckets) > 2
    first = buckets[0]
    wrong_dtype = msgspec.structs.replace(
        first, tensors=[first.tensors[0].float(), *first.tensors[1:]])
    for broken in ([buckets[0], buckets[2]], [wrong_dtype]):
        assembler = VersionAssembler()
        assembler.feed(manifest)
        with pytest.raises(IncompleteVersion):
            for bucket in broken:
                assembler.feed(bucket)
        *partial, staged = [assembler.feed(m) for m in [manifest, *buckets]]
        assert all(s is None for s in partial) and staged.version == 2
        for name, param in model.named_parameters():
            assert torch.equal(staged.tensors[name], param.detach().to(DTYPE)), name


def test_a_parameter_without_rows_still_reaches_the_engine() -> None:
    """A (0, 4) parameter is announced and sent empty, so the version holds it."""
    model = nn.Module()
    model.empty = nn.Parameter(torch.zeros(0, 4))
    model.full = nn.Parameter(torch.ones(3, 4))
    plan = plan_buckets(model, DTYPE, 1024)
    assembler = VersionAssembler()
    assembler.feed(plan.manifest(version=1, step=1))
    staged = [assembler.feed(b) for b in gather_buckets(model, plan, DTYPE, 1)][-1]
    assert staged is not None and staged.tensors["empty"].shape == (0, 4)


# -- the routes: bitwise what was published before, buffers reused --------------------------

ROUTES = ("new tensors", "host buffers", "device route")


def published_frames(model: nn.Module, dtype: torch.dtype, bucket_bytes: int,
                     patch) -> dict[str, list[list[bytes] | None]]:
    """The wire frames of every bucket of version 2 (None on ranks other than 0) by each
    route: the CPU route into new tensors (what a publish sent before host buffers) and
    into host buffers, and the CUDA route (each parameter gathered whole, copied into two
    buffers, one bucket ahead) run on the CPU. Buffers serve both versions, made once.
    ``patch(name, value)`` sets an attribute of ``relay.learner.weight_buckets``."""
    plan = plan_buckets(model, dtype, bucket_bytes)
    frames: dict[str, list[list[bytes] | None]] = {}
    for route in ROUTES:
        on_device = route == "device route"
        patch("parameters_on_cuda", lambda _model, on=on_device: on)
        spec = weight_buckets.buffer_spec(model, plan)
        assert (spec.count, spec.pinned) == ((2, True) if on_device else (1, False))
        assert spec.nbytes == max(plan.sizes)
        buffers = None if route == "new tensors" else \
            HostBuffers(msgspec.structs.replace(spec, pinned=False))  # no CUDA here to pin
        for version in (1, 2):
            frames[route] = []
            for bucket in gather_buckets(model, plan, dtype, version, buffers=buffers):
                frames[route].append(None if bucket is None else
                                     [bytes(frame) for frame in encode(bucket)])
                if buffers is not None and bucket is not None:
                    buffers.sent(reusable=True)
            assert buffers is None or buffers.made == spec.count, route
    return frames


def check_frames(frames: dict[str, list[list[bytes] | None]], model_full: dict[str, torch.Tensor],
                 plan: BucketPlan) -> None:
    """Every route's frames are the same bytes, and decode to the full weights' rows."""
    assert frames["host buffers"] == frames["new tensors"]
    assert frames["device route"] == frames["new tensors"]
    decoder = Decoder(WeightBucket)
    assert len(frames["new tensors"]) == len(plan.buckets) > 2
    for index, (bucket_frames, pieces) in enumerate(zip(frames["new tensors"], plan.buckets)):
        bucket = decoder.decode(bucket_frames)
        assert (bucket.version, bucket.index) == (2, index)
        assert bucket.names == [p.name for p in pieces]
        assert bucket.starts == [p.start for p in pieces]
        for piece, tensor in zip(pieces, bucket.tensors):
            full = model_full[piece.name]
            rows = full if full.dim() == 0 else full[piece.start:piece.stop]
            assert tensor.dtype == rows.dtype and tensor.shape == rows.shape, piece
            assert raw_bytes(tensor) == raw_bytes(rows), piece


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_route_publishes_the_same_bytes_from_one_process(
        dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """One process (no process group), a 0-dimensional parameter and split ones included."""
    torch.manual_seed(0)
    model = Tiny()
    frames = published_frames(model, dtype, 100,
                              lambda name, value: monkeypatch.setattr(weight_buckets, name,
                                                                      value))
    check_frames(frames, gather_full_weights(model, dtype), plan_buckets(model, dtype, 100))


def routes_from_rank(rank: int, world: int, port: int, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        torch.manual_seed(0)
        model = shard(Tiny(scalar=False), compute_dtype=torch.float32, blocks=(nn.Linear,))
        results = {}
        for dtype in (torch.float32, torch.bfloat16):
            frames = published_frames(model, dtype, 100,
                                      lambda name, value: setattr(weight_buckets, name, value))
            assert all(b is None for route in frames.values() for b in route) == (rank != 0)
            results[str(dtype)] = (frames, gather_full_weights(model, dtype))
        if rank == 0:
            torch.save(results, out_file)
    finally:
        dist.destroy_process_group()
    exit_worker()


def test_every_route_publishes_the_same_bytes_from_two_ranks(tmp_path: Path) -> None:
    """Two FSDP2 ranks (uneven shards: 7 rows; 1 row) over gloo, fp32 and bf16: the CUDA
    route's gathers (DTensor.full_tensor), run on the CPU, and the CPU route into reused
    buffers send exactly the bytes the CPU route sent into new tensors."""
    out = tmp_path / "routes.pt"
    mp.start_processes(routes_from_rank, args=(2, free_port(), str(out)), nprocs=2,
                       start_method="spawn")
    results = torch.load(out, weights_only=False)
    for dtype in (torch.float32, torch.bfloat16):
        frames, full = results[str(dtype)]
        check_frames(frames, full, plan_buckets(Tiny(scalar=False), dtype, 100))
