"""The policy's LoRA adapters in vLLM's LoRA support: a generator's side of an adapters-only
publish (``relay.configs.lora_publish``).

vLLM runs the base model it loaded at start and, for every request that carries the
adapter's ``LoRARequest``, each adapted linear layer as

    y = W x + (alpha / r) B (A x)        A: (r, in), B: (out, r)

A version from the learner is then A and B alone, under peft's file names
(``base_model.model.<module>.lora_A.weight``). ``PolicyAdapter`` checks it against the names
and shapes peft gives the run's LoRA config on the model (built on the ``meta`` device,
nothing allocated), writes it as a peft folder (``adapter_model.safetensors`` beside the
resolved ``adapter_config.json``) in a private temporary folder, on ``/dev/shm`` when the
machine has it (verl's ``model.use_shm``), and loads it with vLLM's ``LLMEngine.add_lora``
with ``load_inplace``: one adapter id for the whole run, so from the next engine step every
request, those in flight too, runs with the new adapters, as Relay's in-place full-weight
updates do (the per-token versions say which tokens came from which).

Before the first version the adapters are those of ``model.lora_adapter_path`` when the run
starts from one; otherwise none is loaded: fresh adapters have B = 0, so the base model alone
is the same policy.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from relay.configs.lora_adapter import (ADAPTER, ADAPTER_WEIGHTS, file_name, is_adapter,
                                        lora_config)
from relay.configs.run_schema import ModelConfig
from relay.generators.engine import check_weights

logger = logging.getLogger(__name__)

ADAPTER_NAME = "relay-policy"
ADAPTER_ID = 1  # vLLM's id of the run's one adapter (ids start at 1)
VLLM_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's ``max_lora_rank`` values
SHM = Path("/dev/shm")


def max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds adapters of ``rank``;
    ValueError naming ``model.lora_rank`` above vLLM's largest."""
    for allowed in VLLM_MAX_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"actor_rollout_ref.model.lora_rank = {rank}: vLLM's LoRA support takes "
                     f"ranks up to {VLLM_MAX_RANKS[-1]}; set [generators.vllm] enable_lora = "
                     "false to publish merged weights instead")


def adapter_layout(model: ModelConfig) -> tuple[dict[str, torch.Size], Any]:
    """The adapters' names (peft's file names) and shapes for ``model``'s LoRA keys, and
    peft's config with ``target_modules`` resolved (``all-linear`` become the names), from
    the model's config alone (its modules on the ``meta`` device), as the learner's
    ``relay.learner.lora.wrap`` makes them."""
    from peft import get_peft_model  # the lora extra

    config = AutoConfig.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config,
                                                trust_remote_code=model.trust_remote_code)
    peft_model = get_peft_model(base, lora_config(model))
    shapes = {file_name(name): param.shape for name, param in peft_model.named_parameters()
              if is_adapter(name)}
    return shapes, peft_model.peft_config[ADAPTER]


def adapter_folder() -> Path:
    """A new private folder for the adapter files: on ``/dev/shm`` when it is writable."""
    where = SHM if SHM.is_dir() and os.access(SHM, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="relay-lora-", dir=where))


class PolicyAdapter:
    """The run's one adapter in a ``vllm.LLM`` started with ``enable_lora`` (module
    docstring): ``request`` goes with every request, ``load`` takes a version."""

    def __init__(self, llm: Any, model: ModelConfig) -> None:
        self.llm = llm
        self.shapes, peft_config = adapter_layout(model)
        self.folder = adapter_folder()
        weakref.finalize(self, shutil.rmtree, self.folder, ignore_errors=True)
        peft_config.base_model_name_or_path = model.path
        peft_config.inference_mode = True
        peft_config.save_pretrained(str(self.folder))
        self.request: Any = None
        if model.lora_adapter_path is not None:
            self._add(model.lora_adapter_path)
        logger.info("vLLM runs the policy's LoRA adapters (%d tensors, rank %d) over the base "
                    "model; versions are the adapters alone, written to %s",
                    len(self.shapes), model.lora_rank, self.folder)

    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Check ``tensors`` (``WeightMismatch`` naming the first difference: nothing
        changes), write them and load them in place of the adapter vLLM holds."""
        check_weights(self.shapes, tensors)
        staged = self.folder / f".{ADAPTER_WEIGHTS}"
        save_file({name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()},
                  str(staged), metadata={"format": "pt"})
        os.replace(staged, self.folder / ADAPTER_WEIGHTS)
        self._add(str(self.folder))

    def _add(self, path: str) -> None:
        from vllm.lora.request import LoRARequest

        if not self.llm.llm_engine.add_lora(LoRARequest(ADAPTER_NAME, ADAPTER_ID, path,
                                                        load_inplace=True)):
            raise RuntimeError(f"vLLM did not load the LoRA adapter written to {path}")
        self.request = LoRARequest(ADAPTER_NAME, ADAPTER_ID, path)
