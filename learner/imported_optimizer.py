"""AdamW's state brought in from another trainer's checkpoint (``relay import-verl --optimizer``).

A folder of it (``FOLDER`` beside the imported model) holds, for every trained parameter
under its Hugging Face name, AdamW's first and second moments whole and in fp32
(``exp_avg.safetensors``, ``exp_avg_sq.safetensors``), and ``state.json``
(``ImportedAdamW``): Adam's step count t, what it came from, and the source run's
hyperparameters for the record. With ``actor.optim.state_path`` (``critic.optim.state_path``)
naming such a folder, a run that starts fresh (not ``--resume``) puts them into its AdamW
before the first step, each rank taking its FSDP2 shard, so that the update continues

    m_t = b1 m_{t-1} + (1 - b1) g_t,   v_t = b2 v_{t-1} + (1 - b2) g_t^2,
    p_t = p_{t-1} - lr (m_t / (1 - b1^t)) / (sqrt(v_t / (1 - b2^t)) + eps) - lr wd p_{t-1}

from the imported m, v and t instead of zeros and t = 0 (no bias-corrected restart, no loss
spike from a fresh second moment). The rate, betas and weight decay are this run's config;
the learning-rate schedule is this run's from its step 0 (a warm-up restarts: set
``lr_warmup_steps = 0`` to keep the rate). A run that resumes its own checkpoint ignores
the key: its checkpoint holds its optimizer.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from relay.configs.run_schema import IMPORTED_OPTIMIZER_STATE

FOLDER = "optimizer"  # beside the imported model's weights
STATE_FILE = IMPORTED_OPTIMIZER_STATE
MOMENTS = ("exp_avg", "exp_avg_sq")
FORMAT = "relay-adamw-1"


class ImportedStateError(ValueError):
    """The folder is not an imported AdamW state, or it does not fit the model: the message
    names the folder (and the config key) and what differs."""


class ImportedAdamW(msgspec.Struct, kw_only=True, frozen=True):
    """``state.json``: Adam's step count (the same for every parameter), where the state
    came from, and the source optimizer's hyperparameters, kept for the record (this run
    trains with its own)."""

    format: str = FORMAT
    step: int
    source: str
    hyperparameters: dict[str, Any] = {}


def write_adamw_state(folder: Path, moments: dict[str, dict[str, torch.Tensor]],
                      meta: ImportedAdamW) -> None:
    """Write ``moments`` ({"exp_avg": {name: tensor}, "exp_avg_sq": {...}}, the same names
    and shapes in both) as fp32 safetensors and ``meta`` as ``state.json`` into ``folder``."""
    names = {key: set(moments[key]) for key in MOMENTS}
    if names["exp_avg"] != names["exp_avg_sq"]:
        raise ImportedStateError(f"{folder}: exp_avg and exp_avg_sq name different "
                                 "parameters")
    folder.mkdir(parents=True, exist_ok=True)
    for key in MOMENTS:
        save_file({name: t.to(torch.float32).contiguous() for name, t in moments[key].items()},
                  str(moment_file(folder, key)))
    (folder / STATE_FILE).write_text(json.dumps(msgspec.to_builtins(meta), indent=2) + "\n",
                                     encoding="utf-8")


def read_adamw_meta(folder: Path, key: str) -> ImportedAdamW:
    """``state.json`` of ``folder`` (``key``: the config key that named it, for errors),
    once its moment files are known to be there."""
    state_file = folder / STATE_FILE
    if not state_file.is_file():
        raise ImportedStateError(f"{key} = {str(folder)!r}: no {STATE_FILE} there; the folder "
                                 "is what `relay import-verl --optimizer` writes (OUT/optimizer)")
    try:
        meta = msgspec.json.decode(state_file.read_bytes(), type=ImportedAdamW)
    except msgspec.ValidationError as exc:
        raise ImportedStateError(f"{state_file}: {exc}") from exc
    if meta.format != FORMAT:
        raise ImportedStateError(f"{state_file}: format {meta.format!r}, this Relay reads "
                                 f"{FORMAT!r}")
    for moment in MOMENTS:
        if not moment_file(folder, moment).is_file():
            raise ImportedStateError(f"{key} = {str(folder)!r}: "
                                     f"{moment_file(folder, moment).name} is missing")
    return meta


def moment_file(folder: Path, moment: str) -> Path:
    return folder / f"{moment}.safetensors"


def load_imported_state(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path,
                        key: str, rename: Callable[[str], str] = lambda name: name) -> str:
    """Put the AdamW state in ``folder`` into ``optimizer`` (built over ``model``'s trainable
    parameters, untouched yet); what was loaded, in words. ``rename``: an imported name as
    ``model`` names that parameter. Refused (``ImportedStateError``, naming ``key``) when the
    names or shapes differ from the trainable parameters', or the optimizer has stepped.
    The files are read one parameter at a time: a rank holds one whole moment at once,
    besides its shards."""
    meta = read_adamw_meta(folder, key)
    if any(optimizer.state.values()):
        raise ImportedStateError(f"{key}: the optimizer has state already; an imported "
                                 "state goes into a fresh one")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    names = {id(p): name for name, p in model.named_parameters()}
    ours = [names[id(p)] for p in params]
    state: dict[int, dict[str, torch.Tensor]] = {index: {"step": torch.tensor(float(meta.step))}
                                                 for index in range(len(params))}
    for moment in MOMENTS:
        with safe_open(str(moment_file(folder, moment)), framework="pt") as tensors:
            stored = {rename(name): name for name in tensors.keys()}
            check_names(ours, set(stored), folder, key)
            for index, (name, param) in enumerate(zip(ours, params, strict=True)):
                shape = tuple(tensors.get_slice(stored[name]).get_shape())
                if shape != tuple(param.shape):
                    raise ImportedStateError(f"{key} = {str(folder)!r}: {moment} of {name} is "
                                             f"{shape}, the parameter {tuple(param.shape)}")
                state[index][moment] = shard_like(tensors.get_tensor(stored[name]), param)
    optimizer.load_state_dict({"state": state,
                               "param_groups": optimizer.state_dict()["param_groups"]})
    return (f"{key}: AdamW state of {len(params)} parameters at step {meta.step} from "
            f"{meta.source}")


def check_names(ours: list[str], imported: set[str], folder: Path, key: str) -> None:
    """The imported names are exactly the trainable parameters' (``ImportedStateError``
    naming the first few that differ)."""
    missing = [n for n in ours if n not in imported]
    extra = sorted(imported.difference(ours))
    if missing or extra:
        def few(names: list[str]) -> str:
            return ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
        raise ImportedStateError(
            f"{key} = {str(folder)!r} does not fit the model that trains: "
            + "; ".join(part for part in (
                f"no state for {len(missing)} of its parameters ({few(missing)})"
                if missing else "",
                f"state for {len(extra)} parameters it does not train ({few(extra)})"
                if extra else "") if part)
            + " (another model, or LoRA: the import carries a full model's state)")


def shard_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``full`` as ``param`` holds it: this rank's shard of a DTensor parameter, cut locally
    from the whole tensor every rank has read (no communication), else the tensor."""
    full = full.to(torch.float32)
    if isinstance(param, DTensor):
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return full
