"""SFT checkpoints: ``global_step_<N>`` folders (verl's name), written atomically, resumed.

A checkpoint holds what the SFT trainer (``relay.learner.sft``) needs to go on after step N:

- ``dcp/``: the sharded model and optimizer state (``torch.distributed.checkpoint``, every
  rank writing its shards; loadable at any world size, read without running pickles:
  ``relay.learner.safe_dcp``);
- ``hf/``: the model in float32 and its tokenizer as a Hugging Face folder
  (``relay.learner.hf_export.save_hf``; a LoRA model's merged weights): any checkpoint is
  a ``model.path``;
- ``adapter/``, a LoRA model's only: its adapters in peft's format
  (``relay.learner.lora.save_adapter``), and ``dcp/`` then holds the adapters and their
  optimizer state alone (the frozen base is ``model.partial_pretrain``'s);
- ``meta.json`` (``SftCheckpointMeta``, written last): the step, the schedule's state, the
  world size and the MLflow run.

Everything is written into ``global_step_<N>.tmp`` and renamed into place once complete
(``relay.learner.checkpoint_files.replace_folder``), so a folder named ``global_step_<N>``
with a ``meta.json`` is whole; ``trainer.max_ckpt_to_keep`` prunes the oldest. The data
order is a function of the step (``relay.learner.sft``), so the step is all the loop needs.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)
from transformers import PreTrainedTokenizerBase

from relay.buffer.durable import fsync_tree
from relay.learner import safe_dcp
from relay.learner.checkpoint_files import CheckpointError, replace_folder, write_durably
from relay.learner.hf_export import save_hf
from relay.learner.optim import configured_values, reapply_configured

logger = logging.getLogger(__name__)

FORMAT = 1
META_FILE = "meta.json"
NAME = re.compile(r"global_step_(\d+)")
PARTIAL_SUFFIX = ".tmp"
ADAPTER_FOLDER = "adapter"


class SftCheckpointMeta(msgspec.Struct, kw_only=True, frozen=True):
    """What ``meta.json`` says: the step, the schedule's ``state_dict``, the world size
    that wrote it, the MLflow run, when."""

    format: int
    step: int
    scheduler: dict
    world_size: int
    mlflow_run_id: str = ""
    saved_at: float = 0.0


def _all_trained(model: nn.Module) -> bool:
    """Whether every parameter trains (no frozen LoRA base)."""
    return all(p.requires_grad for p in model.parameters())


def _options(model: nn.Module) -> StateDictOptions:
    """The state a checkpoint holds: the trained parameters (a LoRA model's adapters), as
    the RL learner's checkpoints do (``relay.learner.checkpoint``)."""
    return StateDictOptions(ignore_frozen_params=True, strict=_all_trained(model))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_sft_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer,
                        scheduler: torch.optim.lr_scheduler.LRScheduler, folder: Path,
                        step: int, *, tokenizer: PreTrainedTokenizerBase | None = None,
                        mlflow_run_id: str = "", keep: int | None = None,
                        group: dist.ProcessGroup | None = None) -> Path:
    """Write ``folder/global_step_<step>`` (a collective: every rank calls it; rank 0 passes
    the tokenizer); keep the newest ``keep`` checkpoints (None: all). ``group``: a gloo
    group of every rank for the Hugging Face export on GPUs."""
    final = folder / f"global_step_{step}"
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    if _rank() == 0:
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
    _barrier()
    model_state, optim_state = get_state_dict(model, optimizer, options=_options(model))
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(partial / "dcp"))
    save_hf(model, partial / "hf", torch.float32, group=group)
    if not _all_trained(model):
        from relay.learner.lora import save_adapter  # peft: the lora extra
        save_adapter(model, partial / ADAPTER_FOLDER, group=group)
    _barrier()
    if _rank() == 0:
        if tokenizer is not None:
            tokenizer.save_pretrained(str(partial / "hf"))
        meta = SftCheckpointMeta(format=FORMAT, step=step, scheduler=scheduler.state_dict(),
                                 world_size=dist.get_world_size() if dist.is_initialized()
                                 else 1, mlflow_run_id=mlflow_run_id, saved_at=time.time())
        fsync_tree(partial)
        write_durably(partial / META_FILE, msgspec.json.encode(meta))
        replace_folder(partial, final)
        if keep is not None:
            for _, old in complete_checkpoints(folder)[:-keep]:
                shutil.rmtree(old)
        logger.info("checkpoint saved to %s", final)
    _barrier()
    return final


def complete_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete ``global_step_<N>`` in ``folder``, oldest first."""
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        match = NAME.fullmatch(path.name)
        if match and (path / META_FILE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def newest_checkpoint(folder: Path) -> Path | None:
    """The complete checkpoint of the highest step in ``folder`` (``resume_mode = auto``)."""
    found = complete_checkpoints(folder)
    return found[-1][1] if found else None


def read_sft_meta(checkpoint: Path) -> SftCheckpointMeta:
    """``checkpoint``'s meta; a ``CheckpointError`` naming it when it is not an SFT
    checkpoint of this format."""
    try:
        meta = msgspec.json.decode((checkpoint / META_FILE).read_bytes(),
                                   type=SftCheckpointMeta)
    except (OSError, msgspec.DecodeError) as exc:
        raise CheckpointError(f"{checkpoint}: not an SFT checkpoint ({META_FILE}: {exc})"
                              ) from None
    if meta.format != FORMAT:
        raise CheckpointError(f"{checkpoint}: SFT checkpoint format {meta.format}, this "
                              f"Relay reads {FORMAT}")
    return meta


def load_sft_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer,
                        scheduler: torch.optim.lr_scheduler.LambdaLR,
                        checkpoint: Path) -> SftCheckpointMeta:
    """Put ``checkpoint``'s weights, optimizer state and schedule back (a collective); the
    config's learning rate, betas and weight decay are kept over the checkpoint's
    (``relay.learner.optim.reapply_configured``). Returns its meta."""
    meta = read_sft_meta(checkpoint)
    configured = configured_values(optimizer, scheduler)
    model_state, optim_state = get_state_dict(model, optimizer, options=_options(model))
    state = {"model": model_state, "optim": optim_state}
    try:
        safe_dcp.load(state, str(checkpoint / "dcp"))
    except CheckpointError:
        raise
    except Exception as exc:  # DCP's CheckpointException, a shape mismatch
        raise CheckpointError(f"{checkpoint}: its weights do not fit this model "
                              f"(model.partial_pretrain must be the model it was written "
                              f"from): {exc}") from exc
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=_options(model))
    scheduler.load_state_dict(meta.scheduler)
    for change in reapply_configured(optimizer, scheduler, configured, "optim"):
        if _rank() == 0:
            logger.info("%s: %s", checkpoint, change)
    return meta
