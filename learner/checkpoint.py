"""Checkpoints every ``trainer.save_freq`` steps.

Each checkpoint is a folder ``step-<N>`` under the checkpoint dir holding:

- ``dcp/``: the sharded model and optimizer state (``torch.distributed.checkpoint``),
  written by every rank in parallel, loadable at any world size;
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


def save_checkpoint(learner, folder: Path, step: int, version: int, keep_last: int,
                    tokenizer=None) -> Path:
    """Write ``folder/step-<step>`` on every rank (a collective) and prune old ones."""
    target = folder / f"step-{step}"
    model_state, optim_state = get_state_dict(learner.model, learner.optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(target / "dcp"))
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
