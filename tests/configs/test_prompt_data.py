"""Prompt files in verl's schema: loading, validation errors, writing, the torch Dataset."""

from __future__ import annotations

import copy
import json
import pickle

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from torchdata.stateful_dataloader import StatefulDataLoader

from relay.configs.prompt_data import (
    ChatMessage,
    DatasetError,
    PromptDataset,
    PromptRow,
    RewardSpec,
    chat_token_counter,
    cut_side,
    fit_prompts,
    load_prompt_rows,
    truncate_prompt,
    write_prompt_rows,
)


def _row(i: int) -> dict:
    return {
        "prompt": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": f"What is {i} + 1?"},
        ],
        "data_source": "relay/arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
        "extra_info": {"index": i},
    }


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_jsonl_rows_load_as_typed_rows(tmp_path):
    rows = load_prompt_rows(_jsonl(tmp_path / "a.jsonl", [_row(0), _row(1)]))
    assert rows[1] == PromptRow(
        prompt=(ChatMessage("system", "Be brief."), ChatMessage("user", "What is 1 + 1?")),
        data_source="relay/arithmetic",
        reward_model=RewardSpec(style="rule", ground_truth="2"),
        extra_info={"index": 1},
    )


def test_optional_and_extra_columns(tmp_path):
    no_info, null_info, verl_extras = _row(0), _row(1), _row(2)
    del no_info["extra_info"]
    null_info["extra_info"] = None
    verl_extras["ability"] = "math"
    verl_extras["reward_model"]["ground_truth"] = ["3", "3.0"]
    rows = load_prompt_rows(_jsonl(tmp_path / "a.jsonl", [no_info, null_info, verl_extras]))
    assert [r.extra_info for r in rows] == [{}, {}, {"index": 2}]
    assert rows[2].reward_model.ground_truth == ["3", "3.0"]


def test_many_files_of_both_formats_load_in_order(tmp_path):
    pq.write_table(pa.Table.from_pylist([_row(2), _row(3)]), tmp_path / "b.parquet")
    rows = load_prompt_rows(
        [_jsonl(tmp_path / "a.jsonl", [_row(0), _row(1)]), tmp_path / "b.parquet"]
    )
    assert [r.reward_model.ground_truth for r in rows] == ["1", "2", "3", "4"]
    assert rows[3].prompt[1].content == "What is 3 + 1?"


def _break(path: str, value):
    """A row with the value at a dotted path replaced (``...`` deletes the key)."""
    row = _row(0)
    *parents, leaf = path.split(".")
    target = row
    for key in parents:
        target = target[int(key)] if key.isdigit() else target[key]
    if value is ...:
        del target[leaf]
    else:
        target[int(leaf) if leaf.isdigit() else leaf] = value
    return row


BROKEN = [
    ("prompt", ..., "field `prompt`: missing"),
    ("prompt", [], "field `prompt`: expected `array` of length >= 1"),
    ("prompt", "What is 1 + 1?", "field `prompt`: expected `array`, got `str`"),
    (
        "prompt.1.role",
        "human",
        "field `prompt[1].role`: invalid enum value 'human', expected one of",
    ),
    ("prompt.1.content", ..., "field `prompt[1].content`: missing"),
    ("prompt.0.content", 7, "field `prompt[0].content`: expected `str`, got `int`"),
    ("data_source", ..., "field `data_source`: missing"),
    ("data_source", "", "field `data_source`: expected `str` of length >= 1"),
    ("reward_model", "1", "field `reward_model`: expected `object`, got `str`"),
    ("reward_model.style", "rules", "field `reward_model.style`: invalid enum value 'rules'"),
    ("reward_model.ground_truth", ..., "field `reward_model.ground_truth`: missing"),
    ("reward_model.ground_truth", None, "field `reward_model.ground_truth`: expected"),
    ("extra_info", [1], "field `extra_info`: expected `object`, got `array`"),
]


@pytest.mark.parametrize(("path", "value", "message"), BROKEN)
def test_broken_jsonl_row_names_file_line_and_field(tmp_path, path, value, message):
    file = _jsonl(tmp_path / "data.jsonl", [_row(0), _break(path, value)])
    with pytest.raises(DatasetError) as error:
        load_prompt_rows(file)
    assert f"{file}:2: {message}" in str(error.value)


