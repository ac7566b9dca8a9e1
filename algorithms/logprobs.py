"""Log-probabilities and entropy of a language model's next-token distribution.

All of them work on logits in fp32 whatever the compute dtype, because log-prob
differences between policies are small numbers that bf16 would round away.
``token_logprobs`` and ``entropy_from_logits`` take logits (..., V); ``head_logprobs``
takes the final hidden states and the LM head's weight and never holds more than one
chunk of positions' logits, forward or backward (at Qwen's 151,936-token vocabulary,
fp32 logits are 594 KiB a position: 2.3 GiB for 4,096 positions, and autograd would keep
several such tensors).
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


# A chunk's fp32 logits: 128 MiB (220 positions at a 151,936-token vocabulary). The forward
# holds about four tensors of that size at once (the compute dtype's logits, fp32 logits,
# logsumexp's and softmax's temporaries), the backward three, so the head's transient memory
# stays near 0.5 GiB whatever the number of positions; a chunk's GEMM (220 x hidden x 152k)
# still fills a GPU, and a small vocabulary (the tiny default model's) is one chunk.
LOGITS_CHUNK_BYTES = 128 * 2**20


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor,
                  temperature: float = 1.0, with_entropy: bool = True,
                  chunk_bytes: int = LOGITS_CHUNK_BYTES
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``token_logprobs`` and ``entropy_from_logits`` of the logits ``hidden @ weight.T``,
    computed ``chunk_bytes`` of fp32 logits at a time (forward and backward: the backward
    computes each chunk's logits again), never the (N, V) logits whole.

    ``hidden`` (N, H) final hidden states, ``weight`` (V, H) the LM head's (bias-free), in
    the compute dtype; ``tokens`` (N,) -> log-probs (N,) and entropies (N,) (None unless
    ``with_entropy``), fp32. With z = hidden @ weight.T / T and p = softmax(z):

        log p[token] = z[token] - logsumexp(z)        H = logsumexp(z) - sum_v p_v z_v
        d log p[token] / dz = onehot(token) - p       dH / dz = p * (sum_v p_v z_v - z)

    and d/dlogits = d/dz / T. The weight's gradient sums every chunk's product (in the
    compute dtype) in fp32."""
    chunk = max(1, chunk_bytes // (4 * weight.shape[0]))
    return _ChunkedHeadLogprobs.apply(hidden, weight, tokens, temperature, with_entropy,
                                      chunk)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor,
                  temperature: float) -> torch.Tensor:
    """z = hidden @ weight.T / T in fp32: (n, H), (V, H) -> (n, V)."""
    logits = (hidden @ weight.T).float()  # a tensor of its own: safe to scale in place
    return logits.div_(temperature) if temperature != 1.0 else logits


class _ChunkedHeadLogprobs(torch.autograd.Function):
    """``head_logprobs``' forward and backward, chunk by chunk of positions."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor,
                temperature: float, with_entropy: bool, chunk: int
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        ctx.set_materialize_grads(False)  # a None gradient skips its term
        positions = hidden.shape[0]
        tokens = tokens.long()
        logprobs = hidden.new_empty(positions, dtype=torch.float32)
        normalizers = torch.empty_like(logprobs)  # logsumexp(z)
        expected = torch.empty_like(logprobs) if with_entropy else None  # sum_v p_v z_v
        for start in range(0, positions, chunk):
            rows = slice(start, start + chunk)
            z = _chunk_logits(hidden[rows], weight, temperature)  # (n, V)
            normalizers[rows] = torch.logsumexp(z, dim=-1)
            logprobs[rows] = z.gather(-1, tokens[rows, None]).squeeze(-1) - normalizers[rows]
            if expected is not None:
                expected[rows] = torch.softmax(z, dim=-1).mul_(z).sum(dim=-1)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.save_for_backward(hidden, weight, tokens, normalizers, expected)
        return logprobs, None if expected is None else normalizers - expected

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        hidden, weight, tokens, normalizers, expected = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32,
                                  device=weight.device) if want_weight else None
        if grad_logprobs is None and grad_entropy is None:
            return grad_hidden, grad_weight, None, None, None, None
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            z = _chunk_logits(hidden[rows], weight, ctx.temperature)  # (n, V)
            probs = (z - normalizers[rows, None]).exp_()
            if grad_entropy is not None:  # p * (g_H (E[z] - z) - g_logp)
                grad_z = z.neg_().add_(expected[rows, None]).mul_(grad_entropy[rows, None])
                if grad_logprobs is not None:
                    grad_z.sub_(grad_logprobs[rows, None])
                grad_z.mul_(probs)
            else:
                grad_z = probs.mul_(-grad_logprobs[rows, None])
            if grad_logprobs is not None:  # + g_logp onehot(token)
                grad_z.scatter_add_(-1, tokens[rows, None], grad_logprobs[rows, None])
            if ctx.temperature != 1.0:
                grad_z.div_(ctx.temperature)
            grad_logits = grad_z.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight += grad_logits.T @ hidden[rows]
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None
