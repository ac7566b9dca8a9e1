"""Loss aggregation: from a (B, T) matrix of per-token losses to one scalar.

Every mode is a weighted sum of token losses divided by a count over the *whole* batch
(``num_tokens``/``num_seqs`` may be given for the global batch, computed once before the
micro-batch loop), so the result does not depend on how the batch is split across
micro-batches or data-parallel ranks. With l the token loss and m the response mask:

    token-mean                sum_i sum_t m_it l_it / sum_i sum_t m_it          (DAPO)
    seq-mean-token-sum        (1/B) sum_i sum_t m_it l_it
    seq-mean-token-mean       (1/B) sum_i (sum_t m_it l_it / sum_t m_it)        (GRPO paper)
    seq-mean-token-sum-norm   (1/B) sum_i sum_t m_it l_it / L                   (Dr.GRPO)

where B is the number of sequences with at least one response token (a row whose response
is empty, e.g. a padded or truncated one, is not a sequence and does not dilute the mean;
verl's ``agg_loss`` excludes such rows too) and L a constant horizon (the maximum response
length, ``horizon``), so that no sequence's weight depends on its own length.

Under an off-policy rejection the learner passes the kept tokens as m and the response's
counts (before rejection) as ``num_tokens`` and ``num_seqs``. A sequence's mean is then over
its kept tokens, as verl's rejection (which rewrites the response mask) gives it: a
per-sequence objective is not shrunk by the share of the sequence that was rejected. The
counts stay the response's, as AReaL's decoupled loss keeps its token count (verl's shrink
with the rejection): rejecting tokens or whole sequences never up-weights what remains.

``seq-mean-token-sum-norm`` divides by B * L, as the Dr.GRPO paper's objective (Liu et al.,
2025: (1/G) sum_i sum_t, with the sum normalized by the generation budget) and TRL's
``dr_grpo`` do. verl divides by L only (``agg_loss``'s ``loss_scale_factor``) and then scales
each micro-batch by 1 / gradient-accumulation steps, so its gradient is the micro-batch size
times this one: a scale that depends on how the batch is split. Relay keeps the B * L form,
the same scale as the other modes, independent of micro-batches and ranks. Adam cancels a
constant gradient scale, so the difference shows mostly through ``actor.grad_clip``.
"""

from __future__ import annotations

from typing import Literal

import torch

LossAggMode = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
LOSS_AGG_MODES: tuple[str, ...] = LossAggMode.__args__  # type: ignore[attr-defined]


def aggregate_loss(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAggMode,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    horizon: int | None = None,
) -> torch.Tensor:
    """Aggregate per-token ``loss`` (B, T) under ``mask`` (B, T) into a scalar.

    ``num_tokens`` and ``num_seqs`` default to the counts of ``mask`` (``count_sequences``);
    pass the global batch's counts when this call sees only a micro-batch, and the
    response's when ``mask`` holds only the kept tokens (module docstring). ``horizon``
    defaults to T.
    """
    mask = mask.to(loss.dtype)
    token_sums = (loss * mask).sum(dim=-1)  # (B,)
    if mode == "token-mean":
        denom = mask.sum() if num_tokens is None else num_tokens
        return token_sums.sum() / max(float(denom), 1.0)
    seqs = max(float(count_sequences(mask) if num_seqs is None else num_seqs), 1.0)
    if mode == "seq-mean-token-sum":
        return token_sums.sum() / seqs
    if mode == "seq-mean-token-mean":
        lengths = mask.sum(dim=-1).clamp(min=1.0)
        return (token_sums / lengths).sum() / seqs
    if mode == "seq-mean-token-sum-norm":
        return token_sums.sum() / (seqs * float(horizon if horizon else loss.shape[-1]))
    raise ValueError(f"unknown loss_agg_mode {mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")


def count_sequences(mask: torch.Tensor) -> int:
    """The number of rows of ``mask`` (B, T) with at least one token: B in the formulas."""
    return int((mask.sum(dim=-1) > 0).sum())


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is set (0 for an empty mask)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)
