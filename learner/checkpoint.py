"""Checkpoints every ``trainer.save_freq`` steps.

Each checkpoint is a folder ``step-<N>`` under the checkpoint dir holding:

- ``dcp/``: the sharded state of every trained model and its optimizer
  (``torch.distributed.checkpoint``), written by every rank in parallel, loadable at any
  world size: the policy under ``model`` and ``optim``, and, where the algorithm has them,
  the critic (PPO) under ``critic`` and the implicit PRM (PRIME) under ``prm``;
- ``hf/``: the full policy and its tokenizer in Hugging Face format (rank 0), so the
  trained model loads with ``AutoModelForCausalLM.from_pretrained`` like any other;
- ``meta.json``: step and weight version.

Only the newest ``keep_last`` checkpoints are kept.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from learner.weights import gather_full_weights

logger = logging.getLogger(__name__)


def checkpoint_state(learner) -> dict[str, dict]:
    """The sharded state dicts a checkpoint holds, by name (see the module docstring)."""
    model_state, optim_state = get_state_dict(learner.model, learner.optimizer)
    state: dict[str, dict] = {"model": model_state, "optim": optim_state}
    for name, part in (("critic", learner.critic), ("prm", learner.prm)):
        if part is not None:
            part_model, part_optim = get_state_dict(part.model, part.optimizer)
            state[name] = {"model": part_model, "optim": part_optim}
    return state


def save_checkpoint(learner, folder: Path, step: int, version: int, keep_last: int,
                    tokenizer=None) -> Path:
    """Write ``folder/step-<step>`` on every rank (a collective) and prune old ones."""
    target = folder / f"step-{step}"
    dcp.save(checkpoint_state(learner), checkpoint_id=str(target / "dcp"))
    full = gather_full_weights(learner.model, torch.float32)
    if not dist.is_initialized() or dist.get_rank() == 0:
        module = learner.model
        module.save_pretrained(str(target / "hf"), state_dict=full)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(target / "hf"))
        (target / "meta.json").write_text(json.dumps({"step": step, "version": version}))
        saved = sorted(folder.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
        for old in saved[:-keep_last]:
            shutil.rmtree(old)
        logger.info("checkpoint saved to %s", target)
    if dist.is_initialized():
        dist.barrier()
    return target