@pytest.mark.parametrize(("path", "value", "message"), BROKEN[:4] + BROKEN[6:8])
def test_broken_parquet_row_names_file_row_and_field(tmp_path, path, value, message):
    file = tmp_path / "data.parquet"
    # The broken row alone: a parquet column holds one type, a good row would not fit beside it.
    pq.write_table(pa.Table.from_pylist([_break(path, value)]), file)
    with pytest.raises(DatasetError) as error:
        load_prompt_rows(file)
    assert f"{file} row 0: {message}" in str(error.value)


def test_unreadable_lines_are_reported_and_blank_lines_skipped(tmp_path):
    file = tmp_path / "data.jsonl"
    file.write_text(json.dumps(_row(0)) + "\n\n[1, 2]\n{not json\n")
    with pytest.raises(DatasetError) as error:
        load_prompt_rows(file)
    assert f"{file}:3: expected a JSON object, got list" in str(error.value)
    assert f"{file}:4: invalid JSON" in str(error.value)
    assert str(error.value).startswith("2 malformed prompt row(s)")


def test_problems_are_collected_across_files_and_the_list_is_capped(tmp_path):
    bad = _break("data_source", ...)
    first = _jsonl(tmp_path / "first.jsonl", [bad] * 4)
    second = _jsonl(tmp_path / "second.jsonl", [_row(0)] + [bad] * 8)
    with pytest.raises(DatasetError) as error:
        load_prompt_rows([first, second])
    message = str(error.value)
    assert message.startswith("12 malformed prompt row(s)")
    assert f"{first}:1:" in message and f"{second}:2:" in message
    assert f"{second}:9:" not in message  # beyond the first ten
    assert message.endswith("... and 2 more")


