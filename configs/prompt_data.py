"""Prompt datasets in verl's schema, read from (and written to) parquet or JSONL files.

One row per prompt, exactly the columns verl's data preprocessing writes, so verl users
bring their files unchanged:

    prompt        non-empty list of chat messages {"role": ..., "content": str}
    data_source   non-empty str; selects the reward function
    reward_model  {"style": "rule" | "model", "ground_truth": str | number | list | dict}
    extra_info    dict (optional; null or missing reads as {})

Other columns (verl's ``ability``, for instance) are accepted and ignored; the messages may
sit in another column (``prompt_key``, verl's ``data.prompt_key``). Every row is validated on
load; problems are collected across all files and raised together as one ``DatasetError``
naming file, line (JSONL) or row (parquet), field and what was expected. A row is never
dropped silently: ``fit_prompts`` drops prompts longer than the limit only when asked
(``data.filter_overlong_prompts``), and logs how many; ``truncate_prompt`` cuts one
(``data.truncation``).

``PromptDataset`` is an index-based, picklable ``torch.utils.data.Dataset`` of typed rows,
ready for ``torchdata``'s ``StatefulDataLoader`` (use ``collate_fn=list``: rows are not
tensors). This module knows the file schema; of tokenizers it knows only that a prompt's
length is the length of its chat template's token ids (``chat_token_counter``); it knows
nothing of rewards or leasing. It sits in ``configs`` because it is user input checked with
errors that name the file and field, read by the buffer, the generators (the evaluator's
held-out rows, prompt truncation), the launcher and the tools alike.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import torch.utils.data

Role = Literal["system", "user", "assistant", "tool"]
RewardStyle = Literal["rule", "model"]
CutSide = Literal["left", "right", "middle"]  # data.truncation's cuts (truncate_prompt)
GroundTruth = str | int | float | list[Any] | dict[str, Any]
NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]

logger = logging.getLogger(__name__)

SUFFIXES = (".jsonl", ".parquet")
MAX_REPORTED_PROBLEMS = 10

PathLike = str | os.PathLike[str]
Convert = Callable[[dict[str, Any], int], Mapping[str, Any]]  # (record, index in file) -> row


class ChatMessage(msgspec.Struct, frozen=True):
    """One chat turn of a prompt."""

    role: Role
    content: str


class RewardSpec(msgspec.Struct, frozen=True):
    """How a response to the prompt is scored: verl's ``reward_model`` column."""

    style: RewardStyle
    ground_truth: GroundTruth


class PromptRow(msgspec.Struct, frozen=True):
    """One validated prompt row in verl's schema."""

    prompt: Annotated[tuple[ChatMessage, ...], msgspec.Meta(min_length=1)]
    data_source: NonEmptyStr
    reward_model: RewardSpec
    extra_info: dict[str, Any] = msgspec.field(default_factory=dict)


class DatasetError(ValueError):
    """Rows that do not follow the schema; the message lists where and why."""


class PromptDataset(torch.utils.data.Dataset):
    """Index-based dataset of ``PromptRow``; picklable, so it works with loader workers."""

    def __init__(self, rows: Sequence[PromptRow]) -> None:
        self.rows = tuple(rows)

    @classmethod
    def from_files(cls, paths: PathLike | Iterable[PathLike],
                   prompt_key: str = "prompt") -> PromptDataset:
        return cls(load_prompt_rows(paths, prompt_key=prompt_key))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> PromptRow:
        return self.rows[index]


def load_prompt_rows(
    paths: PathLike | Iterable[PathLike], convert: Convert | None = None,
    prompt_key: str = "prompt",
) -> list[PromptRow]:
    """Read and validate every row of one or many ``.jsonl`` / ``.parquet`` files, in order.

    ``prompt_key``: the column holding the chat messages (verl's ``data.prompt_key``).
    ``convert(record, index)`` first maps each raw record (``index`` counts records within
    its file) to a verl row, for files in another schema; a ``ValueError`` it raises is
    reported like a schema problem, with the record's location.

    Inside ``rows_remembered()``, and without ``convert``, files already read are not
    read again while unchanged.
    """
    files = [Path(paths)] if isinstance(paths, (str, os.PathLike)) else [Path(p) for p in paths]
    if not files:
        raise DatasetError("no prompt files given")
    if convert is not None or _remembered is None:
        return _read_rows(files, convert, prompt_key)
    key = (prompt_key, *(_identity(file) for file in files))
    if key not in _remembered:
        _remembered[key] = _read_rows(files, None, prompt_key)
    return list(_remembered[key])


