"""The rollout log keeps every group and what each step was served, rolls segments,
survives a torn tail or a failed write, and keeps within its size budget the segments a
kept checkpoint's replay may read."""

import logging
import multiprocessing
import os
import resource
import signal
from pathlib import Path

import pytest
import torch

from relay.buffer.rollout_log import (
    LogBudget,
    RolloutLogWriter,
    StepRecord,
    read_rollout_log,
    read_steps,
)
from relay.transport.messages import Prompt

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


def _append_past_a_file_size_limit(folder: Path) -> None:
    """In a forked child: a write that meets a real size limit part-way (RLIMIT_FSIZE,
    like a full disk: the kernel writes what fits, then fails with EFBIG), then one more
    write once the limit is lifted. Exits 0 when the failed write raised."""
    writer = RolloutLogWriter(folder)
    first, failing, after = groups(3)
    writer.append(first)
    size = (folder / "segment-000000.rlog").stat().st_size
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 100, hard))  # a part of the record
    try:
        writer.append(failing)
    except OSError:
        raised = True
    else:
        raised = False
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    writer.append(after)
    writer.close()
    os._exit(0 if raised else 3)


def test_a_write_failing_part_way_is_cut_back_so_later_records_stay_readable(
        tmp_path: Path) -> None:
    """The failed group leaves no byte behind: the log reads the groups before and after
    it and reports no problem. (Buffered, the failed part stayed in the buffer, the
    cutting back flushed it and failed again, and the next write completed the failed
    record: the group reported as not written was in the log after all.)"""
    child = multiprocessing.get_context("fork").Process(
        target=_append_past_a_file_size_limit, args=(tmp_path,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    problems: list = []
    assert [g.prompt_id for g in read_rollout_log(tmp_path, problems)] == ["p0", "p2"]
    assert problems == []


# -- the size budget: segments no kept checkpoint's replay can read go ----------------------

ONE_GROUP_PER_SEGMENT = 1  # segment_bytes: every group opens a segment of its own


def segment_indices(folder: Path) -> list[int]:
    return sorted(int(p.stem.removeprefix("segment-")) for p in folder.glob("segment-*.rlog"))


def checkpoints_between_groups(writer: RolloutLogWriter,
                               plan: list[tuple[int, int, int]]) -> dict[int, list[int]]:
    """For each (groups to append, step, learner version): append them, then checkpoint;
    the segments left after each step."""
    written, left = iter(groups(sum(count for count, _, _ in plan))), {}
    for count, step, version in plan:
        for _ in range(count):
            writer.append(next(written))
        writer.checkpointed(step, version)
        left[step] = segment_indices(writer.folder)
    return left


# groups 0-1 at version 0, checkpoint after step 1 (v1); group 2-3, step 2 (v2); ...
PLAN = [(2, 1, 1), (2, 2, 2), (1, 3, 3), (1, 4, 4), (1, 5, 5)]


def test_over_budget_the_segments_no_kept_checkpoint_needs_are_deleted(tmp_path: Path) -> None:
    """keep_last = 2, max_staleness = 1: a segment closed at the checkpoint with version V
    goes once V + 1 < the version of the older of the last two checkpoints. After step 4
    (kept: steps 3 and 4, v3) that is what closed by step 1's checkpoint (segment 0; 1 was
    still open); after step 5 (kept: v4) also what closed by step 2's (segments 1 and 2).
    A checkpoint request asked again counts once."""
    budget = LogBudget(max_bytes=1, keep_last=2, max_staleness=1)
    writer = RolloutLogWriter(tmp_path, segment_bytes=ONE_GROUP_PER_SEGMENT, budget=budget)
    left = checkpoints_between_groups(writer, PLAN[:4])
    writer.checkpointed(4, 4)  # the learner's retry
    assert segment_indices(tmp_path) == left[4]
    left.update(checkpoints_between_groups(writer, PLAN[4:]))
    writer.close()
    assert left == {1: [0, 1], 2: [0, 1, 2, 3], 3: [0, 1, 2, 3, 4], 4: [1, 2, 3, 4, 5],
                    5: [3, 4, 5, 6]}
    # the groups of segments 3 to 5 (p3 to p5 of the first call), and p0 of the second
    assert [g.prompt_id for g in read_rollout_log(tmp_path)] == ["p3", "p4", "p5", "p0"]


def test_deleting_stops_once_the_log_is_within_its_budget(tmp_path: Path) -> None:
    writer = RolloutLogWriter(tmp_path, segment_bytes=ONE_GROUP_PER_SEGMENT)
    checkpoints_between_groups(writer, PLAN)  # no budget: nothing deleted
    sizes = {i: (tmp_path / f"segment-{i:06d}.rlog").stat().st_size for i in range(7)}
    writer.budget = LogBudget(max_bytes=sum(sizes.values()) - sizes[0], keep_last=2,
                              max_staleness=1)
    writer.checkpointed(5, 5)
    writer.close()
    assert segment_indices(tmp_path) == [1, 2, 3, 4, 5, 6]  # 1 and 2 may go, not needed


def test_an_earlier_buffers_segments_go_once_every_kept_checkpoint_is_this_ones(
        tmp_path: Path) -> None:
    """A resumed run's buffer serves none of the earlier process's groups; their segments
    go once the last keep_last checkpoints are its own, and a new segment never takes the
    name of a deleted one."""
    earlier = RolloutLogWriter(tmp_path, segment_bytes=ONE_GROUP_PER_SEGMENT)
    for g in groups(3):
        earlier.append(g)
    earlier.close()
    budget = LogBudget(max_bytes=1, keep_last=2, max_staleness=1)
    resumed = RolloutLogWriter(tmp_path, segment_bytes=ONE_GROUP_PER_SEGMENT, budget=budget)
    left = checkpoints_between_groups(resumed, [(1, 20, 10), (1, 21, 10)])
    resumed.close()
    assert left == {20: [0, 1, 2, 3], 21: [3, 4]}
    again = RolloutLogWriter(tmp_path, segment_bytes=ONE_GROUP_PER_SEGMENT)
    again.append(groups(1)[0])
    again.close()
    assert segment_indices(tmp_path) == [3, 4, 5]


def test_over_budget_with_every_segment_needed_warns_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    budget = LogBudget(max_bytes=1, keep_last=2, max_staleness=1)
    writer = RolloutLogWriter(tmp_path, segment_bytes=ONE_GROUP_PER_SEGMENT, budget=budget)
    with caplog.at_level(logging.WARNING, logger="relay.buffer.rollout_log"):
        left = checkpoints_between_groups(writer, PLAN[:3])
    writer.close()
    assert left[3] == [0, 1, 2, 3, 4]
    warnings = [r.getMessage() for r in caplog.records if "over its" in r.getMessage()]
    assert len(warnings) == 1 and "buffer.rollout_log_max_gb" in warnings[0]


def test_no_step_records_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "segment-000000.rlog").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="steps.rlog"):
        read_steps(tmp_path)
