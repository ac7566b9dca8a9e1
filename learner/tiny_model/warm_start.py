"""Supervised warm start of the tiny model on the arithmetic task's training split.

Every step draws a fresh batch from the seeded training stream
(``arithmetic.iter_problems(seed, "train")``, disjoint from the test split by construction),
renders each problem through the tokenizer's chat template exactly as a generator would
prompt the model, appends a correct answer and eos, and takes one AdamW step on the
cross-entropy of the response tokens only (prompt and padding are masked out). The
learning rate warms up linearly, then decays on a cosine to ``min_lr_ratio``.

Every answer is correct, written in one of ``arithmetic.ANSWER_STYLES``:
``<answer>4442</answer>``, ``The answer is 4442.`` or ``4442``, drawn (seeded) with
``STYLE_WEIGHTS``, which depend on the operator: additions are mostly tagged, subtractions
mostly in prose. The model thus behaves like a base model that knows some arithmetic and
follows the verifier's format only part of the time (greedy decoding tags its additions and
not its subtractions), while sampling still tags some subtractions. That is the room the RL
stage has: first spreading the format to every problem (as in the early phase of
R1-Zero-style training), then sharpening the arithmetic; the step count sets how much
arithmetic the model knows. Nothing in the data is wrong.

It trains in fp32. bf16 autocast was measured and rejected: at this size the model is
small enough that fp32 steps cost only ~1.4x more, while under autocast it needed several
times more steps to learn the same problems.

This module knows the training recipe; it neither builds the model nor saves it.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from relay.algorithms.tasks import arithmetic

IGNORE_INDEX = -100  # label value that Hugging Face's causal-LM loss skips


STYLE_WEIGHTS: dict[str, tuple[float, ...]] = {"+": (0.6, 0.2, 0.2), "-": (0.15, 0.425, 0.425)}
"""Per operator, the probability of each of ``arithmetic.ANSWER_STYLES`` in the SFT data."""


@dataclass(frozen=True, kw_only=True)
class WarmStartConfig:
    """The SFT recipe; every field has a default that the full build uses."""

    steps: int = 1500
    """Optimizer steps; the main control of the warm-started model's accuracy."""
    batch_size: int = 64
    """Problems per step, each drawn fresh from the training stream."""
    lr: float = 1.5e-3
    """Peak learning rate, reached after ``warmup_steps``."""
    warmup_steps: int = 50
    """Linear warm-up length (capped at ``steps``)."""
    min_lr_ratio: float = 0.1
    """Learning rate at the last step, as a fraction of ``lr``."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    seed: int = 0
    """Seeds the problem stream and the answer styles (the caller seeds the initial weights)."""


@dataclass(frozen=True)
class WarmStartResult:
    """What the warm start did."""

    steps: int
    final_loss: float  # mean response-token loss over the last 20 steps
    seconds: float


@dataclass(frozen=True)
class Batch:
    """A right-padded SFT batch."""

    input_ids: torch.Tensor  # (B, T)
    labels: torch.Tensor  # (B, T), IGNORE_INDEX outside the response


StepCallback = Callable[[int, float], None]  # (step, loss), called after each step


def warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    config: WarmStartConfig,
    on_step: StepCallback | None = None,
) -> WarmStartResult:
    """Train ``model`` in place on the arithmetic task and return a summary."""
    problems = arithmetic.iter_problems(config.seed, "train")
    styles = random.Random(f"answer-styles/{config.seed}")

    def next_batch() -> Batch:
        chosen = _take(problems, config.batch_size)
        return encode_batch(tokenizer, chosen, [_draw_style(styles, p) for p in chosen])

    return train_steps(model, next_batch, config, on_step)


def train_steps(
    model: PreTrainedModel,
    next_batch: Callable[[], Batch],
    config: WarmStartConfig,
    on_step: StepCallback | None = None,
) -> WarmStartResult:
    """``config.steps`` AdamW steps of ``model`` (in place) on the cross-entropy of the
    labelled tokens of ``next_batch()``, with the recipe's schedule; any task's warm start."""
    started = time.perf_counter()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, betas=(0.9, 0.98), weight_decay=config.weight_decay
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, config))
    model.train()
    losses: list[float] = []
    for step in range(1, config.steps + 1):
        batch = next_batch()
        # Right padding needs no attention mask: causal attention never looks ahead to pads.
        loss = model(input_ids=batch.input_ids, labels=batch.labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    tail = losses[-20:]
    return WarmStartResult(
        steps=config.steps,
        final_loss=sum(tail) / max(len(tail), 1),
        seconds=time.perf_counter() - started,
    )


def _draw_style(rng: random.Random, problem: arithmetic.Problem) -> int:
    return rng.choices(range(len(arithmetic.ANSWER_STYLES)), STYLE_WEIGHTS[problem.op])[0]


def encode_batch(tokenizer: PreTrainedTokenizerBase, problems: list[arithmetic.Problem],
                 styles: list[int] | None = None) -> Batch:
    """Chat-templated prompts + ``response<eos>``, right-padded; loss only on the response.

    ``styles[i]`` picks problem i's answer style (default: the verifier's tagged style).
    """
    prompts = tokenizer.apply_chat_template(
        [[{"role": "user", "content": problem.question}] for problem in problems],
        add_generation_prompt=True,
        return_dict=False,
    )
    styles = styles if styles is not None else [0] * len(problems)
    texts = [p.response_in(style) for p, style in zip(problems, styles, strict=True)]
    responses = tokenizer(texts, add_special_tokens=False)["input_ids"]
    rows = [
        (prompt, response + [tokenizer.eos_token_id])
        for prompt, response in zip(prompts, responses, strict=True)
    ]
    width = max(len(prompt) + len(response) for prompt, response in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for i, (prompt, response) in enumerate(rows):
        end = len(prompt) + len(response)
        input_ids[i, :end] = torch.tensor(prompt + response)
        labels[i, len(prompt) : end] = torch.tensor(response)
    return Batch(input_ids=input_ids, labels=labels)


def _lr_factor(step: int, config: WarmStartConfig) -> float:
    # Part of the versioned recipe of the cached default model (its warm-up starts at 1/W,
    # where transformers' starts at 0): switching to transformers' schedule would change the
    # built weights, so it stays with the recipe. The RL learner uses transformers'.
    warmup = min(config.warmup_steps, config.steps)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(config.steps - warmup, 1)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine


def _take(problems: Iterator[arithmetic.Problem], count: int) -> list[arithmetic.Problem]:
    return [next(problems) for _ in range(count)]
