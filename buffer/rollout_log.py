"""The append-only rollout log: every accepted group, on disk, for offline replay.

A log is a folder of segment files ``segment-000000.rlog``, ``segment-000001.rlog``, ...
Each holds ``transport.records`` records back to back, one per ``RolloutGroup``, encoded
with the wire codec (msgspec + raw tensor frames), so a reader needs nothing but Relay. A
segment is closed and a new one begun past ``segment_bytes``. Records are flushed as
written; a crash can leave at most the last record of the last segment torn, which the
reader reports and skips.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import msgspec

from transport.codec import Decoder, WireError, encode
from transport.messages import RolloutGroup
from transport.records import RecordError, pack, unpack_from

logger = logging.getLogger(__name__)

SEGMENT_GLOB = "segment-*.rlog"
DEFAULT_SEGMENT_BYTES = 64 << 20


class LogProblem(msgspec.Struct, frozen=True):
    """A record the reader could not use: where and why."""

    segment: str
    offset: int
    reason: str


class RolloutLogWriter:
    """Appends groups to the newest segment of ``folder``, rolling segments by size."""

    def __init__(self, folder: str | Path, segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = segment_bytes
        existing = sorted(self.folder.glob(SEGMENT_GLOB))
        self._index = len(existing)
        self._file: BinaryIO | None = None
        self.records = 0

    def append(self, group: RolloutGroup) -> None:
        record = pack(encode(group))
        if self._file is None or self._file.tell() + len(record) > self.segment_bytes:
            self._roll()
        assert self._file is not None
        self._file.write(record)
        self._file.flush()
        self.records += 1

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _roll(self) -> None:
        self.close()
        self._file = open(self.folder / f"segment-{self._index:06d}.rlog", "ab")
        self._index += 1


def read_rollout_log(folder: str | Path,
                     problems: list[LogProblem] | None = None) -> Iterator[RolloutGroup]:
    """Every readable group in ``folder``, oldest first.

    A record that cannot be decoded is skipped and appended to ``problems`` (and logged);
    a torn record ends its segment.
    """
    decoder = Decoder(RolloutGroup)
    segments = sorted(Path(folder).glob(SEGMENT_GLOB))
    if not segments:
        raise FileNotFoundError(f"no rollout log segments ({SEGMENT_GLOB}) in {folder}")
    for segment in segments:
        view = memoryview(segment.read_bytes())
        offset = 0
        while offset < len(view):
            try:
                frames, end = unpack_from(view, offset)
            except RecordError as exc:
                _note(problems, LogProblem(segment=str(segment), offset=offset,
                                           reason=f"torn record: {exc}"))
                break
            try:
                yield decoder.decode([bytearray(f) for f in frames])
            except WireError as exc:
                _note(problems, LogProblem(segment=str(segment), offset=offset, reason=str(exc)))
            offset = end


def _note(problems: list[LogProblem] | None, problem: LogProblem) -> None:
    logger.warning("rollout log: %s at byte %d: %s", problem.segment, problem.offset,
                   problem.reason)
    if problems is not None:
        problems.append(problem)
