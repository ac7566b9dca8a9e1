"""verl's rank files read safely, and its AdamW shards put together by parameter name
(``relay import-verl``; ``--optimizer``).

Every rank file is read with ``torch.load(weights_only=True)`` (``read_shard``): tensors,
DTensors and plain containers load, nothing in them runs code.

verl's ``FSDPCheckpointManager`` saves each rank's raw ``optimizer.state_dict()`` as
``optim_world_size_W_rank_R.pt``: ``state`` keyed by the index of a parameter in
``model.parameters()`` order, each ``{"step", "exp_avg", "exp_avg_sq"}``, and
``param_groups``. What a parameter is there depends on verl's FSDP version:

- FSDP2 (``strategy = "fsdp2"``): the model's own parameters, in ``named_parameters()``
  order of the Hugging Face model, each moment a DTensor shard; put together as the weights
  are (``relay.dtensor_merge``).
- FSDP1 (``strategy = "fsdp"``, ``use_orig_params = False``, verl's default): one flat
  parameter per FSDP unit, every unit's parameters flattened and concatenated in
  ``named_parameters()`` order, and each rank holding chunk R of it cut as ``torch.chunk``
  cuts (padded with zeros to the first chunk's size). verl's default wrap policy makes a unit
  of each module whose class is in the model's ``_no_split_modules`` (its decoder layers)
  and one of the root holding the rest; ``model.parameters()`` lists the root's flat
  parameter first, then the layers' in order. The moments of unit u (N elements) are the
  ranks' chunks concatenated, cut to N, and split into its parameters' shapes; each rank's
  chunk must be ceil(N / W) elements, else the wrap policy was another one and the import
  is refused.

Adam's step count must be one number for every parameter. A LoRA checkpoint (adapters in
the model's names) is refused: Relay's imported state is a full model's.
"""

from __future__ import annotations

import math
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import PretrainedConfig

from relay.dtensor_merge import merge_dtensor
from relay.learner.hf_export import StateMismatch
from relay.learner.imported_optimizer import MOMENTS, ImportedAdamW

OPTIM_SHARD = "optim_world_size_{world}_rank_{rank}.pt"
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "amsgrad")


class VerlImportError(Exception):
    """Why nothing was imported: the message names the folder or file."""


def read_shard(path: Path) -> Any:
    """One rank file, read without running code (``weights_only=True``)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise VerlImportError(f"{path}: refused, it holds more than tensors "
                              f"(torch.load(weights_only=True): "
                              f"{str(exc).splitlines()[0]})") from exc
    except (OSError, RuntimeError, EOFError) as exc:
        raise VerlImportError(f"{path}: does not load ({exc})") from exc


def load_optim_shard(path: Path) -> dict[str, Any]:
    """One rank's ``optimizer.state_dict()``."""
    if not path.is_file():
        raise VerlImportError(f"{path}: missing (verl saves it unless "
                              "checkpoint.save_contents leaves 'optimizer' out)")
    state = read_shard(path)
    if not isinstance(state, dict) or set(state) != {"state", "param_groups"}:
        raise VerlImportError(f"{path}: not an optimizer state dict (state, param_groups)")
    return state


def meta_model(config: PretrainedConfig, auto_class: Any) -> nn.Module:
    """The model verl trained, built on ``meta``: its parameters' names, order and shapes."""
    with torch.device("meta"):
        return auto_class.from_config(config)


def import_adamw(folder: Path, world: int, model: nn.Module,
                 source: str) -> tuple[ImportedAdamW, dict[str, dict[str, torch.Tensor]]]:
    """The AdamW state of the verl model in ``folder`` (``world`` ranks), whole and by
    parameter name, with its ``state.json`` record (module docstring)."""
    paths = [folder / OPTIM_SHARD.format(world=world, rank=r) for r in range(world)]
    shards = [load_optim_shard(path) for path in paths]
    params = list(model.named_parameters())
    if any("lora_" in name for name, _ in params):
        raise VerlImportError(f"{folder}: a LoRA model; --optimizer imports a full "
                                   "model's AdamW state only")
    counts = {len(s["state"]) for s in shards}
    if len(counts) != 1:
        raise VerlImportError(f"{folder}: the ranks' optimizer shards hold states for "
                                   f"different numbers of parameters ({sorted(counts)})")
    first = next(iter(shards[0]["state"].values()), None)
    if first is None:
        raise VerlImportError(f"{paths[0]}: no optimizer state: the run never stepped")
    try:
        if isinstance(first["exp_avg"], DTensor):
            moments, steps = merge_fsdp2(shards, params, paths[0])
        else:
            moments, steps = merge_fsdp1(shards, flat_units(model), world, paths[0])
    except (KeyError, StateMismatch) as exc:
        raise VerlImportError(f"{folder}: {exc}") from exc
    if len(steps) != 1:
        raise VerlImportError(f"{folder}: Adam's step counts differ across parameters "
                                   f"({sorted(steps)}); Relay imports one")
    group = shards[0]["param_groups"][0]
    meta = ImportedAdamW(step=steps.pop(), source=source,
                         hyperparameters={k: group[k] for k in HYPERPARAMETERS if k in group})
    return meta, moments


