"""The rollout log keeps every group and what each step was served, rolls segments, and
survives a torn tail or a failed write."""

from pathlib import Path

import pytest
import torch

from buffer.rollout_log import RolloutLogWriter, StepRecord, read_rollout_log, read_steps
from transport.messages import Prompt

from .conftest import make_group


def groups(count: int):
    return [make_group("L1", Prompt(prompt_id=f"p{i}", messages=[], data_source="d"), 2,
                       version=i) for i in range(count)]


def test_round_trip_across_segments(tmp_path: Path) -> None:
    writer = RolloutLogWriter(tmp_path, segment_bytes=2000)
    written = groups(12)
    for g in written:
        writer.append(g)
    writer.close()
    assert len(list(tmp_path.glob("segment-*.rlog"))) > 1
    read = list(read_rollout_log(tmp_path))
    assert [g.rollout_id for g in read] == [g.rollout_id for g in written]
    torch.testing.assert_close(read[5].samples[1].versions, written[5].samples[1].versions)


def test_torn_last_record_is_reported_not_fatal(tmp_path: Path) -> None:
    writer = RolloutLogWriter(tmp_path)
    for g in groups(3):
        writer.append(g)
    writer.close()
    segment = next(tmp_path.glob("segment-*.rlog"))
    segment.write_bytes(segment.read_bytes()[:-10])
    problems: list = []
    read = list(read_rollout_log(tmp_path, problems))
    assert len(read) == 2 and len(problems) == 1 and "torn record" in problems[0].reason


def test_reopening_appends_a_new_segment(tmp_path: Path) -> None:
    for g in groups(2):
        writer = RolloutLogWriter(tmp_path)
        writer.append(g)
        writer.close()
    assert len(list(tmp_path.glob("segment-*.rlog"))) == 2
    assert len(list(read_rollout_log(tmp_path))) == 2


def steps_of(folder: Path, *records: tuple[int, int]) -> None:
    writer = RolloutLogWriter(folder)
    for step, version in records:
        writer.append_step(StepRecord(step=step, version=version, rollout_ids=[f"r{step}"]))
    writer.close()


def test_step_records_round_trip(tmp_path: Path) -> None:
    writer = RolloutLogWriter(tmp_path)
    writer.append_step(StepRecord(step=1, version=0, rollout_ids=["a", "b"], weights=[1.0, 0.5]))
    writer.sync()
    writer.close()
    assert read_steps(tmp_path) == {
        1: StepRecord(step=1, version=0, rollout_ids=["a", "b"], weights=[1.0, 0.5])}


def test_a_resumed_run_voids_the_steps_it_serves_again(tmp_path: Path) -> None:
    """Steps 1-5, then a resume from the checkpoint after step 3 that died after step 4."""
    steps_of(tmp_path, (1, 0), (2, 1), (3, 2), (4, 3), (5, 4))
    steps_of(tmp_path, (4, 13), )
    steps = read_steps(tmp_path)
    assert sorted(steps) == [1, 2, 3, 4] and steps[4].version == 13


def test_a_torn_step_record_is_reported_and_cut_before_appending(tmp_path: Path, caplog) -> None:
    steps_of(tmp_path, (1, 0), (2, 1))
    path = tmp_path / "steps.rlog"
    whole = path.read_bytes()
    path.write_bytes(whole[:-3])
    problems: list = []
    assert list(read_steps(tmp_path, problems)) == [1]
    assert "torn record" in problems[0].reason and problems[0].offset > 0
    steps_of(tmp_path, (2, 7))  # the restarted buffer cuts the torn tail, then appends
    assert "torn record" in caplog.text
    problems = []
    assert read_steps(tmp_path, problems)[2].version == 7 and problems == []


def test_a_failed_write_is_cut_back_so_later_records_stay_readable(tmp_path: Path) -> None:
    writer = RolloutLogWriter(tmp_path)
    writer.append(groups(1)[0])
    real = writer._file
    size = real.tell()

    class HalfWrite:
        """Writes half the record, then fails like a full disk."""

        def __init__(self, file) -> None:
            self.file = file

        def write(self, data: bytes) -> int:
            self.file.write(data[: len(data) // 2])
            self.file.flush()
            raise OSError(28, "No space left on device")

        def __getattr__(self, name: str):
            return getattr(self.file, name)

    writer._file = HalfWrite(real)
    with pytest.raises(OSError):
        writer.append(groups(2)[1])
    writer._file = real
    assert real.tell() == size
    writer.append(groups(3)[2])
    writer.close()
    problems: list = []
    assert len(list(read_rollout_log(tmp_path, problems))) == 2 and problems == []


def test_no_step_records_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "segment-000000.rlog").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="steps.rlog"):
        read_steps(tmp_path)
