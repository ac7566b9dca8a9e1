"""Held-out accuracy of a saved arithmetic model: greedy accuracy and sampled pass@k.

Loads the directory with ``AutoModelForCausalLM`` / ``AutoTokenizer`` (so it checks what
was saved, not what is in memory), prompts through the chat template, left-pads batches,
and decodes with ``model.generate``: once greedily, then ``k`` samples per prompt at
temperature 1 with no top-k / top-p truncation (what an RL generator samples from).
pass@1 and pass@k use the unbiased estimator of Chen et al. (2021) on those ``k`` samples.

A response is correct when the task's reward (``relay.algorithms.rewards.arithmetic``, the one the
RL stage optimizes) scores it 1.0. This module knows how to measure; it knows nothing of
training.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from relay.algorithms.rewards.arithmetic import compute_score
from relay.configs.prompt_data import PromptRow

MAX_NEW_TOKENS = 16  # the task's answers take at most 8: "<answer>", 5 digits, "</answer>", eos
SAMPLING = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
GREEDY = {"do_sample": False}


@dataclass(frozen=True)
class ModelAccuracy:
    """Accuracy of one model on one set of prompt rows."""

    problems: int
    greedy_accuracy: float
    k: int  # samples per prompt behind the pass@ numbers
    pass_at_1: float
    pass_at_k: float


def evaluate_model_dir(
    model_dir: str | os.PathLike[str],
    rows: Sequence[PromptRow],
    *,
    k: int = 8,
    seed: int = 0,
    batch_size: int = 512,
) -> ModelAccuracy:
    """Load ``model_dir`` with the Auto classes and measure it on ``rows`` (see module doc)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    greedy = _correct(model, tokenizer, rows, GREEDY, samples=1, seed=seed, batch_size=batch_size)
    sampled = _correct(
        model, tokenizer, rows, SAMPLING, samples=k, seed=seed, batch_size=batch_size
    )
    return ModelAccuracy(
        problems=len(rows),
        greedy_accuracy=sum(greedy) / len(rows),
        k=k,
        pass_at_1=sum(pass_at(k, c, 1) for c in sampled) / len(rows),
        pass_at_k=sum(pass_at(k, c, k) for c in sampled) / len(rows),
    )


def pass_at(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct: 1 - C(n-c, k) / C(n, k)."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@torch.inference_mode()
def _correct(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[PromptRow],
    decoding: dict[str, Any],
    *,
    samples: int,
    seed: int,
    batch_size: int,
) -> list[int]:
    """How many of the ``samples`` responses per row (decoded with ``decoding``) are correct."""
    torch.manual_seed(seed)
    per_batch = max(batch_size // samples, 1)
    counts: list[int] = []
    for start in range(0, len(rows), per_batch):
        chunk = rows[start : start + per_batch]
        inputs = tokenizer.apply_chat_template(
            [[{"role": m.role, "content": m.content} for m in row.prompt] for row in chunk],
            add_generation_prompt=True,
            padding=True,
            return_tensors="pt",
            return_dict=True,
        )
        output = model.generate(
            **inputs,
            max_new_tokens=MAX_NEW_TOKENS,
            num_return_sequences=samples,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **decoding,
        )  # (len(chunk) * samples, prompt + new tokens)
        responses = tokenizer.batch_decode(
            output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True
        )
        for i, row in enumerate(chunk):
            group = responses[i * samples : (i + 1) * samples]
            truth = row.reward_model.ground_truth
            counts.append(sum(compute_score(text, truth)["score"] == 1.0 for text in group))
    return counts
