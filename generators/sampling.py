"""Turning next-token logits into a sampled token and its behavior log-prob.

Tokens are drawn from the processed distribution: logits / temperature, then top-k, then
top-p (nucleus), renormalized. The behavior log-prob recorded for a token is its log-prob
under the temperature-only distribution, log softmax(logits / T)[token], the one the
learner recomputes (``relay.algorithms.logprobs.token_logprobs``): both sides of the importance
weight pi_prox / pi_b then use one distribution, so equal weights give a weight of exactly 1
at every token. Recording the processed log-prob instead makes every weight
p_T(token) / p_processed(token) = (kept mass) < 1 under top-p / top-k (between 0.9 and 1 a
token at top-p 0.9), which a sequence-level weight multiplies into nothing over a long
response (0.97 a token over 300 tokens: 1e-4).
Without top-k and top-p both distributions are the same. Temperature 0 is greedy decoding
(log-prob 0: a point mass).

Tokens are drawn by inverting the cumulative distribution: with c_j = sum_{i<=j} p_i and
u ~ U[0, c_V), the token is the first j with c_j > u, which has probability p_j exactly
(and never a token of probability 0). It is the same distribution as ``torch.multinomial``
at a tenth of its cost on a CPU.
"""

from __future__ import annotations

import msgspec
import torch


class SamplingParams(msgspec.Struct, kw_only=True, frozen=True):
    """How to sample; ``top_k`` <= 0 and ``top_p`` = 1 switch those filters off."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filtered(self) -> bool:
        """Whether top-k or top-p cuts the distribution tokens are drawn from."""
        return self.top_k > 0 or self.top_p < 1.0


def processed_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probs (B, V) of the processed distribution; filtered tokens get -inf."""
    return _filtered_logprobs(logits.float() / params.temperature, params)


def _filtered_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``processed_logprobs`` of logits already divided by the temperature (fp32)."""
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        drop_sorted = mass_before >= params.top_p  # the most likely token is always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def sample_next(logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from the processed distribution: (B, V) logits -> tokens (B,)
    int64 and their behavior log-probs (B,) fp32 under the temperature-only distribution,
    z[token] - logsumexp(z) with z = logits / T (module docstring)."""
    if params.greedy:
        tokens = logits.argmax(dim=-1)
        return tokens, torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device)
    scaled = logits.float() / params.temperature
    if not params.filtered:
        logprobs = torch.log_softmax(scaled, dim=-1)
        tokens = draw(logprobs, generator)
        return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    tokens = draw(_filtered_logprobs(scaled, params), generator)
    picked = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, picked - torch.logsumexp(scaled, dim=-1)


def draw(logprobs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row (B,) from log-probs (B, V), by inverse CDF (module docstring)."""
    cumulative = logprobs.exp().cumsum(dim=-1)
    total = cumulative[:, -1:]
    u = torch.rand((logprobs.shape[0], 1), generator=generator, device=logprobs.device,
                   dtype=cumulative.dtype) * total
    # rounding can make u = c_V: kept just below it, the first c_j > u has c_j > c_{j-1},
    # so token j has a positive probability (the last possible token at the very top)
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cumulative, u, right=True).squeeze(-1)
    if logprobs.device.type == "cpu":
        return tokens  # the CPU's cumsum adds in order: c_j > c_{j-1} means p_j > 0
    # a parallel cumsum may round c_j above c_{j-1} where p_j = 0: the most likely token
    # there, chosen on the device (no host sync)
    impossible = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) == float("-inf")
    return torch.where(impossible, logprobs.argmax(dim=-1), tokens)