_remembered: dict[tuple[object, ...], list[PromptRow]] | None = None


@contextlib.contextmanager
def rows_remembered() -> Iterator[None]:
    """While inside, ``load_prompt_rows`` remembers the rows of each list of files it reads
    (by path, size and modification time) and reads an unchanged list only once: the
    launcher checks the training files, counts an epoch of them and fingerprints them
    with one read. Forgotten on exit, so no process keeps a second copy of its rows."""
    global _remembered
    outer, _remembered = _remembered, ({} if _remembered is None else _remembered)
    try:
        yield
    finally:
        _remembered = outer


def _identity(file: Path) -> tuple[str, int, int]:
    """A file as ``load_prompt_rows`` remembers it: its path, size and modification time."""
    try:
        stat = file.stat()
    except OSError:
        return str(file), -1, -1  # _read_records reports it
    return str(file.resolve()), stat.st_size, stat.st_mtime_ns


def _read_rows(files: list[Path], convert: Convert | None, prompt_key: str) -> list[PromptRow]:
    """``load_prompt_rows`` without remembering."""
    rows: list[PromptRow] = []
    problems: list[str] = []
    for file in files:
        for index, (where, record) in enumerate(_read_records(file)):
            if isinstance(record, str):  # the record could not even be read
                problems.append(f"{where}: {record}")
                continue
            try:
                if prompt_key != "prompt":
                    record = _prompt_from(record, prompt_key)
                rows.append(_to_row(dict(convert(record, index)) if convert else record))
            except msgspec.ValidationError as error:
                problems.append(f"{where}: {_describe(str(error))}")
            except ValueError as error:
                problems.append(f"{where}: {error}")
    if problems:
        shown = "\n  ".join(problems[:MAX_REPORTED_PROBLEMS])
        more = len(problems) - MAX_REPORTED_PROBLEMS
        tail = f"\n  ... and {more} more" if more > 0 else ""
        raise DatasetError(
            f"{len(problems)} malformed prompt row(s) (verl schema: prompt, data_source, "
            f"reward_model.style/ground_truth, optional extra_info):\n  {shown}{tail}"
        )
    if not rows:
        raise DatasetError(f"no prompt rows in {', '.join(map(str, files))}")
    return rows


def _prompt_from(record: dict[str, Any], prompt_key: str) -> dict[str, Any]:
    """The record with its ``prompt_key`` column as ``prompt``."""
    if prompt_key not in record:
        raise ValueError(f"no column {prompt_key!r} (data.prompt_key); the columns are "
                         f"{', '.join(map(repr, record))}")
    record = dict(record)
    record["prompt"] = record.pop(prompt_key)
    return record


class PromptFit(msgspec.Struct, frozen=True):
    """``fit_prompts``' result: the rows kept and how many were dropped."""

    rows: list[PromptRow]
    dropped: int


def chat_token_counter(tokenizer: Any) -> Callable[[PromptRow], int]:
    """A row's length in tokens as a generator sees it: its messages through the
    tokenizer's chat template, with the generation prompt."""
    def count(row: PromptRow) -> int:
        messages = [{"role": m.role, "content": m.content} for m in row.prompt]
        return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False))
    return count


def fit_prompts(rows: Sequence[PromptRow], count_tokens: Callable[[PromptRow], int],
                max_length: int, *, drop: bool, refuse: bool, what: str) -> PromptFit:
    """Rows whose prompts are longer than ``max_length`` tokens (``count_tokens``): dropped
    when ``drop`` (verl's ``data.filter_overlong_prompts``; the count is logged), else
    refused when ``refuse`` (``data.truncation = "error"``) with a ``DatasetError`` naming
    them, else kept (the generators cut them, ``truncate_prompt``). ``what`` names the data
    in messages ("data.train_files")."""
    lengths = [count_tokens(row) for row in rows]
    over = [i for i, length in enumerate(lengths) if length > max_length]
    if not over or not (drop or refuse):
        return PromptFit(rows=list(rows), dropped=0)
    if drop:
        kept = [row for row, length in zip(rows, lengths) if length <= max_length]
        logger.warning("%s: dropped %d of %d prompts longer than data.max_prompt_length = %d "
                       "tokens (data.filter_overlong_prompts)", what, len(over), len(rows),
                       max_length)
        if not kept:
            raise DatasetError(f"{what}: every prompt is longer than data.max_prompt_length = "
                               f"{max_length} tokens, so data.filter_overlong_prompts dropped "
                               "them all")
        return PromptFit(rows=kept, dropped=len(over))
    shown = ", ".join(f"row {i} ({lengths[i]} tokens)" for i in over[:MAX_REPORTED_PROBLEMS])
    raise DatasetError(f"{what}: {len(over)} prompt(s) longer than data.max_prompt_length = "
                       f"{max_length} tokens: {shown}; data.truncation = 'error' refuses them "
                       "('left' or 'right' cuts them; data.filter_overlong_prompts = true "
                       "drops them)")


