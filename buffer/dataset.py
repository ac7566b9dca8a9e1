"""Prompt datasets in verl's schema, read from (and written to) parquet or JSONL files.

One row per prompt, exactly the columns verl's data preprocessing writes, so verl users
bring their files unchanged:

    prompt        non-empty list of chat messages {"role": ..., "content": str}
    data_source   non-empty str; selects the reward function
    reward_model  {"style": "rule" | "model", "ground_truth": str | number | list | dict}
    extra_info    dict (optional; null or missing reads as {})

Other columns (verl's ``ability``, for instance) are accepted and ignored. Every row is
validated on load; problems are collected across all files and raised together as one
``DatasetError`` naming file, line (JSONL) or row (parquet), field and what was expected.
A row is never dropped silently.

``PromptDataset`` is an index-based, picklable ``torch.utils.data.Dataset`` of typed rows,
ready for ``torchdata``'s ``StatefulDataLoader`` (use ``collate_fn=list``: rows are not
tensors). This module knows the file schema; it knows nothing of tokenizers, rewards or
leasing.
"""

from __future__ import annotations

import json
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
GroundTruth = str | int | float | list[Any] | dict[str, Any]
NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]

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
    def from_files(cls, paths: PathLike | Iterable[PathLike]) -> PromptDataset:
        return cls(load_prompt_rows(paths))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> PromptRow:
        return self.rows[index]


def load_prompt_rows(
    paths: PathLike | Iterable[PathLike], convert: Convert | None = None
) -> list[PromptRow]:
    """Read and validate every row of one or many ``.jsonl`` / ``.parquet`` files, in order.

    ``convert(record, index)`` first maps each raw record (``index`` counts records within
    its file) to a verl row, for files in another schema; a ``ValueError`` it raises is
    reported like a schema problem, with the record's location.
    """
    files = [Path(paths)] if isinstance(paths, (str, os.PathLike)) else [Path(p) for p in paths]
    if not files:
        raise DatasetError("no prompt files given")
    rows: list[PromptRow] = []
    problems: list[str] = []
    for file in files:
        for index, (where, record) in enumerate(_read_records(file)):
            if isinstance(record, str):  # the record could not even be read
                problems.append(f"{where}: {record}")
                continue
            try:
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
