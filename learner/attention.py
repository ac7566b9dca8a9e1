"""The learner's attention: one implementation that picks, per forward, what the inputs ask.

Models the learner runs use ``relay`` (registered with transformers' ``AttentionInterface``,
and its mask with ``AttentionMaskInterface`` as SDPA's): a forward given ``ulysses`` runs
Ulysses attention (``learner.ulysses``), one given ``shared_prompt_rows`` runs shared-prompt
rows (``learner.shared_prompts``), any other runs transformers' SDPA attention. The choice
rides on the forward's own inputs, not on a setting swapped around the call, so
gradient checkpointing, which runs each block's forward again during the backward with
the same inputs, recomputes exactly what the forward computed.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from learner.shared_prompts import shared_prompt_attention
from learner.ulysses import ulysses_attention

ATTENTION = "relay"


def relay_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: torch.Tensor | None,
                    **kwargs: object) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention interface: Ulysses, shared-prompt rows or SDPA (module
    docstring)."""
    if kwargs.get("ulysses") is not None:
        return ulysses_attention(module, query, key, value, attention_mask, **kwargs)
    if kwargs.get("shared_prompt_rows") is not None:
        return shared_prompt_attention(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(ATTENTION, relay_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def use_relay_attention(model: nn.Module) -> None:
    """Make ``model`` (anything with a transformers ``config``) attend with ``relay``."""
    model.config._attn_implementation = ATTENTION
