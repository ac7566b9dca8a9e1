"""SFT rows to token ids and loss masks: the loss is on the response (single-turn) or on
every assistant turn (multi-turn) and nowhere else; truncation per ``data.truncation``; a
bad row is refused naming its file, row and field."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from relay.configs.sft_schema import MultiturnConfig, SftDataConfig
from relay.learner.sft_data import (
    SftDataError,
    SftExample,
    collate_examples,
    load_examples,
    multi_turn_example,
)
from relay.learner.tiny_model.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def masked_text(tokenizer, example: SftExample) -> str:
    return tokenizer.decode([t for t, m in zip(example.input_ids, example.loss_mask) if m])


def test_single_turn_trains_on_the_response_and_eos_only(tokenizer, tmp_path: Path) -> None:
    rows = [{"q": "What is 2 + 3?", "a": "<answer>5</answer>"}]
    config = SftDataConfig(train_files=[], prompt_key="q", response_key="a")
    for path in (jsonl(tmp_path / "d.jsonl", rows), str(tmp_path / "d.parquet")):
        if path.endswith(".parquet"):
            pq.write_table(pa.Table.from_pylist(rows), path)
        (example,) = load_examples([path], tokenizer, config)
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                               add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
        assert example.input_ids[:len(prompt)] == list(prompt)
        assert not any(example.loss_mask[:len(prompt)])
        assert all(example.loss_mask[len(prompt):])
        assert example.input_ids[-1] == tokenizer.eos_token_id
        assert masked_text(tokenizer, example) == "<answer>5</answer>" + tokenizer.eos_token


def test_multi_turn_trains_on_every_assistant_turn_only(tokenizer, tmp_path: Path) -> None:
    chat = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "5"},
            {"role": "user", "content": "And 3 + 4?"},
            {"role": "assistant", "content": "7"}]
    config = SftDataConfig(train_files=[], multiturn=MultiturnConfig(enable=True,
                                                                     messages_key="chat"))
    (example,) = load_examples([jsonl(tmp_path / "c.jsonl", [{"chat": chat}])], tokenizer,
                               config)
    whole = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False)
    assert example.input_ids == list(whole)
    assert masked_text(tokenizer, example) == "5<|im_end|>\n7<|im_end|>\n"
    # every masked run is exactly one assistant turn: no header, no user text
    runs = "".join("1" if m else "0" for m in example.loss_mask).split("0")
    assert [len(r) for r in runs if r] == [3, 3]


@pytest.mark.parametrize("row, problem", [
    ({"prompt": "x"}, "row 1: response: missing"),
    ({"prompt": "x", "response": 7}, "row 1: response: must be a string, not int"),
    ([1, 2], "row 1: a row must be an object"),
])
def test_a_bad_single_turn_row_names_file_row_and_field(tokenizer, tmp_path: Path, row,
                                                        problem: str) -> None:
    path = jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "response": "ok"}, row])
    with pytest.raises(SftDataError, match=f"bad.jsonl: {problem}"):
        load_examples([path], tokenizer, SftDataConfig(train_files=[]))


def test_dict_keys_reach_into_an_object_as_verls_gsm8k_example(tokenizer,
                                                               tmp_path: Path) -> None:
    rows = [{"extra_info": {"question": "What is 1 + 1?", "answer": "2"}},
            {"extra_info": {"question": "What is 2 + 2?"}}]
    config = SftDataConfig(train_files=[], prompt_key="extra_info", response_key="extra_info",
                           prompt_dict_keys=["question"], response_dict_keys=["answer"])
    path = jsonl(tmp_path / "nested.jsonl", rows)
    with pytest.raises(SftDataError, match="nested.jsonl: row 1: extra_info.answer: missing"):
        load_examples([path], tokenizer, config)
    (example,) = load_examples([jsonl(tmp_path / "one.jsonl", rows[:1])], tokenizer, config)
    assert masked_text(tokenizer, example) == "2" + tokenizer.eos_token


@pytest.mark.parametrize("messages, problem", [
    ([{"role": "user"}], r"row 0: messages\[0\].content: missing"),
    ([{"role": "user", "content": "hi"}], "row 0: messages: no assistant turn"),
    ("hello", "row 0: messages: must be a non-empty list"),
])
def test_a_bad_chat_names_file_row_and_field(tokenizer, tmp_path: Path, messages,
                                             problem: str) -> None:
    path = jsonl(tmp_path / "chats.jsonl", [{"messages": messages}])
    config = SftDataConfig(train_files=[], multiturn=MultiturnConfig(enable=True))
    with pytest.raises(SftDataError, match=f"chats.jsonl: {problem}"):
        load_examples([path], tokenizer, config)


def test_a_line_that_is_not_json_and_a_missing_file_are_named(tokenizer,
                                                              tmp_path: Path) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n{"prompt": \n')
    with pytest.raises(SftDataError, match="broken.jsonl: row 1: not JSON"):
        load_examples([str(path)], tokenizer, SftDataConfig(train_files=[]))
    with pytest.raises(SftDataError, match="nowhere.jsonl: no such file"):
        load_examples([str(tmp_path / "nowhere.jsonl")], tokenizer, SftDataConfig(train_files=[]))


def test_a_template_that_is_not_prefix_stable_is_refused(tmp_path: Path) -> None:
    tokenizer = build_tokenizer()
    # the chat's length comes first: a prefix of the chat renders a different start
    tokenizer.chat_template = ("{{ messages | length }}{%- for m in messages %}"
                               "{{ m['role'] + ': ' + m['content'] + '<|im_end|>' }}"
                               "{%- endfor %}")
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}]
    with pytest.raises(SftDataError, match=r"f.jsonl: row 3: messages\[1\]: .*prefix-stable"):
        multi_turn_example(tokenizer, chat, "f.jsonl", 3)


def test_truncation_refuses_or_keeps_an_end(tokenizer, tmp_path: Path) -> None:
    path = jsonl(tmp_path / "long.jsonl", [{"prompt": "What is 2 + 3?", "response": "5"}])
    (whole,) = load_examples([path], tokenizer, SftDataConfig(train_files=[]))
    limit = len(whole.input_ids) - 3
    with pytest.raises(SftDataError, match=f"long.jsonl: row 0: {len(whole.input_ids)} tokens, "
                                           f"more than data.max_length = {limit}"):
        load_examples([path], tokenizer, SftDataConfig(train_files=[], max_length=limit))
    (left,) = load_examples([path], tokenizer, SftDataConfig(train_files=[], max_length=limit,
                                                             truncation="left"))
    assert left.input_ids == whole.input_ids[3:] and left.loss_mask == whole.loss_mask[3:]
    with pytest.raises(SftDataError, match="no token to train on"):  # right cuts the response
        load_examples([path], tokenizer, SftDataConfig(train_files=[], max_length=limit,
                                                       truncation="right"))


def test_collate_puts_the_loss_mask_on_the_shifted_grid() -> None:
    examples = [SftExample(input_ids=[5, 6, 7, 8], loss_mask=[False, False, True, True]),
                SftExample(input_ids=[5, 9], loss_mask=[False, True])]
    batch = collate_examples(examples, pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8], [5, 9, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    # entry j says whether token j + 1 is trained on
    assert batch.response_mask.tolist() == [[0, 1, 1], [1, 0, 0]]
    assert torch.equal(batch.group_ids, torch.tensor([0, 1]))
