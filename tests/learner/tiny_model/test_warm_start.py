"""The supervised warm start: what carries loss, and that training learns."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from relay.algorithms.tasks.arithmetic import Problem
from relay.learner.tiny_model.tokenizer import build_tokenizer
from relay.learner.tiny_model.warm_start import (
    IGNORE_INDEX,
    STYLE_WEIGHTS,
    WarmStartConfig,
    _draw_style,
    encode_batch,
    warm_start,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_batch_is_chat_prompt_then_response_and_eos_right_padded(tokenizer):
    batch = encode_batch(tokenizer, [Problem(7, "+", 2), Problem(4821, "-", 379)])
    short_prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 7 + 2?"}],
        add_generation_prompt=True,
        return_dict=False,
    )
    response = tokenizer.encode("<answer>9</answer>", add_special_tokens=False) + [
        tokenizer.eos_token_id
    ]
    width = batch.input_ids.shape[1]
    padding = [tokenizer.pad_token_id] * (width - len(short_prompt) - len(response))
    assert batch.input_ids[0].tolist() == short_prompt + response + padding
    assert batch.labels[0].tolist() == [IGNORE_INDEX] * len(short_prompt) + response + [
        IGNORE_INDEX
    ] * len(padding)
    # The longer row has no padding; only its response and eos carry loss.
    labeled = batch.labels[1][batch.labels[1] != IGNORE_INDEX].tolist()
    assert tokenizer.decode(labeled) == "<answer>4442</answer><|im_end|>"
    assert batch.input_ids[1, -1] == tokenizer.eos_token_id


def test_styles_choose_how_each_answer_is_written(tokenizer):
    batch = encode_batch(tokenizer, [Problem(7, "+", 2), Problem(4821, "-", 379)], styles=[1, 2])
    labeled = [row[row != IGNORE_INDEX].tolist() for row in batch.labels]
    assert tokenizer.decode(labeled[0]) == "The answer is 9.<|im_end|>"
    assert tokenizer.decode(labeled[1]) == "4442<|im_end|>"


def test_additions_are_mostly_tagged_and_subtractions_mostly_not():
    rng = random.Random(0)
    for op, weights in STYLE_WEIGHTS.items():
        assert sum(weights) == pytest.approx(1.0)
        drawn = Counter(_draw_style(rng, Problem(5, op, 3)) for _ in range(4000))
        tagged = drawn[0] / 4000
        assert tagged == pytest.approx(weights[0], abs=0.03)
    # Greedy decoding follows the majority: tags for additions, prose for subtractions.
    assert STYLE_WEIGHTS["+"][0] > max(STYLE_WEIGHTS["+"][1:])
    assert STYLE_WEIGHTS["-"][0] < min(STYLE_WEIGHTS["-"][1:])


def test_warm_start_lowers_the_loss(tokenizer):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    losses: list[float] = []
    result = warm_start(
        model,
        tokenizer,
        WarmStartConfig(steps=30, batch_size=16, warmup_steps=5),
        on_step=lambda step, loss: losses.append(loss),
    )
    assert result.steps == len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
    assert result.final_loss == pytest.approx(sum(losses[-20:]) / 20)
    assert not model.training
