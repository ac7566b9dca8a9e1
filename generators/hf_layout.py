"""What a served model's weights look like in Hugging Face form: names, shapes, tied tensors.

Engines that hold the model in another runtime (vLLM, SGLang) cannot list Relay's
parameters from a module in this process; ``parameter_shapes`` reads them from the model's
config instead, and ``hf_tensors`` turns a weight version into the named tensors
those runtimes' ``load_weights`` read. This module knows Hugging Face names; it knows
nothing of either runtime's own layout (fused q/k/v, sharding): they convert themselves.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def hf_tensors(tensors: Mapping[str, torch.Tensor],
               tied_embeddings: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The named tensors a runtime's ``load_weights`` reads: Relay's set (the model's
    parameter names) and, for tied embeddings, ``lm_head.weight`` too, which a runtime may
    keep as a tensor of its own that would otherwise stay at the old version."""
    yield from tensors.items()
    if tied_embeddings and "lm_head.weight" not in tensors:
        yield "lm_head.weight", tensors["model.embed_tokens.weight"]


def parameter_shapes(path: str, trust_remote_code: bool) -> tuple[dict[str, torch.Size], bool]:
    """The Hugging Face parameter names and shapes of the model at ``path`` (built on the
    meta device: no memory, no weights read), and whether it ties its embeddings."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
    return {name: p.shape for name, p in model.named_parameters()}, tied
