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

``write_state`` writes a whole state dict (a critic or a PRM read from a checkpoint's DCP
state by ``read_part``, a verl checkpoint's merged shards) as the folder of a model class
of ``transformers.AutoModel*`` (``save_pretrained``: ``model.safetensors``, sharded with an
index past ``shard_bytes``), with the config, generation config and tokenizer files of a
source folder. Relay's critic (``relay.learner.critic.ValueModel``: ``body.*`` and
``value_head.*``) is written as ``AutoModelForTokenClassification`` with one label, the
layout verl's critic has: ``body.X`` -> ``<base_model_prefix>.X``, ``value_head`` -> ``score``
(``value_model_as_token_classification``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from relay.buffer.durable import fsync_tree
from relay.learner import safe_dcp
from relay.learner.checkpoint_files import replace_folder
from relay.learner.weight_buckets import BucketPlan, gather_buckets, plan_buckets

DEFAULT_SHARD_BYTES = 1 << 30
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")  # not copied by ``copy_side_files``
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


class StateMismatch(ValueError):
    """A state dict that does not fit the model it is written as: the message names the
    missing, unexpected or misshapen keys."""


def read_part(dcp_folder: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The full tensors under ``prefix`` (``"critic.model."``, ``"prm.model."``) of the DCP
    state in ``dcp_folder``, keyed without the prefix, read in this one process without
    running any pickle the folder holds (``relay.learner.safe_dcp``); {} when none are
    there."""
    metadata = safe_dcp.RestrictedReader(str(dcp_folder)).read_metadata()
    state = {fqn: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
             for fqn, entry in metadata.state_dict_metadata.items()
             if fqn.startswith(prefix) and isinstance(entry, TensorStorageMetadata)}
    if state:
        safe_dcp.load(state, str(dcp_folder))
    return {fqn.removeprefix(prefix): tensor for fqn, tensor in state.items()}


def value_model_as_token_classification(state: dict[str, torch.Tensor],
                                        base_model_prefix: str) -> dict[str, torch.Tensor]:
    """A ``ValueModel``'s state (``body.*``, ``value_head.weight`` (1, H), ``value_head.bias``
    (1,)) under the names of ``AutoModelForTokenClassification`` with ``num_labels = 1``:
    ``<base_model_prefix>.*``, ``score.weight``, ``score.bias``; the same function,
    V(s_t) = score(h_t)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.startswith("body."):
            out[f"{base_model_prefix}.{name.removeprefix('body.')}"] = tensor
        elif name.startswith("value_head."):
            out[f"score.{name.removeprefix('value_head.')}"] = tensor
        else:
            raise StateMismatch(f"{name!r} is neither the critic's body nor its value head")
    return out


def value_model_name(name: str) -> str:
    """A parameter of verl's critic layout (``AutoModelForTokenClassification``, one label:
    ``<base_model_prefix>.X``, ``score.X``) as a ``ValueModel`` names it (``body.X``,
    ``value_head.X``); the inverse of ``value_model_as_token_classification``."""
    first, rest = name.split(".", 1)
    return f"value_head.{rest}" if first == "score" else f"body.{rest}"


def fit_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Check that ``state`` holds every parameter and persistent buffer of ``model`` (a
    tied weight once is enough) in its shape, and nothing else; ``StateMismatch`` names
    what differs."""
    expected = model.state_dict()
    every_parameter = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    required = ({name for name, _ in model.named_parameters()}  # a tied weight once
                | (set(expected) - every_parameter))  # persistent buffers
    missing = sorted(required - set(state))
    unexpected = sorted(set(state) - set(expected))
    misshapen = sorted(f"{name} {tuple(state[name].shape)} (the model's: "
                       f"{tuple(expected[name].shape)})" for name in set(state) & set(expected)
                       if state[name].shape != expected[name].shape)
    problems = [f"{what}: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"
                for what, names in (("missing", missing), ("unexpected", unexpected),
                                    ("of another shape", misshapen)) if names]
    if problems:
        raise StateMismatch(f"the weights do not fit {type(model).__name__} of this config: "
                            + "; ".join(problems))


def copy_side_files(source: Path, folder: Path, *, generation: bool) -> None:
    """Copy ``source``'s files other than weights, index and ``config.json`` (the tokenizer,
    a chat template, code an ``auto_map`` names) into ``folder``;
    ``generation_config.json`` only when ``generation``."""
    for path in sorted(source.iterdir()):
        if (path.is_file() and path.suffix not in WEIGHT_SUFFIXES
                and path.name not in (CONFIG_FILE, INDEX_FILE)
                and (generation or path.name != GENERATION_CONFIG_FILE)):
            shutil.copy2(path, folder / path.name)


def write_state(state: dict[str, torch.Tensor], config: PretrainedConfig,
                auto_class: type, folder: Path, dtype: torch.dtype, *,
                files_from: Path | None = None,
                shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """Write the whole ``state`` of an ``auto_class`` model (``AutoModelForCausalLM``,
    ``AutoModelForTokenClassification``) of ``config`` into ``folder`` (atomically) with
    ``save_pretrained``, floating-point tensors in ``dtype``, the config saying ``dtype``;
    the tokenizer and generation config come from ``files_from`` (``copy_side_files``).
    ``StateMismatch`` (nothing written) when ``state`` does not fit the model."""
    with torch.device("meta"):
        model: PreTrainedModel = auto_class.from_config(config, dtype=dtype)
    fit_state(model, state)
    model.load_state_dict({name: tensor.to(dtype) if tensor.is_floating_point() else tensor
                           for name, tensor in state.items()}, strict=False, assign=True)
    model.tie_weights()
    partial = partial_folder(folder)
    model.save_pretrained(str(partial), max_shard_size=shard_bytes)
    if files_from is not None:
        copy_side_files(files_from, partial, generation=model.can_generate())
    set_config_dtype(partial, dtype)
    commit_folder(partial, folder)
