"""A causal LM's log-probs (and entropies) of given next tokens at given positions, from its
final hidden states through the LM head chunk by chunk: never (positions x vocabulary)
logits whole, forward or backward (``relay.algorithms.logprobs.head_logprobs``).

The model's body (``get_decoder()``) runs on a pass's inputs; the hidden states at the
positions asked for go through the head's weight (``get_output_embeddings()``: with tied
embeddings, the embedding's own parameter). Under FSDP2 that weight belongs to the root
module, gathered by the root's pre-forward hook and, in the backward, by the pre-backward
hooks its post-forward hook puts on the outputs. So the body and the head run inside a
forward method of the root (``register_fsdp_forward_method``, FSDP2's own API for a second
forward), which gathers and hooks exactly as ``model(...)`` does; without FSDP the method is
a plain function of the model.

Families whose logits are more than the head's linear map (Gemma 2's soft-capping, Cohere's
logit scale, ...) are not in ``LINEAR_HEAD_MODEL_TYPES``: they run their own forward, and
only the positions asked for are taken to fp32 (``token_logprobs``), with the model's
logits at every position (the memory this module otherwise saves).
"""

from __future__ import annotations

from types import MethodType

import torch
from torch import nn
from torch.distributed.fsdp import register_fsdp_forward_method

from relay.algorithms.logprobs import entropy_from_logits, head_logprobs, token_logprobs

# model types whose causal-LM forward is ``logits = lm_head(body(...).last_hidden_state)``
# and nothing more (read in transformers' modeling files)
LINEAR_HEAD_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe",
                           "gemma", "phi3", "olmo2")
FORWARD_METHOD = "relay_head_logprobs"  # the attribute the root's second forward lives in


def position_logprobs(model: nn.Module, inputs: dict[str, object], positions: torch.Tensor,
                      tokens: torch.Tensor, temperature: float, with_entropy: bool
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``model``'s body on ``inputs`` (the keyword arguments of one forward); at each of
    ``positions`` (N,), flat indices into its (rows x length) tokens, the log-prob of
    ``tokens`` (N,) under softmax(logits / ``temperature``), and the entropy if asked;
    (N,) fp32 each, differentiable."""
    if not linear_head(model):
        return _own_forward_logprobs(model, inputs, positions, tokens, temperature,
                                     with_entropy)
    return _forward_method(model)(inputs, positions, tokens, temperature, with_entropy)


def linear_head(model: nn.Module) -> bool:
    """Whether ``model``'s logits are its bias-free head applied to its body's output."""
    head = model.get_output_embeddings()
    return (model.config.model_type in LINEAR_HEAD_MODEL_TYPES
            and isinstance(head, nn.Linear) and head.bias is None)


def _forward_method(model: nn.Module):
    """``_body_then_head`` bound to ``model``, registered (once) as an FSDP2 forward of the
    root: a no-op registration for a model that is not sharded, so a model must be sharded
    before its first pass, as ``relay.learner.model.load_sharded`` does."""
    method = model.__dict__.get(FORWARD_METHOD)
    if method is None:
        setattr(model, FORWARD_METHOD, MethodType(_body_then_head, model))
        register_fsdp_forward_method(model, FORWARD_METHOD)
        method = model.__dict__[FORWARD_METHOD]
    return method


def _body_then_head(model: nn.Module, inputs: dict[str, object], positions: torch.Tensor,
                    tokens: torch.Tensor, temperature: float, with_entropy: bool
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``position_logprobs`` for a linear head, inside the root's forward."""
    hidden = model.get_decoder()(**inputs).last_hidden_state  # (rows, length, H)
    picked = hidden.flatten(0, 1).index_select(0, positions)  # (N, H)
    return head_logprobs(picked, model.get_output_embeddings().weight, tokens, temperature,
                         with_entropy)


def _own_forward_logprobs(model: nn.Module, inputs: dict[str, object],
                          positions: torch.Tensor, tokens: torch.Tensor, temperature: float,
                          with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``position_logprobs`` through the model's own forward (any head)."""
    logits = model(**inputs).logits.flatten(0, 1).index_select(0, positions)  # (N, V)
    entropy = entropy_from_logits(logits, temperature) if with_entropy else None
    return token_logprobs(logits, tokens, temperature), entropy
