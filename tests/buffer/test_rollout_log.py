"""The rollout log keeps every group, rolls segments, and survives a torn tail."""

from pathlib import Path

import torch

from buffer.rollout_log import RolloutLogWriter, read_rollout_log
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
