"""Rollout groups to padded training tensors.

Each sample becomes one right-padded row ``prompt + response``. Token t's log-prob comes
from the logits at t - 1, so per-token quantities live on the shifted grid (B, L - 1):
entry j describes token j + 1. ``response_mask`` marks the response tokens there; behavior
log-probs and versions sit at the same positions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
import torch

from transport.messages import RolloutGroup


class TrainBatch(msgspec.Struct, kw_only=True):
    """Shapes: B rows, L positions (the longest prompt + response in the batch)."""

    input_ids: torch.Tensor  # (B, L) long, right-padded with pad_id
    attention_mask: torch.Tensor  # (B, L) long
    response_mask: torch.Tensor  # (B, L-1) float: 1 where token j+1 is a response token
    behavior_logprobs: torch.Tensor  # (B, L-1) float32, 0 off the response
    versions: torch.Tensor  # (B, L-1) int64, -1 off the response
    rewards: torch.Tensor  # (B,) float32
    group_ids: torch.Tensor  # (B,) long: samples of one prompt share an id
    response_lengths: torch.Tensor  # (B,) long
    # (B,) float32: the importance weight of each row's group under prioritized replay
    # (``buffer.prioritized``), multiplying every token loss of the row; 1 otherwise
    sample_weights: torch.Tensor
    # (B,) float32: ReMax's baseline, the reward of the greedy response to the row's prompt
    # (``RolloutGroup.baseline_reward``); NaN when the group has none
    baseline_rewards: torch.Tensor

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: torch.Tensor | slice) -> TrainBatch:
        """Some rows, with padding columns nobody in them uses trimmed away."""
        picked = {f: getattr(self, f)[rows] for f in self.__struct_fields__}
        width = int(picked["attention_mask"].sum(-1).max()) if picked["input_ids"].numel() else 1
        for name in ("input_ids", "attention_mask"):
            picked[name] = picked[name][:, :width]
        for name in ("response_mask", "behavior_logprobs", "versions"):
            picked[name] = picked[name][:, :max(width - 1, 1)]
        return TrainBatch(**picked)


def collate(groups: list[RolloutGroup], pad_id: int,
            group_weights: Sequence[float] = ()) -> TrainBatch:
    """Pack every sample of every group into one ``TrainBatch``; ``group_weights`` (one per
    group, or empty for all 1) become the rows' ``sample_weights``."""
    samples = [(g_index, s) for g_index, g in enumerate(groups) for s in g.samples]
    if not samples:
        raise ValueError("cannot train on an empty batch")
    if group_weights and len(group_weights) != len(groups):
        raise ValueError(f"{len(group_weights)} group weights for {len(groups)} groups")
    weights = list(group_weights) or [1.0] * len(groups)
    lengths = [s.prompt_ids.numel() + s.response_ids.numel() for _, s in samples]
    rows, width = len(samples), max(lengths)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    attention = torch.zeros((rows, width), dtype=torch.long)
    response_mask = torch.zeros((rows, width - 1))
    behavior = torch.zeros((rows, width - 1))
    versions = torch.full((rows, width - 1), -1, dtype=torch.long)
    for row, (_, s) in enumerate(samples):
        p, r = s.prompt_ids.numel(), s.response_ids.numel()
        input_ids[row, :p] = s.prompt_ids
        input_ids[row, p:p + r] = s.response_ids
        attention[row, :p + r] = 1
        response_mask[row, p - 1:p - 1 + r] = 1.0  # token p + i is predicted at p - 1 + i
        behavior[row, p - 1:p - 1 + r] = s.logprobs.float()
        versions[row, p - 1:p - 1 + r] = s.versions.long()
    return TrainBatch(
        input_ids=input_ids, attention_mask=attention, response_mask=response_mask,
        behavior_logprobs=behavior, versions=versions,
        rewards=torch.tensor([s.reward for _, s in samples], dtype=torch.float32),
        group_ids=torch.tensor([g for g, _ in samples], dtype=torch.long),
        response_lengths=torch.tensor([s.response_ids.numel() for _, s in samples]),
        sample_weights=torch.tensor([weights[g] for g, _ in samples], dtype=torch.float32),
        baseline_rewards=torch.tensor(
            [math.nan if groups[g].baseline_reward is None else groups[g].baseline_reward
             for g, _ in samples], dtype=torch.float32))
