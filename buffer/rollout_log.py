"""The append-only rollout log: every group the buffer admitted, and what each learner step
was served, on disk, for offline replay (``relay replay``) and reading (``relay rollouts``).

A log is a folder. Groups go to segment files ``segment-000000.rlog``,
``segment-000001.rlog``, ...: ``relay.transport.records`` records back to back, one per
``RolloutGroup``, encoded with the wire codec (msgspec + raw tensor frames), so a reader
needs nothing but Relay. A segment is closed and a new one begun past ``segment_bytes``, and
every writer (a restarted buffer) begins a new one. What each learner step consumed goes to
``steps.rlog``: one ``StepRecord`` per batch served (the groups by rollout id, in order, and
their importance weights); the samples a step trained on are those of the logged group that
the store kept (``metadata["buffer_admission"]["kept_samples"]``).

Durability: records are written unbuffered (one ``write`` each, straight to the file) and
the files fsynced whenever the learner writes a checkpoint (``RolloutLogWriter.sync``), so a
replay from any checkpoint finds what followed it up to the crash. A write that fails
part-way (a full disk) is cut back off the file (``ftruncate`` to where it began), so later
records never sit behind a torn one; a crash can still leave the last record of a file torn,
which the readers report with its file and byte offset (``LogProblem``) and skip.

Size (``LogBudget``, ``buffer.rollout_log_max_gb``): at each checkpoint, while the segments
hold more than the budget, the oldest segments that no kept checkpoint's replay can need
are deleted (``RolloutLogWriter.checkpointed``). A replay from checkpoint C reads the groups
served at the steps after C, at learner versions from C's on; the learner keeps its
``keep_last`` newest checkpoints, and no group is served more than ``max_staleness``
versions after the learner version it was logged under. So a segment closed when the
learner held version V is needed by no kept checkpoint once

    V + max_staleness < version at the oldest kept checkpoint,

and the segments of an earlier buffer process (a resumed run: this buffer serves none of
their groups) once the oldest kept checkpoint is one of this process's. What is still over
the budget after that is logged once: every remaining segment may be replayed. The step
records (``steps.rlog``, a few hundred bytes a step) are never deleted.

Steps replayed after a resume: the resumed run serves steps after its checkpoint again, so a
step record for step s makes every earlier record for steps >= s void (``read_steps``): the
log then describes the lineage of the weights that were kept.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import msgspec

from relay.buffer.durable import fsync_dir
from relay.transport.codec import Decoder, WireError, encode
from relay.transport.messages import RolloutGroup
from relay.transport.records import RecordError, pack, unpack_from

logger = logging.getLogger(__name__)

SEGMENT_GLOB = "segment-*.rlog"
STEPS_FILE = "steps.rlog"
DEFAULT_SEGMENT_BYTES = 64 << 20


class LogProblem(msgspec.Struct, frozen=True):
    """A record the reader could not use: where and why."""

    segment: str
    offset: int
    reason: str


class StepRecord(msgspec.Struct, frozen=True):
    """The batch served for learner step ``step`` (counted from 1): its groups by rollout id,
    in order, their importance weights (empty: all 1), and the weights version the learner
    held when it asked (the version it trained that step at)."""

    step: int
    version: int
    rollout_ids: list[str]
    weights: list[float] = []


class LogBudget(msgspec.Struct, frozen=True):
    """At most ``max_bytes`` of segments (0: no budget), kept by deleting what no kept
    checkpoint's replay can need (module docstring): the learner keeps ``keep_last``
    checkpoints (``checkpoint.keep_last``) and serves no group more than ``max_staleness``
    versions after it was logged (``buffer.max_staleness``)."""

    max_bytes: int
    keep_last: int
    max_staleness: int


class _Mark(msgspec.Struct, frozen=True):
    """A checkpoint as the log saw it: the learner's version then, and the first segment
    not yet closed (every segment below it holds only groups logged at most that version)."""

    version: int
    open_from: int


class RolloutLogWriter:
    """Appends groups to the newest segment of ``folder`` (rolling segments by size) and
    step records to ``folder/steps.rlog``; keeps the segments within ``budget``."""

    def __init__(self, folder: str | Path, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                 budget: LogBudget | None = None) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = segment_bytes
        self.budget = budget
        # after the newest segment there (older ones may have been deleted for the budget)
        self._index = max((index for index, _ in _segments(self.folder)), default=-1) + 1
        self._first_own = self._index  # the segments below are an earlier buffer's
        self._file: BinaryIO | None = None
        self._steps = _open_unbuffered(self.folder / STEPS_FILE)
        _cut_torn_tail(self._steps, self.folder / STEPS_FILE)
        self._marks: dict[int, _Mark] = {}  # by learner step
        self._warned_over_budget = False
        self.records = 0
        self.segments_deleted = 0

    def append(self, group: RolloutGroup) -> None:
        record = pack(encode(group))
        end = 0 if self._file is None else self._file.seek(0, os.SEEK_END)
        if self._file is None or end + len(record) > self.segment_bytes:
            self._roll()
        assert self._file is not None
        _write_whole(self._file, record)
        self.records += 1

    def append_step(self, record: StepRecord) -> None:
        _write_whole(self._steps, pack([msgspec.msgpack.encode(record)]))

    def sync(self) -> None:
        """Make everything written so far durable (the learner is writing a checkpoint)."""
        for file in (self._file, self._steps):
            if file is not None:
                file.flush()
                os.fsync(file.fileno())
        fsync_dir(self.folder)

    def checkpointed(self, step: int, learner_version: int) -> None:
        """The learner wrote its checkpoint after ``step`` at ``learner_version`` (the log is
        synced): delete the oldest segments no kept checkpoint needs while over the budget
        (module docstring). A step asked again (a retried request) counts once."""
        open_from = self._index - (1 if self._file is not None else 0)
        self._marks.setdefault(step, _Mark(version=learner_version, open_from=open_from))
        budget = self.budget
        if budget is None or not budget.max_bytes:
            return
        sizes = [(index, path, path.stat().st_size) for index, path in _segments(self.folder)]
        total = sum(size for _, _, size in sizes)
        needed_from = self._needed_from(budget)
        for index, path, size in sizes:
            if total <= budget.max_bytes or index >= needed_from:
                break
            path.unlink()
            total -= size
            self.segments_deleted += 1
            logger.info("rollout log: deleted %s (%.1f MB) to stay within %.3g GB "
                        "(buffer.rollout_log_max_gb); no kept checkpoint's replay reads it",
                        path.name, size / 1e6, budget.max_bytes / 1e9)
        if total > budget.max_bytes and not self._warned_over_budget:
            self._warned_over_budget = True
            logger.warning("rollout log: %.2f GB in %s, over its %.3g GB budget "
                           "(buffer.rollout_log_max_gb), and a replay from a kept checkpoint "
                           "may read every segment left: nothing more is deleted until later "
                           "checkpoints (trainer.save_freq) make older segments unneeded",
                           total / 1e9, self.folder, budget.max_bytes / 1e9)

    def _needed_from(self, budget: LogBudget) -> int:
        """The first segment a kept checkpoint's replay may need: the segments below it may
        go (module docstring)."""
        marks = [self._marks[step] for step in sorted(self._marks)]
        if len(marks) < budget.keep_last:
            return 0  # the oldest kept checkpoint may be an earlier process's
        oldest_kept = marks[-budget.keep_last].version
        return max([self._first_own, *(m.open_from for m in marks
                                        if m.version + budget.max_staleness < oldest_kept)])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._steps.close()

    def _roll(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file = _open_unbuffered(self.folder / f"segment-{self._index:06d}.rlog")
        self._index += 1


def _segments(folder: Path) -> list[tuple[int, Path]]:
    """The segment files of ``folder`` by index, oldest first."""
    found = [(int(path.stem.removeprefix("segment-")), path)
             for path in folder.glob(SEGMENT_GLOB)
             if path.stem.removeprefix("segment-").isdigit()]
    return sorted(found)


def _open_unbuffered(path: Path) -> BinaryIO:
    """``path`` for appending, unbuffered: each ``write`` goes to the file at once, so a
    failed one leaves nothing behind in a buffer to fail again (``_write_whole``)."""
    return open(path, "ab", buffering=0)


def _write_whole(file: BinaryIO, record: bytes) -> None:
    """Append all of ``record`` (an unbuffered write may take part of it); if that fails,
    cut the file back to where it was, so the next record does not land behind a torn one,
    and re-raise."""
    start = file.seek(0, os.SEEK_END)
    try:
        view = memoryview(record)
        while view:
            view = view[file.write(view):]
    except OSError:
        try:
            os.ftruncate(file.fileno(), start)
        except OSError as exc:
            logger.error("rollout log: could not cut a failed write back off %s at byte %d "
                         "(%s); readers will report a torn record there", file.name, start, exc)
        raise


def _cut_torn_tail(file: BinaryIO, path: Path) -> None:
    """A crash may have left ``path``'s last record torn: report it and cut it off before
    appending."""
    view = memoryview(path.read_bytes())
    offset = 0
    while offset < len(view):
        try:
            _, offset = unpack_from(view, offset)
        except RecordError as exc:
            logger.warning("rollout log: %s ends in a torn record at byte %d (%s); cut off",
                           path, offset, exc)
            file.truncate(offset)
            return


def served_group(logged: RolloutGroup) -> RolloutGroup:
    """The group as the learner was served it: the samples the store kept
    (``metadata["buffer_admission"]["kept_samples"]``; all of them when it says nothing)."""
    metadata = dict(logged.metadata)
    note = metadata.pop("buffer_admission", None) or {}
    kept = note.get("kept_samples", range(len(logged.samples)))
    return msgspec.structs.replace(logged, samples=[logged.samples[i] for i in kept],
                                   metadata=metadata)


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
        for offset, frames in _records(segment, problems):
            try:
                yield decoder.decode([bytearray(f) for f in frames])
            except WireError as exc:
                _note(problems, LogProblem(segment=str(segment), offset=offset, reason=str(exc)))


def read_steps(folder: str | Path,
               problems: list[LogProblem] | None = None) -> dict[int, StepRecord]:
    """The step records of ``folder`` by step, of the weights' lineage: a record for step s
    voids every earlier record for steps >= s (a resumed run went on from an earlier
    checkpoint). Unreadable records are skipped and noted in ``problems``."""
    path = Path(folder) / STEPS_FILE
    if not path.exists():
        raise FileNotFoundError(f"no step records ({STEPS_FILE}) in {folder}: the run was "
                                "made before Relay recorded what each step consumed, or "
                                "buffer.rollout_log was off")
    decoder = msgspec.msgpack.Decoder(StepRecord)
    steps: dict[int, StepRecord] = {}
    for offset, frames in _records(path, problems):
        try:
            record = decoder.decode(frames[0]) if len(frames) == 1 else None
        except msgspec.DecodeError as exc:
            record, why = None, str(exc)
        else:
            why = f"{len(frames)} frames, expected 1"
        if record is None:
            _note(problems, LogProblem(segment=str(path), offset=offset, reason=why))
            continue
        steps = {s: r for s, r in steps.items() if s < record.step}
        steps[record.step] = record
    return steps


def _records(path: Path, problems: list[LogProblem] | None) -> Iterator[tuple[int, list]]:
    """(offset, frames) of each whole record of ``path``; a torn record is noted and ends
    the file."""
    view = memoryview(path.read_bytes())
    offset = 0
    while offset < len(view):
        try:
            frames, end = unpack_from(view, offset)
        except RecordError as exc:
            _note(problems, LogProblem(segment=str(path), offset=offset,
                                       reason=f"torn record: {exc}"))
            return
        yield offset, frames
        offset = end


def _note(problems: list[LogProblem] | None, problem: LogProblem) -> None:
    logger.warning("rollout log: %s at byte %d: %s", problem.segment, problem.offset,
                   problem.reason)
    if problems is not None:
        problems.append(problem)
