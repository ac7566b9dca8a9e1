"""Held-out accuracy of a saved tool-using model, its tool calls executed.

A small episode loop over Hugging Face ``generate`` for measuring the variant
(``builtin:tiny-arith-tools``), not the generators' multi-turn loop: each prompt is decoded
for up to ``max_turns`` assistant turns; a turn that ends with eos and holds a tool call
(``run_tool(text)`` returns the tool message's content, None when the text calls no tool)
is followed by the tokens ``relay.configs.chat_turns.inserted_ids`` puts there, and the
next turn is decoded. An episode ends at a turn without a call, at a turn cut off before
eos, or after ``max_turns``. Its response (special tokens skipped, so the tool's text is in
it) is scored by the task's reward, ``relay.algorithms.rewards.arithmetic``; the score of
the first turn alone is the accuracy *without* tools (a call there scores 0).

The caller supplies ``run_tool``: the calculator and the hermes parser live in the
generators, which the learner does not import (``tools/make-tiny-model.py`` passes them).
This module knows how to measure; it knows nothing of training.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from relay.algorithms.rewards.arithmetic import compute_score
from relay.configs.chat_turns import inserted_ids, prompt_ids
from relay.configs.prompt_data import PromptRow
from relay.learner.tiny_model.evaluate import GREEDY, SAMPLING

ToolRunner = Callable[[str], "str | None"]
"""An assistant turn's text -> the tool message's content, or None when it calls no tool."""

MAX_TURN_TOKENS = 24  # a call is at most 12 tokens + eos, an answer at most 8 + eos


@dataclass(frozen=True)
class Decoding:
    """One decoding's rates over all its episodes (``samples`` per problem)."""

    samples: int
    tool_call_rate: float  # episodes whose first turn called the tool
    accuracy: float  # tools executed
    accuracy_without_tools: float  # the first turn alone
    accuracy_when_called: float  # among episodes that called the tool (0.0 when none did)


@dataclass(frozen=True)
class ToolModelAccuracy:
    """Greedy and sampled (temperature 1) measurements of one model on one set of rows."""

    problems: int
    greedy: Decoding
    sampled: Decoding


@dataclass
class _Episode:
    ids: list[int]  # prompt and response so far
    prompt_length: int
    messages: list[dict[str, str]]
    first_turn: str = ""
    called: bool = False
    done: bool = False


def evaluate_tool_model_dir(model_dir: str | os.PathLike[str], rows: Sequence[PromptRow],
                            run_tool: ToolRunner, *, k: int = 8, seed: int = 0,
                            max_turns: int = 2, batch_size: int = 512) -> ToolModelAccuracy:
    """Load ``model_dir`` with the Auto classes and measure it on ``rows`` (module doc)."""
    if max_turns < 1 or k < 1:
        raise ValueError(f"max_turns ({max_turns}) and k ({k}) must be at least 1")
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    measure = _Measure(model, tokenizer, run_tool, max_turns, batch_size)
    return ToolModelAccuracy(problems=len(rows), greedy=measure(rows, GREEDY, 1, seed),
                             sampled=measure(rows, SAMPLING, k, seed))


@dataclass
class _Measure:
    model: PreTrainedModel
    tokenizer: Any
    run_tool: ToolRunner
    max_turns: int
    batch_size: int

    @torch.inference_mode()
    def __call__(self, rows: Sequence[PromptRow], decoding: dict[str, Any], samples: int,
                 seed: int) -> Decoding:
        torch.manual_seed(seed)
        episodes, truths = [], []
        for row in rows:
            messages = [{"role": m.role, "content": m.content} for m in row.prompt]
            prompt = prompt_ids(self.tokenizer, messages)
            for _ in range(samples):
                episodes.append(_Episode(list(prompt), len(prompt), list(messages)))
                truths.append(row.reward_model.ground_truth)
        for turn in range(self.max_turns):
            active = [e for e in episodes if not e.done]
            for start in range(0, len(active), self.batch_size):
                self._turn(active[start:start + self.batch_size], decoding, turn)
        return _rates(episodes, truths, self.tokenizer, samples)

    def _turn(self, episodes: list[_Episode], decoding: dict[str, Any], turn: int) -> None:
        """Decode one assistant turn of each episode; append the tool's turn where it calls."""
        tokenizer = self.tokenizer
        width = max(len(e.ids) for e in episodes)
        input_ids = torch.full((len(episodes), width), tokenizer.pad_token_id)
        attention = torch.zeros((len(episodes), width), dtype=torch.long)
        for i, e in enumerate(episodes):  # left padding
            input_ids[i, width - len(e.ids):] = torch.tensor(e.ids)
            attention[i, width - len(e.ids):] = 1
        output = self.model.generate(input_ids=input_ids, attention_mask=attention,
                                     max_new_tokens=MAX_TURN_TOKENS,
                                     pad_token_id=tokenizer.pad_token_id,
                                     eos_token_id=tokenizer.eos_token_id, **decoding)
        for e, row in zip(episodes, output[:, width:].tolist(), strict=True):
            ended = tokenizer.eos_token_id in row
            sampled = row[:row.index(tokenizer.eos_token_id) + 1] if ended else row
            e.ids += sampled
            text = tokenizer.decode(sampled, skip_special_tokens=True)
            result = self.run_tool(text) if ended else None
            if turn == 0:
                e.first_turn, e.called = text, result is not None
            if result is None or turn + 1 == self.max_turns:
                e.done = True
                continue
            e.messages.append({"role": "assistant", "content": text})
            tool = [{"role": "tool", "content": result}]
            e.ids += inserted_ids(tokenizer, e.messages, tool)
            e.messages += tool


def _rates(episodes: list[_Episode], truths: list[str], tokenizer: Any,
           samples: int) -> Decoding:
    def correct(text: str, truth: str) -> bool:
        return compute_score(text, truth)["score"] == 1.0

    full = [correct(tokenizer.decode(e.ids[e.prompt_length:], skip_special_tokens=True), t)
            for e, t in zip(episodes, truths, strict=True)]
    first = [correct(e.first_turn, t) for e, t in zip(episodes, truths, strict=True)]
    called = [e.called for e in episodes]
    n_called = sum(called)
    return Decoding(
        samples=samples,
        tool_call_rate=n_called / len(episodes),
        accuracy=sum(full) / len(episodes),
        accuracy_without_tools=sum(first) / len(episodes),
        accuracy_when_called=sum(f for f, c in zip(full, called) if c) / max(n_called, 1),
    )
