"""The tiny model's tokenizer: digits, answer tags, exact round trips, chat template."""

from __future__ import annotations

import pytest

from relay.learner.tiny_model.tokenizer import build_tokenizer


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
