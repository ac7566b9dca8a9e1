"""PPO's clipped value loss for the critic (Schulman et al., 2017; as verl's ``critic``).

Per response token, with V the critic's current prediction, V_old the values it predicted
when the batch's advantages were computed (the same step: never stale), R the GAE return
and c = ``cliprange_value``:

    V_clip = V_old + clip(V - V_old, -c, c)
    loss_t = 0.5 * max((V - R)^2, (V_clip - R)^2)

The learner aggregates ``loss_t`` with ``critic.loss_agg_mode`` over the response mask.
"""

from __future__ import annotations

import msgspec
import torch


class ValueLossTerms(msgspec.Struct, frozen=True):
    """Per-token loss (B, T) and the detached clipped-branch indicator (B, T)."""

    loss: torch.Tensor
    clipped: torch.Tensor  # bool: the clipped prediction gave the larger error


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       cliprange_value: float) -> ValueLossTerms:
    """The clipped value loss per token; only ``values`` carries gradient. Shapes (B, T)."""
    if cliprange_value <= 0:
        raise ValueError(f"cliprange_value must be > 0, got {cliprange_value}")
    values = values.float()
    old_values = old_values.detach().float()
    returns = returns.detach().float()
    clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped_values - returns) ** 2
    loss = 0.5 * torch.maximum(unclipped_error, clipped_error)
    return ValueLossTerms(loss=loss, clipped=(clipped_error > unclipped_error).detach())
