"""SFT rows to token ids and loss masks (verl's ``SFTDataset`` and ``MultiTurnSFTDataset``).

A file is parquet (``.parquet``) or JSON lines (anything else); every row becomes one
``SftExample``: its token ids and a loss mask over them, True on the tokens the loss is on.

- Single-turn (``data.prompt_key``, ``data.response_key``): the prompt as one user turn
  through the tokenizer's chat template with the assistant's header
  (``add_generation_prompt``), as verl renders it; a tokenizer without a chat template
  takes the prompt text raw. Then the response text and the eos token. The loss is on the
  response and its eos.
- Multi-turn (``data.multiturn.enable``, ``messages_key``): the chat through the template;
  the loss is on every assistant turn's tokens. Each turn's tokens are found by tokenizing
  prefixes of the chat: assistant turn i spans from the end of
  ``template(messages[:i], add_generation_prompt=True)`` (its header is context, not
  trained) to the end of ``template(messages[:i + 1])``. A template whose renderings of
  the prefixes are not prefixes of the whole chat's is refused naming the row.

A row longer than ``max_length`` is refused (``truncation = "error"``) or cut, keeping its
last (``left``) or first (``right``) ``max_length`` tokens with their mask entries. A row
whose loss mask is empty after that trains on nothing; it is refused naming the row.

Every problem with a row is a ``SftDataError`` naming the file, the row (0-based) and the
field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch
from transformers import PreTrainedTokenizerBase

from relay.configs.sft_schema import SftDataConfig
from relay.learner.batch import TrainBatch


class SftDataError(ValueError):
    """A bad SFT file or row: ``file``, ``row`` (0-based; None for the whole file), the
    ``field`` and what is wrong."""

    def __init__(self, file: str, row: int | None, field: str, problem: str) -> None:
        where = file if row is None else f"{file}: row {row}"
        super().__init__(f"{where}: {field}: {problem}" if field else f"{where}: {problem}")


class SftExample(msgspec.Struct, frozen=True):
    """One row: token ids and, per token, whether the loss is on it (same length)."""

    input_ids: list[int]
    loss_mask: list[bool]


def read_rows(path: str) -> Iterator[tuple[int, Any]]:
    """(row number, row) of a parquet or JSON-lines file."""
    file = Path(path)
    if not file.is_file():
        raise SftDataError(path, None, "", "no such file")
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(file)
        except Exception as exc:  # pyarrow's errors have no common base class
            raise SftDataError(path, None, "", f"not a readable parquet file: {exc}") from None
        yield from enumerate(table.to_pylist())
        return
    with file.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as exc:
                raise SftDataError(path, number, "", f"not JSON: {exc}") from None


def load_examples(files: Sequence[str], tokenizer: PreTrainedTokenizerBase,
                  data: SftDataConfig) -> list[SftExample]:
    """Every row of ``files``, in order, as ``SftExample``s (module docstring)."""
    if tokenizer.eos_token_id is None and not data.multiturn.enable:
        raise ValueError("the tokenizer has no eos token to end each response with")
    examples = []
    for path in files:
        for number, row in read_rows(path):
            if not isinstance(row, dict):
                raise SftDataError(path, number, "", f"a row must be an object, not "
                                                     f"{type(row).__name__}")
            if data.multiturn.enable:
                example = multi_turn_example(tokenizer, _field(row, data.multiturn.messages_key,
                                                               path, number), path, number,
                                             data.multiturn.messages_key)
            else:
                prompt = _text(row, [data.prompt_key, *data.prompt_dict_keys], path, number)
                response = _text(row, [data.response_key, *data.response_dict_keys], path,
                                 number)
                example = single_turn_example(tokenizer, prompt, response)
            examples.append(truncated(example, data, path, number))
    if not examples:
        raise SftDataError(", ".join(files), None, "", "no rows")
    return examples


def _field(row: dict[str, Any], key: str, path: str, number: int,
           name: str | None = None) -> Any:
    """``row[key]``; missing, an error naming the field ``name`` (default ``key``)."""
    if key not in row:
        raise SftDataError(path, number, name or key, f"missing (there are {sorted(row)})")
    return row[key]


def _text(row: dict[str, Any], keys: list[str], path: str, number: int) -> str:
    """The string at ``row[keys[0]][keys[1]]...``; errors name the dotted field."""
    value: Any = row
    for depth, key in enumerate(keys):
        if not isinstance(value, dict):
            raise SftDataError(path, number, ".".join(keys[:depth]),
                               f"must be an object holding {key!r}, not {type(value).__name__}")
        value = _field(value, key, path, number, ".".join(keys[:depth + 1]))
    if not isinstance(value, str):
        raise SftDataError(path, number, ".".join(keys),
                           f"must be a string, not {type(value).__name__}")
    return value


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """The prompt as a user turn through the chat template, ending in the assistant's
    header; raw text when the tokenizer has no template."""
    if tokenizer.chat_template is None:
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return _template_ids(tokenizer, [{"role": "user", "content": prompt}],
                         add_generation_prompt=True)


def single_turn_example(tokenizer: PreTrainedTokenizerBase, prompt: str,
                        response: str) -> SftExample:
    """Prompt ids (no loss), then response ids and eos (loss)."""
    head = prompt_ids(tokenizer, prompt)
    tail = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return SftExample(input_ids=head + tail, loss_mask=[False] * len(head) + [True] * len(tail))


def _template_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                  add_generation_prompt: bool = False) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        tokenize=True, return_dict=False)
    return list(ids)


def multi_turn_example(tokenizer: PreTrainedTokenizerBase, messages: Any, path: str,
                       number: int, key: str = "messages") -> SftExample:
    """A chat's ids with the loss on every assistant turn (module docstring)."""
    _check_messages(messages, path, number, key)
    if tokenizer.chat_template is None:
        raise SftDataError(path, number, key, "multi-turn rows need a tokenizer with a chat "
                                              "template")
    whole = _template_ids(tokenizer, messages)
    mask = [False] * len(whole)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(_template_ids(tokenizer, messages[:i], add_generation_prompt=True))
        through = _template_ids(tokenizer, messages[:i + 1])
        if whole[:len(through)] != through or start > len(through):
            raise SftDataError(path, number, f"{key}[{i}]", "the chat template renders this "
                               "turn differently inside the whole chat than after its prefix; "
                               "per-turn loss masks need a prefix-stable template")
        mask[start:len(through)] = [True] * (len(through) - start)
    return SftExample(input_ids=whole, loss_mask=mask)


