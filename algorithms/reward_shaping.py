"""Reward shaping on top of the verifier's reward, applied by the generators.

DAPO's overlong penalty (Yu et al., 2025): with maximum response length L_max, a soft
buffer of L_cache tokens and factor f, a response of length L gets

    R_len(L) = 0                                   if L <= L_max - L_cache
             = ((L_max - L_cache) - L) / L_cache * f   if L_max - L_cache < L <= L_max
             = -f                                  if L > L_max

added to its reward (``reward_model.overlong_buffer.{enable, len, penalty_factor}``, as in
verl; L_max is ``rollout.response_length``).
"""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer_length: int,
                     penalty_factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong penalty per sample: lengths (B,) -> penalties (B,) in [-f, 0]."""
    if not 0 < buffer_length <= max_length:
        raise ValueError(f"buffer_length must be in (0, max_length={max_length}], "
                         f"got {buffer_length}")
    lengths = lengths.to(torch.float32)
    start = float(max_length - buffer_length)
    ramp = (start - lengths) / buffer_length * penalty_factor
    penalty = torch.where(lengths <= start, torch.zeros_like(lengths), ramp)
    return torch.where(lengths > max_length, torch.full_like(lengths, -penalty_factor), penalty)
