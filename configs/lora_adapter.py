"""A LoRA adapter as the run config describes it: peft's config for the model keys, and the
names of its files and tensors. Shared by the learner, which trains the adapters
(``relay.learner.lora``), and a vLLM generator, which runs them
(``relay.generators.vllm_lora``). peft (the ``lora`` extra) is imported only when a config
is built."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relay.configs.run_schema import CriticModelConfig, ModelConfig

LoraConfig = Any  # peft's LoraConfig (peft is imported only when one is built)

ADAPTER = "default"  # peft's name for the one adapter
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
KEY = "actor_rollout_ref.model"  # the config section the errors name


def lora_config(model_config: ModelConfig) -> LoraConfig:
    """The peft config for ``model``'s keys, or that of ``lora_adapter_path`` (its rank
    must be ``lora_rank``: ValueError naming both otherwise)."""
    from peft import LoraConfig  # the lora extra

    if model_config.lora_adapter_path is None:
        return fresh_config(model_config, task_type="CAUSAL_LM")
    folder = Path(model_config.lora_adapter_path)
    if not (folder / ADAPTER_CONFIG).is_file():
        raise ValueError(f"{KEY}.lora_adapter_path = {str(folder)!r}: no {ADAPTER_CONFIG} there "
                         "(a peft adapter folder, as PeftModel.save_pretrained writes)")
    config = LoraConfig.from_pretrained(str(folder))
    if config.r != model_config.lora_rank:
        raise ValueError(f"{KEY}.lora_adapter_path = {str(folder)!r} has rank {config.r}, "
                         f"{KEY}.lora_rank is {model_config.lora_rank}: make them equal")
    config.inference_mode = False
    return config


def fresh_config(model_config: ModelConfig | CriticModelConfig,
                 task_type: str | None) -> LoraConfig:
    """New adapters from the section's ``lora_rank``, ``lora_alpha``, ``target_modules``,
    ``exclude_modules``: dropout 0, no bias, peft's ``task_type`` (None: a bare body)."""
    from peft import LoraConfig  # the lora extra

    return LoraConfig(r=model_config.lora_rank, lora_alpha=model_config.lora_alpha,
                      target_modules=model_config.target_modules,
                      exclude_modules=model_config.exclude_modules, lora_dropout=0.0,
                      bias="none", task_type=task_type)


def is_adapter(peft_name: str) -> bool:
    """Whether a peft model's parameter ``peft_name`` is an adapter's (A or B)."""
    return ".lora_" in peft_name


def file_name(peft_name: str) -> str:
    """An adapter parameter's name in peft's files (``get_peft_model_state_dict``'s: the
    adapter's name left out): ``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight``."""
    return peft_name.replace(f".{ADAPTER}.", ".")