def test_files_that_cannot_be_datasets(tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        load_prompt_rows(tmp_path / "missing.jsonl")
    with pytest.raises(DatasetError, match=r"unsupported file type '\.csv'"):
        load_prompt_rows(tmp_path / "rows.csv")
    with pytest.raises(DatasetError, match="no prompt rows"):
        load_prompt_rows(_jsonl(tmp_path / "empty.jsonl", []))
    with pytest.raises(DatasetError, match="no prompt files"):
        load_prompt_rows([])


def test_convert_maps_foreign_records_and_its_errors_carry_the_location(tmp_path):
    def convert(record, index):
        if "q" not in record:
            raise ValueError("field `q`: missing")
        return {**_row(index), "prompt": [{"role": "user", "content": record["q"]}]}

    file = _jsonl(tmp_path / "raw.jsonl", [{"q": "a"}, {"q": "b"}, {"x": 1}])
    with pytest.raises(DatasetError, match=f"{file}:3: field `q`: missing"):
        load_prompt_rows(file, convert=convert)
    rows = load_prompt_rows(
        _jsonl(tmp_path / "ok.jsonl", [{"q": "a"}, {"q": "b"}]), convert=convert
    )
    assert [(r.prompt[0].content, r.extra_info["index"]) for r in rows] == [("a", 0), ("b", 1)]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_written_rows_read_back_equal(tmp_path, suffix):
    rows = load_prompt_rows(_jsonl(tmp_path / "in.jsonl", [_row(i) for i in range(5)]))
    assert write_prompt_rows(tmp_path / f"out{suffix}", rows) == 5
    assert load_prompt_rows(tmp_path / f"out{suffix}") == rows
    assert not list(tmp_path.glob("*.partial"))


def test_parquet_without_extra_info_round_trips(tmp_path):
    row = _row(0)
    del row["extra_info"]
    write_prompt_rows(tmp_path / "out.parquet", [row])
    assert load_prompt_rows(tmp_path / "out.parquet")[0].extra_info == {}


def test_an_invalid_row_is_never_written(tmp_path):
    with pytest.raises(DatasetError, match="row 1 to write .*field `data_source`: missing"):
        write_prompt_rows(tmp_path / "out.jsonl", [_row(0), _break("data_source", ...)])
    assert not list(tmp_path.iterdir())


def test_dataset_is_index_based_picklable_and_resumable(tmp_path):
    dataset = PromptDataset.from_files(_jsonl(tmp_path / "a.jsonl", [_row(i) for i in range(6)]))
    assert len(dataset) == 6 and dataset[4].reward_model.ground_truth == "5"
    assert pickle.loads(pickle.dumps(dataset)).rows == dataset.rows

    loader = StatefulDataLoader(dataset, batch_size=2, collate_fn=list)
    batches = iter(loader)
    first = next(batches)
    state = copy.deepcopy(loader.state_dict())
    rest = list(batches)
    resumed = StatefulDataLoader(dataset, batch_size=2, collate_fn=list)
    resumed.load_state_dict(state)
    assert first == [dataset[0], dataset[1]]
    assert list(resumed) == rest == [[dataset[2], dataset[3]], [dataset[4], dataset[5]]]


def test_prompt_key_names_the_messages_column(tmp_path):
    record = _row(1)
    record["question"] = record.pop("prompt")
    path = _jsonl(tmp_path / "q.jsonl", [record])
    (row,) = load_prompt_rows(path, prompt_key="question")
    assert row.prompt[1].content == "What is 1 + 1?"
    with pytest.raises(DatasetError, match=r"q.jsonl:1: no column 'query' \(data.prompt_key\)"):
        load_prompt_rows(path, prompt_key="query")


class WordTokenizer:
    """One token per word of each message, plus one for the generation prompt."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        assert add_generation_prompt and tokenize and not return_dict
        return [0] * (sum(len(m["content"].split()) for m in messages) + 1)


def _rows_of_words(*counts: int) -> list[PromptRow]:
    return [PromptRow(prompt=(ChatMessage("user", " ".join(["w"] * c)),), data_source="s",
                      reward_model=RewardSpec("rule", "1")) for c in counts]


def test_filter_overlong_prompts_drops_and_logs_the_count(caplog):
    rows = _rows_of_words(2, 9, 3, 12)  # 3, 10, 4, 13 tokens
    count = chat_token_counter(WordTokenizer())
    with caplog.at_level("WARNING", logger="relay.configs.prompt_data"):
        fit = fit_prompts(rows, count, 4, drop=True, refuse=True, what="data.train_files")
    assert fit.rows == [rows[0], rows[2]] and fit.dropped == 2
    assert "data.train_files: dropped 2 of 4 prompts longer than data.max_prompt_length = 4" \
        in caplog.text
    with pytest.raises(DatasetError, match="dropped them all"):
        fit_prompts(rows, count, 2, drop=True, refuse=False, what="data.train_files")


def test_truncation_error_names_the_overlong_rows_and_the_alternatives():
    rows = _rows_of_words(2, 9, 3)
    count = chat_token_counter(WordTokenizer())
    with pytest.raises(DatasetError, match=r"1 prompt\(s\) longer .* = 4 tokens: row 1 \(10 "
                                           r"tokens\); data.truncation = 'error'"):
        fit_prompts(rows, count, 4, drop=False, refuse=True, what="data.val_files")
    kept = fit_prompts(rows, count, 4, drop=False, refuse=False, what="data.val_files")
    assert kept.rows == rows and kept.dropped == 0  # left to the generators to cut


def test_truncate_prompt_keeps_the_end_the_start_or_both_halves():
    ids = [1, 2, 3, 4, 5]
    assert truncate_prompt(ids, 3, "left") == [3, 4, 5]
    assert truncate_prompt(ids, 3, "right") == [1, 2, 3]
    assert truncate_prompt(ids, 5, "left") == ids
    # verl's middle: the first max // 2 and the last max - max // 2
    assert truncate_prompt(ids, 3, "middle") == [1, 4, 5]
    assert truncate_prompt(ids, 4, "middle") == [1, 2, 4, 5]
    assert truncate_prompt(ids, 1, "middle") == [5]
    assert truncate_prompt(ids, 6, "middle") == ids


def test_a_generator_cuts_on_the_truncation_side_and_keeps_the_end_after_error() -> None:
    # "error": the buffer refused longer prompts at load, so one a generator sees was
    # measured with another tokenizer; it keeps the end, as "left" does
    assert [cut_side(t) for t in ("error", "left", "right", "middle")] == \
        ["left", "left", "right", "middle"]


def test_rows_are_read_once_while_the_file_is_unchanged(tmp_path, monkeypatch):
    import relay.configs.prompt_data as dataset

    path = _jsonl(tmp_path / "train.jsonl", [_row(i) for i in range(3)])
    reads = []
    real = dataset._read_records
    monkeypatch.setattr(dataset, "_read_records", lambda p: reads.append(p) or real(p))
    with dataset.rows_remembered():
        first = load_prompt_rows(path)
        first.clear()  # a caller's list is its own
        assert len(load_prompt_rows(path)) == 3 and len(reads) == 1
        _jsonl(path, [_row(i) for i in range(4)])  # changed: read again
        assert len(load_prompt_rows(path)) == 4 and len(reads) == 2
    assert len(load_prompt_rows(path)) == 4 and len(reads) == 3  # forgotten outside
