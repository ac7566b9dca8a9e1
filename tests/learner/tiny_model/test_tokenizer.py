"""The tiny model's tokenizer: digits, answer tags, exact round trips, chat template; the
tool-using variant's: short calculator calls that round-trip, the same template."""

from __future__ import annotations

import hashlib

import pytest

from relay.algorithms.tasks.arithmetic_tools import Problem
from relay.generators.tools.parser import parse_tool_calls
from relay.learner.tiny_model.tokenizer import (
    build_tokenizer,
    build_tools_tokenizer,
    builtin_tokenizer,
)

DEFAULT_TOKENIZER_SHA256 = "240cf4f0db44b05296d078403d17170b4a8484959f6092be5fb179fc1939147d"
"""Of the default tokenizer's JSON (recipe r3): the cached ``tiny-arith-r3`` models were
built with it, so any change to it needs a new recipe version."""


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_digits_are_single_tokens(tokenizer):
    tokens = tokenizer.tokenize("What is 4821 - 379?")
    assert tokens[tokens.index("4") : tokens.index("4") + 4] == ["4", "8", "2", "1"]
    assert [t for t in tokens if t.isdigit()] == list("4821379")


def test_answer_tags_are_single_tokens_that_survive_skipping_special_tokens(tokenizer):
    ids = tokenizer.encode("<answer>4442</answer>", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == ["<answer>", "4", "4", "4", "2", "</answer>"]
    response = ids + [tokenizer.eos_token_id, tokenizer.pad_token_id]
    assert tokenizer.decode(response, skip_special_tokens=True) == "<answer>4442</answer>"


@pytest.mark.parametrize(
    "text",
    ["What is 12 + 7?", "  two  spaces\tand tabs\n", "Natalia sold 48/2 = 24 clips, café 漢字 🙂"],
)
def test_any_text_round_trips_exactly(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_eos_and_pad_are_distinct_special_tokens(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.eos_token_id != tokenizer.pad_token_id
    assert tokenizer.bos_token is None
    assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False)


def test_chat_template_is_chatml(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    closed = tokenizer.apply_chat_template(messages[1:], tokenize=False)
    assert closed == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"


def test_prompt_of_a_four_digit_problem_is_short(tokenizer):
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 4821 - 3795?"}],
        add_generation_prompt=True,
        return_dict=False,
    )
    assert len(ids) == 22


def test_building_twice_gives_the_same_tokenizer(tokenizer):
    assert build_tokenizer().backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()


def test_the_default_tokenizer_is_the_one_recipe_r3_was_built_with(tokenizer):
    text = tokenizer.backend_tokenizer.to_str().encode()
    assert hashlib.sha256(text).hexdigest() == DEFAULT_TOKENIZER_SHA256


@pytest.fixture(scope="module")
def tools_tokenizer():
    return build_tools_tokenizer()


@pytest.mark.parametrize("problem", [Problem(123, 456), Problem(47, 385), Problem(10, 99)])
def test_a_calculator_call_is_at_most_12_tokens_and_round_trips(tools_tokenizer, problem):
    ids = tools_tokenizer.encode(problem.tool_call, add_special_tokens=False)
    assert len(ids) == 4 + len(tools_tokenizer.tokenize(problem.expression)) <= 12
    text = tools_tokenizer.decode(ids + [tools_tokenizer.eos_token_id], skip_special_tokens=True)
    assert text == problem.tool_call
    (call,) = parse_tool_calls(text, "hermes").calls
    assert call.arguments == {"expression": problem.expression}


@pytest.mark.parametrize("text", ["What is 12 * 7?", '{"name": "x"}}', "café 漢字 🙂 <tool_call>"])
def test_tools_tokenizer_round_trips_any_text(tools_tokenizer, text):
    assert tools_tokenizer.decode(tools_tokenizer.encode(text, add_special_tokens=False)) == text


def test_tools_tokenizer_keeps_the_chat_template_and_special_tokens(tokenizer, tools_tokenizer):
    assert tools_tokenizer.chat_template == tokenizer.chat_template
    assert (tools_tokenizer.eos_token, tools_tokenizer.pad_token) == ("<|im_end|>",
                                                                      "<|endoftext|>")
    text = tools_tokenizer.apply_chat_template([{"role": "tool", "content": "18095"}],
                                               tokenize=False)
    assert text == "<|im_start|>tool\n18095<|im_end|>\n"


def test_builtin_tokenizer_by_name():
    assert builtin_tokenizer("tiny-arith").backend_tokenizer.to_str() == \
        build_tokenizer().backend_tokenizer.to_str()
    assert "<tool_call>" in builtin_tokenizer("tiny-arith-tools").get_vocab()
    with pytest.raises(ValueError, match="unknown built-in model 'tiny'"):
        builtin_tokenizer("tiny")
