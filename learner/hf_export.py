"""The policy as a Hugging Face model folder, written one shard at a time.

``save_hf`` is a collective: the policy is gathered bucket by bucket
(``relay.learner.weight_buckets``, buckets of ``shard_bytes``) and rank 0 writes each parameter
into the safetensors shard of the bucket in which its last rows arrive, so that rank 0
holds one shard (and the parameter split across buckets that it is completing), never the
whole model. The folder reads like ``save_pretrained``'s: ``model.safetensors`` when there
is one shard, else ``model-0000i-of-0000N.safetensors`` and ``model.safetensors.index.json``;
``config.json`` and, for a generative model, ``generation_config.json``. Tied weights are
written once (``named_parameters`` lists them once); the config ties them again on load.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from relay.learner.weight_buckets import BucketPlan, gather_buckets, plan_buckets

DEFAULT_SHARD_BYTES = 1 << 30
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def row_counts(plan: BucketPlan) -> dict[str, int]:
    """Rows of each parameter (a 0-dimensional one has one)."""
    return {entry.name: entry.shape[0] if entry.shape else 1 for entry in plan.entries}


def shard_files(plan: BucketPlan) -> dict[int, str]:
    """The file of each bucket in which some parameter's last rows arrive."""
    rows = row_counts(plan)
    finishing = sorted({index for index, pieces in enumerate(plan.buckets)
                        for piece in pieces if piece.stop == rows[piece.name]})
    if len(finishing) == 1:
        return {finishing[0]: SINGLE_FILE}
    return {index: f"model-{n:05d}-of-{len(finishing):05d}.safetensors"
            for n, index in enumerate(finishing, start=1)}


def save_hf(model: nn.Module, folder: Path, dtype: torch.dtype,
            shard_bytes: int = DEFAULT_SHARD_BYTES,
            group: dist.ProcessGroup | None = None) -> None:
    """Write ``model`` (a Hugging Face model, sharded or not) into ``folder`` in ``dtype``;
    every rank calls it, rank 0 writes."""
    plan = plan_buckets(model, dtype, shard_bytes)
    files = shard_files(plan)
    row_count = row_counts(plan)
    is_rank0 = not dist.is_initialized() or dist.get_rank(group) == 0
    if is_rank0:
        folder.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    growing: dict[str, torch.Tensor] = {}  # parameters split across buckets, so far
    for index, bucket in enumerate(gather_buckets(model, plan, dtype, version=0, group=group)):
        if bucket is None:
            continue
        shard: dict[str, torch.Tensor] = {}
        for name, start, piece in zip(bucket.names, bucket.starts, bucket.tensors):
            rows = row_count[name]
            if start == 0 and (piece.dim() == 0 or piece.shape[0] == rows):
                shard[name] = piece
                continue
            full = growing.get(name)
            if full is None:
                full = growing[name] = torch.empty((rows, *piece.shape[1:]), dtype=dtype)
            full[start:start + piece.shape[0]].copy_(piece)
            if start + piece.shape[0] == rows:
                shard[name] = growing.pop(name)
        del bucket
        if shard:
            save_file(shard, str(folder / files[index]), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, files[index]))
    if not is_rank0:
        return
    if len(set(files.values())) > 1:
        index_json = {"metadata": {"total_size": plan.total_bytes},
                      "weight_map": dict(sorted(weight_map.items()))}
        (folder / INDEX_FILE).write_text(json.dumps(index_json, indent=2) + "\n")
    model.config.save_pretrained(str(folder))
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(str(folder))
