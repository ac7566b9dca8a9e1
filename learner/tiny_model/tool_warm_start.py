"""The supervised warm start of the tool-using variant (``builtin:tiny-arith-tools``).

Each transcript solves one product of ``relay.algorithms.tasks.arithmetic_tools``. With
probability ``tool_fraction`` (seeded, independent of the problem) it takes the tool route,
three pieces around one tool message::

    <tool_call>{..."47 * 385"}}</tool_call><eos> | inserted | <answer>18095</answer><eos>

otherwise it answers directly, ``<answer>18095</answer><eos>``: the right product, which the
model cannot compute in its head, so what it learns there is a plausible guess (the right
number of digits, roughly the right leading digits). The warm-started model therefore calls
the calculator on about ``tool_fraction`` of its sampled responses and guesses on the rest:
RL has to raise the tool route's share.

The token sequence is built with ``relay.configs.chat_turns`` exactly as the generators'
multi-turn loop builds an episode: ``prompt_ids`` for the prompt, each assistant turn's
tokens followed by eos, ``inserted_ids`` for the template's and the tool's tokens between
turns. The loss falls on the assistant turns (eos included) and nowhere else.

This module knows the recipe; the training loop is ``warm_start.train_steps``.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from relay.algorithms.tasks import arithmetic_tools
from relay.algorithms.tasks.arithmetic_tools import Problem
from relay.configs.chat_turns import inserted_ids, prompt_ids
from relay.learner.tiny_model.warm_start import (
    IGNORE_INDEX,
    Batch,
    StepCallback,
    WarmStartConfig,
    WarmStartResult,
    train_steps,
)


@dataclass(frozen=True, kw_only=True)
class ToolWarmStartConfig:
    """The variant's SFT recipe; the defaults are the built model's."""

    optim: WarmStartConfig = field(default_factory=lambda: WarmStartConfig(steps=600))
    """Steps, batch, schedule and seed of ``warm_start.train_steps``."""
    tool_fraction: float = 0.25
    """Share of transcripts that call the calculator (the rest answer directly)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.tool_fraction <= 1.0:
            raise ValueError(f"tool_fraction must be in [0, 1], not {self.tool_fraction}")


@dataclass(frozen=True)
class Episode:
    """One transcript as the generators would build it."""

    input_ids: list[int]  # prompt + response
    prompt_length: int
    loss_mask: list[bool]  # over the response: True on the assistant's own tokens


def encode_episode(tokenizer: PreTrainedTokenizerBase, problem: Problem, use_tool: bool,
                   tools: Sequence[Mapping[str, Any]] | None = None) -> Episode:
    """``problem``'s transcript by the tool route (``use_tool``) or the direct one, built with
    ``relay.configs.chat_turns`` (``tools``: the OpenAI schemas the generators pass)."""
    messages: list[dict[str, str]] = [{"role": "user", "content": problem.question}]
    prompt = prompt_ids(tokenizer, messages, tools=tools)
    response: list[int] = []
    mask: list[bool] = []
    if use_tool:
        call = _turn(tokenizer, problem.tool_call)
        messages.append({"role": "assistant", "content": problem.tool_call})
        between = inserted_ids(tokenizer, messages,
                               [{"role": "tool", "content": problem.tool_result}], tools=tools)
        response += call + between
        mask += [True] * len(call) + [False] * len(between)
    answer = _turn(tokenizer, problem.response)
    response += answer
    mask += [True] * len(answer)
    return Episode(prompt + response, len(prompt), mask)


def collate(episodes: Sequence[Episode], pad_token_id: int) -> Batch:
    """Right-padded ``Batch`` whose labels are the tokens under each episode's loss mask."""
    width = max(len(e.input_ids) for e in episodes)
    input_ids = torch.full((len(episodes), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(episodes), width), IGNORE_INDEX, dtype=torch.long)
    for i, episode in enumerate(episodes):
        ids = torch.tensor(episode.input_ids)
        input_ids[i, : len(ids)] = ids
        mask = torch.tensor([False] * episode.prompt_length + episode.loss_mask)
        labels[i, : len(ids)] = torch.where(mask, ids, IGNORE_INDEX)
    return Batch(input_ids=input_ids, labels=labels)


def tool_warm_start(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                    config: ToolWarmStartConfig,
                    on_step: StepCallback | None = None) -> WarmStartResult:
    """Train ``model`` in place on the transcript mix (module docstring); a summary back."""
    seed = config.optim.seed
    problems = arithmetic_tools.iter_problems(seed, "train")
    routes = random.Random(f"tool-routes/{seed}")

    def next_batch() -> Batch:
        episodes = [encode_episode(tokenizer, next(problems),
                                   routes.random() < config.tool_fraction)
                    for _ in range(config.optim.batch_size)]
        return collate(episodes, tokenizer.pad_token_id)

    return train_steps(model, next_batch, config.optim, on_step)


def _turn(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
