"""Building an inference engine and its tokenizer from a run's model section.

Shared by the generator process (``relay.generators.main``) and the evaluator
(``relay.generators.evaluator``). ``eos_and_pad`` collects every id that ends a response: the
tokenizer's eos and the model's ``generation_config.json`` eos ids. The lean engine sizes
its KV cache up front from the placement's ``lean`` options (``relay.generators.kv_cache``).
"""

from __future__ import annotations

import importlib.util

import torch
from transformers import AutoTokenizer, GenerationConfig

from relay.configs.run_schema import ModelConfig
from relay.configs.topology_schema import EvaluatorPlacement, GeneratorPlacement
from relay.generators.engine import Engine
from relay.generators.hf_engine import HFEngine
from relay.generators.lean_engine import LeanEngine
from relay.generators.lean_model import CacheMemory, UnsupportedModel
from relay.generators.sglang_engine import INSTALL_HINT as SGLANG_INSTALL_HINT
from relay.generators.sglang_engine import SGLangEngine
from relay.generators.torch_engine import TorchEngine
from relay.generators.vllm_engine import INSTALL_HINT as VLLM_INSTALL_HINT
from relay.generators.vllm_engine import VLLMEngine

ENGINES: dict[str, type[Engine]] = {"lean": LeanEngine, "torch": TorchEngine, "hf": HFEngine}
"""Relay's own engines; ``vllm`` and ``sglang`` (``build_engine``) take engine options."""


ENGINE_PACKAGES: dict[str, tuple[str, str]] = {"vllm": ("vllm", VLLM_INSTALL_HINT),
                                               "sglang": ("sglang", SGLANG_INSTALL_HINT)}
"""The engines that need a package of their own: its module, and how to install it."""


def missing_engine(engine: str) -> str | None:
    """Why ``engine`` cannot start in this Python environment (its package is not
    installed), or None. Looks the package up without importing it."""
    if engine not in ENGINE_PACKAGES:
        return None
    module, hint = ENGINE_PACKAGES[engine]
    if importlib.util.find_spec(module) is not None:
        return None
    return f"engine {engine!r} needs the {module} package, which is not installed here. {hint}"


def eos_and_pad(model_path: str, tokenizer) -> tuple[list[int], int]:
    """All eos ids (tokenizer and generation config) and the pad id (eos if none)."""
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        generation = GenerationConfig.from_pretrained(model_path)
        extra = generation.eos_token_id
        eos.update(extra if isinstance(extra, list) else [extra] if extra is not None else [])
    except OSError:
        pass  # no generation_config.json: the tokenizer's eos is all there is
    if not eos:
        raise ValueError(f"{model_path}: the tokenizer has no eos token; generation could not stop")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    return sorted(eos), pad


def build_engine(model: ModelConfig, placement: GeneratorPlacement | EvaluatorPlacement,
                 seed: int, *, max_num_seqs: int, max_len: int,
                 lora_adapters: bool = False) -> tuple[Engine, object]:
    """The engine ``placement`` names (``placement.engine`` on ``placement.device``)
    holding ``model``, and its tokenizer; with ``lora_adapters`` (vLLM only) one whose
    versions are the LoRA policy's adapters alone (``relay.configs.lora_publish``). Raises ``ValueError`` naming the setting when the
    engine cannot run the model, ``VLLMUnavailable`` / ``SGLangUnavailable`` saying how to
    install vLLM / SGLang when it is missing."""
    tokenizer = AutoTokenizer.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
    eos, pad = eos_and_pad(model.path, tokenizer)
    common = dict(dtype=getattr(torch, model.dtype), device=placement.device, eos_ids=eos,
                  pad_id=pad, seed=seed, trust_remote_code=model.trust_remote_code)
    engine = placement.engine
    if lora_adapters and engine != "vllm":
        raise ValueError(f"engine \"{engine}\" takes merged weights, not LoRA adapters alone")
    if engine == "vllm":
        return VLLMEngine.from_pretrained(model.path, max_num_seqs=max_num_seqs,
                                          max_len=max_len, options=placement.vllm,
                                          lora=model if lora_adapters else None,
                                          **common), tokenizer
    if engine == "sglang":
        return SGLangEngine.from_pretrained(model.path, max_num_seqs=max_num_seqs,
                                            max_len=max_len, options=placement.sglang,
                                            **common), tokenizer
    if engine != "lean":
        return ENGINES[engine].from_pretrained(model.path, **common), tokenizer
    try:
        memory = CacheMemory(gpu_memory_utilization=placement.lean.gpu_memory_utilization,
                             max_num_batched_tokens=placement.lean.max_num_batched_tokens)
        built = LeanEngine.from_pretrained(model.path, max_num_seqs=max_num_seqs,
                                           max_len=max_len, memory=memory, **common)
    except UnsupportedModel as error:
        raise ValueError(f"{model.path}: the lean engine does not run {error}; set engine = "
                         "\"torch\" for this generator in the topology") from None
    return built, tokenizer