def _check_messages(messages: Any, path: str, number: int, key: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise SftDataError(path, number, key, "must be a non-empty list of messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise SftDataError(path, number, f"{key}[{i}]", "must be an object with 'role' "
                                                            "and 'content'")
        for field in ("role", "content"):
            if not isinstance(message.get(field), str):
                raise SftDataError(path, number, f"{key}[{i}].{field}", "missing or not a "
                                                                        "string")
    if not any(message["role"] == "assistant" for message in messages):
        raise SftDataError(path, number, key, "no assistant turn to train on")


def truncated(example: SftExample, data: SftDataConfig, path: str, number: int) -> SftExample:
    """``example`` within ``data.max_length`` tokens per ``data.truncation``."""
    length, limit = len(example.input_ids), data.max_length
    if length > limit:
        if data.truncation == "error":
            raise SftDataError(path, number, "", f"{length} tokens, more than data.max_length "
                               f"= {limit} (data.truncation = 'error'; 'left' or 'right' cut "
                               "it)")
        span = slice(length - limit, None) if data.truncation == "left" else slice(None, limit)
        example = SftExample(input_ids=example.input_ids[span],
                             loss_mask=example.loss_mask[span])
    if not any(example.loss_mask[1:]):  # the first token is never predicted
        raise SftDataError(path, number, "", "no token to train on (after truncation)")
    return example


def collate_examples(examples: Sequence[SftExample], pad_id: int) -> TrainBatch:
    """Right-padded rows as the learner's ``TrainBatch``: ``response_mask`` (B, L - 1) is
    the loss mask on the shifted grid (entry j: token j + 1); each row its own group; the
    RL-only fields neutral (rewards 0, weights 1)."""
    rows, width = len(examples), max(len(e.input_ids) for e in examples)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    attention = torch.zeros((rows, width), dtype=torch.long)
    mask = torch.zeros((rows, width - 1))
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        input_ids[row, :n] = torch.tensor(example.input_ids)
        attention[row, :n] = 1
        mask[row, :n - 1] = torch.tensor(example.loss_mask[1:], dtype=torch.float32)
    first = [next((i for i, m in enumerate(e.loss_mask) if m), len(e.loss_mask))
             for e in examples]
    return TrainBatch(
        input_ids=input_ids, attention_mask=attention, response_mask=mask,
        behavior_logprobs=torch.zeros((rows, width - 1)),
        versions=torch.full((rows, width - 1), -1, dtype=torch.long),
        rewards=torch.zeros(rows), group_ids=torch.arange(rows),
        response_lengths=torch.tensor([len(e.input_ids) - f for e, f in zip(examples, first)],
                                      dtype=torch.long),
        sample_weights=torch.ones(rows), baseline_rewards=torch.full((rows,), float("nan")))
