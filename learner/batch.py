"""Rollout groups to padded training tensors.

Each sample becomes one right-padded row ``prompt + response``. Token t's log-prob comes
from the logits at t - 1, so per-token quantities live on the shifted grid (B, L - 1):
entry j describes token j + 1. ``response_mask`` marks the tokens trained on there; behavior
log-probs and versions sit at the same positions.

A multi-turn episode is one sample whose response holds the policy's turns and the tokens
inserted between them (tool responses, the chat template's turn markers), told apart by its
``loss_mask``. Only the policy's tokens are in ``response_mask``; an inserted token is "off
the response" as the prompt is (mask 0, behavior log-prob 0, version -1), so every loss,
correction, advantage and diagnostic, all of which read ``response_mask``, ignores it. It
stays in the row, ``attention_mask`` and ``response_lengths`` (the whole response), as the
context of the later turns: packing and attention follow those two.

``collate`` builds the batch on the host (into pinned memory when it is bound for a GPU);
the learner's step moves it to its device once (``TrainBatch.to``), and everything after
that is created on the device of the batch's tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
import torch

from relay.transport.messages import RolloutGroup


class TrainBatch(msgspec.Struct, kw_only=True):
    """Shapes: B rows, L positions (the longest prompt + response in the batch)."""

    input_ids: torch.Tensor  # (B, L) long, right-padded with pad_id
    attention_mask: torch.Tensor  # (B, L) long
    # (B, L-1) float: 1 where token j+1 is a response token the policy sampled (0 on a
    # multi-turn episode's inserted tokens)
    response_mask: torch.Tensor
    behavior_logprobs: torch.Tensor  # (B, L-1) float32, 0 off the response mask
    versions: torch.Tensor  # (B, L-1) int64, -1 off the response mask
    rewards: torch.Tensor  # (B,) float32
    group_ids: torch.Tensor  # (B,) long: samples of one prompt share an id
    response_lengths: torch.Tensor  # (B,) long: every response token, inserted ones too
    # (B,) float32: the importance weight of each row's group under prioritized replay
    # (``relay.buffer.prioritized``), multiplying every token loss of the row; 1 otherwise
    sample_weights: torch.Tensor
    # (B,) float32: ReMax's baseline, the reward of the greedy response to the row's prompt
    # (``RolloutGroup.baseline_reward``); NaN when the group has none
    baseline_rewards: torch.Tensor

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device, non_blocking: bool = False) -> TrainBatch:
        """Every tensor on ``device`` (the same batch when they already are there: on the CPU
        a CPU batch is not copied). ``non_blocking`` from pinned memory overlaps the copy
        with the host's work."""
        if all(getattr(self, f).device == device for f in self.__struct_fields__):
            return self
        return TrainBatch(**{f: getattr(self, f).to(device, non_blocking=non_blocking)
                             for f in self.__struct_fields__})

    def select(self, rows: torch.Tensor | slice, width: int | None = None) -> TrainBatch:
        """Some rows, with padding columns nobody in them uses trimmed away: ``width``, the
        longest selected row's length when the caller knows it (else read from the mask,
        a host sync)."""
        picked = {f: getattr(self, f)[rows] for f in self.__struct_fields__}
        if width is None:
            width = int(picked["attention_mask"].sum(-1).max()) \
                if picked["input_ids"].numel() else 1
        for name in ("input_ids", "attention_mask"):
            picked[name] = picked[name][:, :width]
        for name in ("response_mask", "behavior_logprobs", "versions"):
            picked[name] = picked[name][:, :max(width - 1, 1)]
        return TrainBatch(**picked)


def host_index(values: list[int], device: torch.device) -> torch.Tensor:
    """(n,) long: host-computed indices on ``device``. On a GPU the copy is asynchronous,
    from pinned memory (no host sync; torch keeps the pinned block until the copy is done)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.long, device=device)
    pinned = torch.tensor(values, dtype=torch.long, device="cpu", pin_memory=True)
    return pinned.to(device, non_blocking=True)


def collate(groups: list[RolloutGroup], pad_id: int,
            group_weights: Sequence[float] = (), pin_memory: bool = False) -> TrainBatch:
    """Pack every sample of every group into one ``TrainBatch`` on the host (every tensor
    says ``device="cpu"``: this is the host side of the copy); ``group_weights`` (one per
    group, or empty for all 1) become the rows' ``sample_weights``. ``pin_memory`` (for a
    learner on a GPU): into page-locked memory, so that ``TrainBatch.to(device,
    non_blocking=True)`` is an asynchronous copy; ignored where torch has no GPU. A
    sample's ``loss_mask`` (when not None) becomes its row of ``response_mask`` (module
    docstring)."""
    samples = [(g_index, s) for g_index, g in enumerate(groups) for s in g.samples]
    if not samples:
        raise ValueError("cannot train on an empty batch")
    if group_weights and len(group_weights) != len(groups):
        raise ValueError(f"{len(group_weights)} group weights for {len(groups)} groups")
    weights = list(group_weights) or [1.0] * len(groups)
    lengths = [s.prompt_ids.numel() + s.response_ids.numel() for _, s in samples]
    rows, width = len(samples), max(lengths)
    host = dict(device="cpu", pin_memory=pin_memory and torch.cuda.is_available())
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long, **host)
    attention = torch.zeros((rows, width), dtype=torch.long, **host)
    response_mask = torch.zeros((rows, width - 1), **host)
    behavior = torch.zeros((rows, width - 1), **host)
    versions = torch.full((rows, width - 1), -1, dtype=torch.long, **host)
    for row, (_, s) in enumerate(samples):
        p, r = s.prompt_ids.numel(), s.response_ids.numel()
        input_ids[row, :p] = s.prompt_ids
        input_ids[row, p:p + r] = s.response_ids
        attention[row, :p + r] = 1
        span = slice(p - 1, p - 1 + r)  # token p + i is predicted at p - 1 + i
        if s.loss_mask is None:
            response_mask[row, span] = 1.0
            behavior[row, span] = s.logprobs.float()
            versions[row, span] = s.versions.long()
        else:
            policy = _loss_mask(s.loss_mask, r)
            response_mask[row, span] = policy.float()
            behavior[row, span] = torch.where(policy, s.logprobs.float(), 0.0)
            versions[row, span] = torch.where(policy, s.versions.long(), -1)
    return TrainBatch(
        input_ids=input_ids, attention_mask=attention, response_mask=response_mask,
        behavior_logprobs=behavior, versions=versions,
        rewards=torch.tensor([s.reward for _, s in samples], dtype=torch.float32, **host),
        group_ids=torch.tensor([g for g, _ in samples], dtype=torch.long, **host),
        response_lengths=torch.tensor([s.response_ids.numel() for _, s in samples],
                                      dtype=torch.long, **host),
        sample_weights=torch.tensor([weights[g] for g, _ in samples], dtype=torch.float32,
                                    **host),
        baseline_rewards=torch.tensor(
            [math.nan if groups[g].baseline_reward is None else groups[g].baseline_reward
             for g, _ in samples], dtype=torch.float32, **host))


def _loss_mask(mask: torch.Tensor, length: int) -> torch.Tensor:
    """A sample's ``loss_mask`` as (``length``,) bool; a mask of another shape or dtype is
    an error (the hub refuses such samples: ``relay.buffer.validation``)."""
    if mask.dtype != torch.bool or mask.shape != (length,):
        raise ValueError(f"loss_mask is {str(mask.dtype).removeprefix('torch.')} "
                         f"{tuple(mask.shape)}; it must be bool ({length},), one entry per "
                         "response token")
    return mask
