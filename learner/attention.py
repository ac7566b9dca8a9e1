"""The learner's attention: one implementation that picks, per forward, what the inputs ask.

Models the learner runs use ``relay`` (registered with transformers' ``AttentionInterface``, and its
mask, ``relay_mask``, with ``AttentionMaskInterface``), chosen once, when a model is loaded
(``from_pretrained(..., attn_implementation=ATTENTION)``: ``relay.learner.model.load_sharded``,
``relay.learner.critic.load_value_model``): a forward given ``ulysses`` runs Ulysses attention
(``relay.learner.ulysses``), one given ``shared_prompt_rows`` runs shared-prompt rows
(``relay.learner.shared_prompts``), any other runs padded rows: transformers' SDPA attention, or on
CUDA in bf16/fp16 the rows with their padding taken out through a variable-length kernel
(``relay.learner.varlen``), since a mask passed to SDPA rules out its flash kernels. The choice
rides on the forward's own inputs, not on a setting swapped around the call, so gradient
checkpointing, which runs each block's forward again during the backward with the same inputs,
recomputes exactly what the forward computed.

The mask: padded forwards pass ``attention_mask``; ``relay_mask`` turns it into SDPA's mask,
or, where the variable-length kernel runs (it sees the forward's device and compute dtype,
which the caller of an FSDP2 model with mixed precision does not), into ``UnpaddedRows``:
where the real tokens sit among the (rows x length) positions and where each row starts
among them, computed once a forward. Each layer gathers its queries, keys and values there,
attends with the kernel and scatters the result back (transformers' flash-attention path
does the same); the rows' tokens must be contiguous (right or left padding, as
``relay.learner.batch.collate`` pads). Packed forwards (Ulysses, shared-prompt rows) pass none and
mask by their own layout; transformers would still build one from their restarting
position ids (a q x kv bool tensor per forward, the slice's length squared under Ulysses),
so ``relay_mask`` builds none for them, as transformers' flash-attention mask does.
"""

from __future__ import annotations

import msgspec
import torch
from torch import nn
from transformers import AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from relay.learner import varlen
from relay.learner.shared_prompts import shared_prompt_attention, unsupported
from relay.learner.ulysses import ulysses_attention

ATTENTION = "relay"


class UnpaddedRows(msgspec.Struct, frozen=True):
    """A padded forward's real tokens: ``indices`` (T,) long, their flat positions among
    the (rows x length) positions, row after row; ``sequences`` where each row starts among
    them (module docstring)."""

    indices: torch.Tensor
    sequences: varlen.PackedSequences

    @classmethod
    def of(cls, attention_mask: torch.Tensor) -> UnpaddedRows:
        """From a (rows, length) 0/1 mask whose ones are contiguous in each row."""
        lengths = attention_mask.sum(-1).tolist()
        bounds = [0]
        for length in lengths:
            bounds.append(bounds[-1] + int(length))
        return cls(indices=attention_mask.flatten().nonzero().squeeze(1),
                   sequences=varlen.PackedSequences.of(bounds, device=attention_mask.device))


def relay_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: torch.Tensor | None,
                    **kwargs: object) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention interface: Ulysses, shared-prompt rows or SDPA (module
    docstring)."""
    if kwargs.get("ulysses") is not None:
        return ulysses_attention(module, query, key, value, attention_mask, **kwargs)
    if kwargs.get("shared_prompt_rows") is not None:
        return shared_prompt_attention(module, query, key, value, attention_mask, **kwargs)
    if isinstance(attention_mask, UnpaddedRows):
        return unpadded_attention(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def unpadded_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, attention_mask: UnpaddedRows,
                       scaling: float | None = None, dropout: float = 0.0,
                       sliding_window: int | None = None,
                       **_: object) -> tuple[torch.Tensor, None]:
    """Causal attention of padded rows over their real tokens only (module docstring):
    ``query`` (B, H, L, D), ``key``/``value`` (B, H_kv, L, D) -> (B, L, H, D), zero at the
    padding."""
    if sliding_window is not None:
        raise RuntimeError("unpadded attention does not implement sliding-window attention")
    rows, heads, length, dim = query.shape
    indices = attention_mask.indices

    def unpad(states: torch.Tensor) -> torch.Tensor:
        """(B, h, L, D) -> (T, h, D) at the real tokens."""
        return states.transpose(1, 2).reshape(rows * length, -1, dim).index_select(0, indices)

    out = varlen.packed_causal_attention(
        unpad(query), unpad(key), unpad(value), attention_mask.sequences,
        scale=dim ** -0.5 if scaling is None else scaling,
        dropout=dropout if module.training else 0.0)  # (T, H, D)
    padded = out.new_zeros(rows * length, heads, dim).index_copy(0, indices, out)
    return padded.view(rows, length, heads, dim), None


def relay_mask(attention_mask: torch.Tensor | None = None,
               **kwargs: object) -> torch.Tensor | UnpaddedRows | None:
    """transformers' mask interface (it passes the forward's ``device``, compute ``dtype``
    and ``config`` among ``kwargs``): for a forward that passed ``attention_mask`` (padded
    rows), ``UnpaddedRows`` where ``unpads`` says so, else SDPA's mask; none for a forward
    that did not (a packed forward: module docstring)."""
    if attention_mask is None:
        return None
    if unpads(kwargs.get("device"), kwargs.get("dtype"), kwargs.get("config")):
        return UnpaddedRows.of(attention_mask)
    return sdpa_mask(attention_mask=attention_mask, **kwargs)


def unpads(device: object, dtype: object, config: object) -> bool:
    """Whether a padded forward on ``device`` in ``dtype`` attends over its real tokens with
    the variable-length kernel: where there is one, for models whose attention is plain
    causal attention (``relay.learner.shared_prompts.unsupported``)."""
    return (isinstance(device, torch.device | str) and isinstance(dtype, torch.dtype)
            and isinstance(config, PretrainedConfig)
            and varlen.varlen_kernel(torch.device(device), dtype) is not None
            and unsupported(config) is None)


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
                         f"{ATTENTION!r}) (relay.learner.attention.ATTENTION)")