def merge_fsdp2(shards: list[dict[str, Any]], params: list[tuple[str, nn.Parameter]],
                first_path: Path) -> tuple[dict[str, dict[str, torch.Tensor]], set[int]]:
    """FSDP2: state i is the i-th parameter's, its moments DTensor shards."""
    indices = sorted(shards[0]["state"])
    if len(indices) != len(params):
        raise StateMismatch(f"{first_path.name} holds state for {len(indices)} parameters, "
                            f"the model has {len(params)}")
    moments: dict[str, dict[str, torch.Tensor]] = {m: {} for m in MOMENTS}
    steps = set()
    for index, (name, param) in zip(indices, params, strict=True):
        for moment in MOMENTS:
            full = merge_dtensor(f"{moment} of {name}",
                                 [shard["state"][index][moment] for shard in shards])
            if full.shape != param.shape:
                raise StateMismatch(f"{moment} of {name} (state {index}) is "
                                    f"{tuple(full.shape)}, the parameter {tuple(param.shape)}")
            moments[moment][name] = full
        steps.update(int(shard["state"][index]["step"]) for shard in shards)
    return moments, steps


def flat_units(model: nn.Module) -> list[list[tuple[str, torch.Size]]]:
    """verl's FSDP1 units of ``model`` under its default wrap policy (module docstring):
    the root's parameters, then each ``_no_split_modules`` module's, in the order of
    ``model.parameters()``; units without parameters are left out, as FSDP leaves them."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    prefixes = [f"{name}." for name, module in model.named_modules()
                if name and type(module).__name__ in classes]
    units: dict[str, list[tuple[str, torch.Size]]] = {"": [], **{p: [] for p in prefixes}}
    for name, param in model.named_parameters():
        owner = max((p for p in prefixes if name.startswith(p)), key=len, default="")
        units[owner].append((name, param.shape))
    return [unit for unit in units.values() if unit]


def merge_fsdp1(shards: list[dict[str, Any]], units: list[list[tuple[str, torch.Size]]],
                world: int, first_path: Path
                ) -> tuple[dict[str, dict[str, torch.Tensor]], set[int]]:
    """FSDP1: state u is unit u's flat parameter, each rank's moment its padded chunk."""
    indices = sorted(shards[0]["state"])
    if len(indices) != len(units):
        raise StateMismatch(
            f"{first_path.name} holds state for {len(indices)} parameters; verl's default "
            f"FSDP1 wrapping of this model makes {len(units)} flat parameters (the root and "
            "each _no_split_modules module). Another wrap policy (fsdp_config.wrap_policy) "
            "or use_orig_params = true is not a layout this import reads")
    moments: dict[str, dict[str, torch.Tensor]] = {m: {} for m in MOMENTS}
    steps = set()
    for index, unit in zip(indices, units, strict=True):
        numel = sum(math.prod(shape) for _, shape in unit)
        chunk = math.ceil(numel / world)
        for moment in MOMENTS:
            pieces = [shard["state"][index][moment] for shard in shards]
            sizes = sorted({piece.numel() for piece in pieces})
            if sizes != [chunk]:
                raise StateMismatch(
                    f"{moment} of flat parameter {index} ({unit[0][0]} ...): {sizes} elements "
                    f"per rank, but the unit's {numel} elements over {world} ranks are "
                    f"{chunk}: verl wrapped the model otherwise (fsdp_config.wrap_policy)")
            flat = torch.cat([piece.reshape(-1) for piece in pieces])[:numel]
            for (name, shape), part in zip(unit, flat.split([math.prod(s) for _, s in unit]),
                                           strict=True):
                moments[moment][name] = part.reshape(shape).clone()
        steps.update(int(shard["state"][index]["step"]) for shard in shards)
    return moments, steps
