"""The learner's attention: one implementation that picks, per forward, what the inputs ask.

Models the learner runs use ``relay`` (registered with transformers' ``AttentionInterface``,
and its mask, ``relay_mask``, with ``AttentionMaskInterface``), chosen once, when a model is
loaded (``from_pretrained(..., attn_implementation=ATTENTION)``: ``learner.model.load_sharded``,
``learner.critic.load_value_model``): a forward given ``ulysses`` runs Ulysses attention
(``learner.ulysses``), one given ``shared_prompt_rows`` runs shared-prompt rows
(``learner.shared_prompts``), any other runs transformers' SDPA attention. The choice
rides on the forward's own inputs, not on a setting swapped around the call, so
gradient checkpointing, which runs each block's forward again during the backward with
the same inputs, recomputes exactly what the forward computed.

The mask: padded forwards pass ``attention_mask`` and get SDPA's mask. Packed forwards
(Ulysses, shared-prompt rows) pass none and mask by their own layout; transformers would
still build one from their restarting position ids (a q x kv bool tensor per forward, the
slice's length squared under Ulysses), so ``relay_mask`` builds none for them, as
transformers' flash-attention mask does.
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


def relay_mask(attention_mask: torch.Tensor | None = None,
               **kwargs: object) -> torch.Tensor | None:
    """transformers' mask interface: SDPA's mask when the forward passed ``attention_mask``
    (padded rows), none when it did not (a packed forward: module docstring)."""
    if attention_mask is None:
        return None
    return sdpa_mask(attention_mask=attention_mask, **kwargs)


AttentionInterface.register(ATTENTION, relay_attention)
AttentionMaskInterface.register(ATTENTION, relay_mask)


def check_relay_attention(model: nn.Module) -> None:
    """ValueError unless ``model`` (anything with a transformers ``config``) attends with
    ``relay``: any other attention would ignore a packed forward's layout and attend across
    its rows without a word."""
    found = model.config._attn_implementation
    if found != ATTENTION:
        raise ValueError(f"a packed forward needs the model to attend with {ATTENTION!r}, not "
                         f"{found!r}: load it with from_pretrained(..., attn_implementation="
                         f"{ATTENTION!r}) (learner.attention.ATTENTION)")
