"""What the hub checks before a message may change its state.

``group_problem`` judges a whole ``RolloutGroup`` before the hub takes its prompt off the lease: the
number of samples the lease asked for, the dtypes the wire promises (int32 token ids and versions,
float32 log-probs: float8, float16 or int64 tensors decode fine but are refused here), 1-D shapes
that agree, token ids inside the model's vocabulary, responses no longer than
``rollout.response_length``, rewards the learner can train on (finite and within float32's range,
the dtype it trains in: a larger one would become inf there), log-probs <= 0, and token versions the
learner has published. A multi-turn sample's ``loss_mask`` must be bool, one entry per response
token, with at least one token the policy sampled, and log-prob 0 on every inserted token (the
wire's promise: ``relay.transport.messages.Sample``); an inserted token's version is real, so the
version span is checked over every token. It answers every decoded group, whatever its tensors
hold, with a reason or "", and never raises: a bad group is refused whole and its prompt goes back
to the pool.

``sample_request_problem`` and ``version_problem`` judge the learner's requests: a batch of
1 to ``data.train_batch_size`` groups; versions and steps that only go forward, at most one
version per learner step, no step past ``trainer.total_training_steps``.
"""

from __future__ import annotations

import math

import msgspec
import torch

from relay.buffer.staleness import oldest_version
from relay.transport.messages import RolloutGroup, Sample, SampleRequest, VersionUpdate

WIRE_DTYPES: dict[str, torch.dtype] = {
    "prompt_ids": torch.int32, "response_ids": torch.int32,
    "logprobs": torch.float32, "versions": torch.int32}
"""The dtype of each tensor of a ``Sample`` (``relay.transport.messages.Sample``)."""
TOKEN_FIELDS = ("prompt_ids", "response_ids")
FLOAT32_MAX = torch.finfo(torch.float32).max  # |reward| above it is inf in the learner
LOGPROB_SLACK = 1e-4  # log-probs a little above 0 are rounding, not a bug


class GroupLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What a sound group fits: ``n`` samples (what the lease asked for), responses of at
    most ``response_length`` tokens (``rollout.response_length``), token ids below
    ``vocab_size`` (the model's), and with ``greedy_baseline`` (ReMax) a finite
    ``baseline_reward``."""

    n: int
    vocab_size: int
    response_length: int
    greedy_baseline: bool = False


def group_problem(group: RolloutGroup, limits: GroupLimits, learner_version: int) -> str:
    """Why ``group`` cannot be trained on, or "" when it is sound."""
    if len(group.samples) != limits.n:
        return f"{len(group.samples)} samples, the lease asked for {limits.n}"
    if limits.greedy_baseline and (group.baseline_reward is None
                                   or reward_problem(group.baseline_reward)):
        return (f"baseline_reward is {group.baseline_reward}; the lease asked for the greedy "
                "response's reward (ReMax's baseline), finite and within float32's range")
    for i, sample in enumerate(group.samples):
        problem = sample_problem(sample, limits)
        if problem:
            return f"sample {i}: {problem}"
    newest = max(int(s.versions.max()) for s in group.samples)
    if oldest_version(group) < 0 or newest > learner_version:
        return (f"token versions span [{oldest_version(group)}, {newest}] but the learner is "
                f"at version {learner_version}")
    return ""


def sample_problem(sample: Sample, limits: GroupLimits) -> str:
    """Why one sample is unsound, or ""."""
    for name, dtype in WIRE_DTYPES.items():
        tensor: torch.Tensor = getattr(sample, name)
        if tensor.dtype != dtype:
            return f"{name} is {dtype_name(tensor.dtype)}; it must be {dtype_name(dtype)}"
    if sample.prompt_ids.dim() != 1 or sample.response_ids.dim() != 1 \
            or sample.prompt_ids.numel() == 0:
        return "prompt and response ids must be non-empty 1-D tensors"
    length = sample.response_ids.numel()
    if length == 0:
        return "empty response"
    if length > limits.response_length:
        return (f"{length} response tokens, more than rollout.response_length = "
                f"{limits.response_length}")
    if sample.logprobs.shape != (length,) or sample.versions.shape != (length,):
        return (f"{length} response tokens but logprobs {tuple(sample.logprobs.shape)} and "
                f"versions {tuple(sample.versions.shape)}")
    for name in TOKEN_FIELDS:
        ids: torch.Tensor = getattr(sample, name)
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= limits.vocab_size:
            return (f"{name} span [{low}, {high}], outside the model's vocabulary "
                    f"[0, {limits.vocab_size})")
    if not bool(sample.logprobs.isfinite().all()) or bool((sample.logprobs > LOGPROB_SLACK).any()):
        return "log-probs must be finite and <= 0"
    if sample.loss_mask is not None:
        problem = loss_mask_problem(sample.loss_mask, sample.logprobs)
        if problem:
            return problem
    problem = reward_problem(sample.reward)
    if problem:
        return problem
    bad_info = sorted(k for k, v in sample.reward_info.items() if not math.isfinite(v))
    if bad_info:
        return f"reward_info {', '.join(bad_info)} not finite"
    return ""


def loss_mask_problem(mask: torch.Tensor, logprobs: torch.Tensor) -> str:
    """Why a multi-turn sample's ``loss_mask`` is unsound next to its ``logprobs`` (R,), or
    "": bool (R,), True somewhere (a sample with no policy token trains nothing), and the
    log-prob 0 wherever it is False (an inserted token was not sampled)."""
    length = logprobs.numel()
    if mask.dtype != torch.bool or mask.shape != (length,):
        return (f"loss_mask is {dtype_name(mask.dtype)} {tuple(mask.shape)}; it must be bool "
                f"({length},), one entry per response token")
    if not bool(mask.any()):
        return "loss_mask has no True entry: no token of the response was sampled by the policy"
    inserted = ~mask & (logprobs != 0)
    if bool(inserted.any()):
        return (f"log-prob {float(logprobs[inserted][0]):g} at response token "
                f"{int(inserted.nonzero()[0])} where loss_mask is False; an inserted token's "
                "log-prob must be 0")
    return ""


def reward_problem(reward: float) -> str:
    """Why the learner cannot train on ``reward``, or "": it must be finite and |r| <=
    float32's largest value (``FLOAT32_MAX``), since the learner holds rewards in float32."""
    if not math.isfinite(reward):
        return f"reward {reward} is not finite"
    if abs(reward) > FLOAT32_MAX:
        return (f"reward {reward:g} is outside float32's range (|r| <= {FLOAT32_MAX:g}), "
                "the dtype the learner trains in: it would become inf there")
    return ""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def sample_request_problem(msg: SampleRequest, batch_size: int, total_steps: int) -> str:
    """Why the learner's batch request is out of range, or ""."""
    if not 1 <= msg.num_groups <= batch_size:
        return (f"num_groups = {msg.num_groups}: a batch holds 1 to {batch_size} groups "
                "(data.train_batch_size)")
    if not 0 <= msg.step <= total_steps:
        return (f"step {msg.step} is outside 0 to trainer.total_training_steps = "
                f"{total_steps}")
    return ""


def version_problem(msg: VersionUpdate, *, version: int, step: int, total_steps: int) -> str:
    """Why a version update cannot be true, or "", given the learner's last ``version``
    and ``step`` and the run's ``total_steps``. The learner publishes at most once per step
    (steps count from 1), so a version never exceeds its step."""
    if msg.version < version or msg.step < step:
        return (f"version {msg.version} after step {msg.step} goes back from version "
                f"{version} after step {step}")
    if msg.step > total_steps:
        return f"step {msg.step} is past trainer.total_training_steps = {total_steps}"
    if msg.version > msg.step:
        return (f"version {msg.version} after step {msg.step}: the learner publishes at most "
                "one version per step")
    return ""