def cut_side(truncation: CutSide | Literal["error"]) -> CutSide:
    """The side a generator cuts a prompt longer than ``data.max_prompt_length`` on:
    ``data.truncation``'s, and for "error" (the buffer refused such prompts when it loaded
    them, so one seen later was measured with another tokenizer) the end kept, as "left"."""
    return "left" if truncation == "error" else truncation


def truncate_prompt(ids: Sequence[int], max_length: int, side: CutSide) -> list[int]:
    """A prompt's token ids cut to ``max_length``: ``left`` keeps the last ones (the end of
    the conversation and the generation prompt), ``right`` the first ones, ``middle`` the
    first ``max_length // 2`` and the last ``max_length - max_length // 2`` (verl's)."""
    if len(ids) <= max_length:
        return list(ids)
    if side == "middle":
        head = max_length // 2
        return list(ids[:head]) + list(ids[len(ids) - (max_length - head):])
    return list(ids[-max_length:] if side == "left" else ids[:max_length])


def write_prompt_rows(path: PathLike, rows: Iterable[PromptRow | Mapping[str, Any]]) -> int:
    """Validate ``rows`` and write them as JSONL or parquet (by suffix); returns the count.

    The file is written beside its final name and renamed into place, so a reader never
    sees half a file.
    """
    path = Path(path)
    _check_suffix(path)
    validated = []
    for index, row in enumerate(rows):
        try:
            validated.append(row if isinstance(row, PromptRow) else _to_row(dict(row)))
        except msgspec.ValidationError as error:
            raise DatasetError(f"row {index} to write to {path}: {_describe(str(error))}") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    if path.suffix == ".jsonl":
        partial.write_bytes(b"".join(msgspec.json.encode(row) + b"\n" for row in validated))
    else:
        records = msgspec.to_builtins(validated)
        if not any(record["extra_info"] for record in records):
            for record in records:  # parquet cannot store a struct without fields
                del record["extra_info"]
        pq.write_table(pa.Table.from_pylist(records), partial)
    partial.replace(path)
    return len(validated)


def _read_records(path: Path) -> Iterator[tuple[str, dict[str, Any] | str]]:
    """Yield (location, record) per row, or (location, reason) where a row is unreadable."""
    _check_suffix(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    if path.suffix == ".parquet":
        for index, record in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path} row {index}", record
        return
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                yield f"{path}:{number}", f"invalid JSON ({error})"
                continue
            if not isinstance(record, dict):
                yield f"{path}:{number}", f"expected a JSON object, got {type(record).__name__}"
                continue
            yield f"{path}:{number}", record


def _check_suffix(path: Path) -> None:
    if path.suffix not in SUFFIXES:
        raise DatasetError(
            f"{path}: unsupported file type {path.suffix!r}, expected one of {SUFFIXES}"
        )


def _to_row(record: dict[str, Any]) -> PromptRow:
    if record.get("extra_info", {}) is None:
        record = {key: value for key, value in record.items() if key != "extra_info"}
    return msgspec.convert(record, PromptRow)


_CHOICES = {"role": get_args(Role), "style": get_args(RewardStyle)}


def _describe(message: str) -> str:
    """Turn msgspec's "<what> - at `$.a.b`" into "field `a.b`: <what>" plus valid values."""
    match = re.fullmatch(r"(?P<what>.*?)(?: - at `\$\.?(?P<path>.*)`)?", message, re.DOTALL)
    assert match is not None  # the pattern matches any string
    what, path = match["what"], match["path"] or ""
    missing = re.fullmatch(r"Object missing required field `(?P<field>[^`]+)`", what)
    if missing:
        path = f"{path}.{missing['field']}" if path else missing["field"]
        what = "missing (required)"
    leaf = re.sub(r"\[\d+\]$", "", path.rsplit(".", 1)[-1])
    if what.startswith("Invalid enum value") and leaf in _CHOICES:
        what += f", expected one of {', '.join(map(repr, _CHOICES[leaf]))}"
    return f"field `{path}`: {what[:1].lower()}{what[1:]}" if path else what
