"""The policy as a Hugging Face model folder, written one shard at a time.

``save_hf`` is a collective: the policy is gathered bucket by bucket
(``relay.learner.weight_buckets``, buckets of ``shard_bytes``) and rank 0 writes each parameter
into the safetensors shard of the bucket in which its last rows arrive, so that rank 0
holds one shard (and the parameter split across buckets that it is completing), never the
whole model. The folder reads like ``save_pretrained``'s: ``model.safetensors`` when there
is one shard, else ``model-0000i-of-0000N.safetensors`` and ``model.safetensors.index.json``;
``config.json`` (its ``dtype`` the one written) and, for a generative model,
``generation_config.json``. Tied weights are written once (``named_parameters`` lists them
once); the config ties them again on load.

``save_final`` writes a run's trained policy, ``RUN_DIR/final/``, with its tokenizer: the
files ``AutoModelForCausalLM.from_pretrained`` and vLLM load. ``convert_folder`` rewrites
such a folder (a checkpoint's ``hf/``, kept in float32) in another dtype, one safetensors
file at a time (``relay export``). Both write atomically: into ``<folder>.tmp``, renamed
into place once complete (``commit_folder``), so that a crash never leaves a partial
folder under the final name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedTokenizerBase

from relay.buffer.durable import fsync_tree
from relay.learner.checkpoint_files import replace_folder
from relay.learner.weight_buckets import BucketPlan, gather_buckets, plan_buckets

DEFAULT_SHARD_BYTES = 1 << 30
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
PARTIAL_SUFFIX = ".tmp"


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
    set_config_dtype(folder, dtype)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(str(folder))


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, as ``config.json`` and ``model.dtype`` spell it."""
    return str(dtype).removeprefix("torch.")


def set_config_dtype(folder: Path, dtype: torch.dtype) -> None:
    """Record ``dtype`` in ``folder/config.json``: under ``dtype`` (transformers 5) and
    ``torch_dtype`` (the key older transformers, and vLLM through them, read)."""
    path = folder / CONFIG_FILE
    config = json.loads(path.read_text(encoding="utf-8"))
    config["dtype"] = config["torch_dtype"] = dtype_name(dtype)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def commit_folder(partial: Path, folder: Path) -> None:
    """Make the completely written ``partial`` the folder ``folder``: its files and
    folders are synced (``relay.buffer.durable.fsync_tree``), then it is renamed into place,
    replacing a ``folder`` already there (moved aside to ``<folder>.replaced`` first,
    removed last)."""
    fsync_tree(partial)
    replace_folder(partial, folder)


def partial_folder(folder: Path) -> Path:
    """``<folder>.tmp``, emptied of what an interrupted write left there."""
    partial = folder.with_name(folder.name + PARTIAL_SUFFIX)
    if partial.exists():
        shutil.rmtree(partial)
    return partial


def save_final(model: nn.Module, folder: Path, dtype: torch.dtype,
               tokenizer: PreTrainedTokenizerBase | None = None,
               group: dist.ProcessGroup | None = None) -> Path:
    """Write the policy ``model`` into ``folder`` (``RUN_DIR/final``) in ``dtype`` with
    ``tokenizer``, atomically (module docstring). A collective: every rank calls it, rank 0
    (which passes the tokenizer) writes; returns ``folder``."""
    is_rank0 = not dist.is_initialized() or dist.get_rank(group) == 0
    partial = partial_folder(folder) if is_rank0 else folder
    save_hf(model, partial, dtype, group=group)
    if is_rank0:
        if tokenizer is not None:
            tokenizer.save_pretrained(str(partial))
        commit_folder(partial, folder)
    return folder


def convert_folder(source: Path, folder: Path, dtype: torch.dtype) -> None:
    """Write the Hugging Face folder ``source`` into ``folder`` (atomically) with its
    floating-point weights cast to ``dtype``, one safetensors file at a time; every other
    file (config, generation config, tokenizer) is copied, the config saying ``dtype``."""
    partial = partial_folder(folder)
    partial.mkdir(parents=True)
    total_bytes = 0
    for path in sorted(source.iterdir()):
        if path.is_dir():
            shutil.copytree(path, partial / path.name)
        elif path.suffix == ".safetensors":
            tensors = {name: tensor.to(dtype) if tensor.is_floating_point() else tensor
                       for name, tensor in load_file(str(path)).items()}
            total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
            save_file(tensors, str(partial / path.name), metadata={"format": "pt"})
        elif path.name != INDEX_FILE:
            shutil.copy2(path, partial / path.name)
    if (source / INDEX_FILE).is_file():
        index = json.loads((source / INDEX_FILE).read_text(encoding="utf-8"))
        index["metadata"] = {**index.get("metadata", {}), "total_size": total_bytes}
        (partial / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    set_config_dtype(partial, dtype)
    commit_folder(partial, folder)
