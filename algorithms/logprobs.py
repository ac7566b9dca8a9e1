"""Log-probabilities and entropy of a language model's next-token distribution.

Both work on logits (..., V) in fp32 whatever the compute dtype, because log-prob
differences between policies are small numbers that bf16 would round away.
"""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[token] for each position: (..., V), (...) -> (...)."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(z), z = logits / T: H = logsumexp(z) - sum_v softmax(z)_v z_v.

    Shapes: (..., V) -> (...).
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
