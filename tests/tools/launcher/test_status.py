"""launcher.status: the status line survives any Metrics message a peer can send (NaN,
infinities, absurd magnitudes), whether it comes in process or over the wire."""

from __future__ import annotations

import math

import pytest

from launcher.status import StatusBoard, count, number
from transport.messages import Metrics
from transport.sockets import Puller, Pusher

LEARNER_KEYS = ("version", "rollout/reward_mean", "eval/accuracy", "staleness/mean",
                "perf/generator_tokens_per_s", "perf/learner_tokens_per_s")
BUFFER_KEYS = ("buffer/generators", "buffer/occupancy")
HOSTILE = [math.nan, math.inf, -math.inf, 1e308, -1e308]


def fill(board: StatusBoard, value: float) -> None:
    board.update(Metrics(source="learner", step=3, values={k: value for k in LEARNER_KEYS}))
    board.update(Metrics(source="buffer", step=0, values={k: value for k in BUFFER_KEYS}))


@pytest.mark.parametrize("value", HOSTILE)
def test_a_hostile_value_reads_as_unknown(value: float, capsys: pytest.CaptureFixture) -> None:
    board = StatusBoard(total_steps=10, interactive=False)
    fill(board, value)
    line = board.line()
    assert "v0" in line and "reward ?" in line and "acc ?" in line and "gen ? tok/s" in line
    assert "generators 0" in line and "buffered 0" in line
    assert board.generators_attached() == 0
    board.render()
    board.finish()
    assert "reward ?" in capsys.readouterr().out


def test_sound_values_show_as_before() -> None:
    board = StatusBoard(total_steps=10, interactive=False)
    board.update(Metrics(source="learner", step=3, values={
        "version": 2.0, "rollout/reward_mean": 0.5, "eval/accuracy": 0.25,
        "perf/learner_tokens_per_s": 1234.4}))
    board.update(Metrics(source="buffer", step=0, values={
        "buffer/generators": 2.0, "buffer/occupancy": 7.0}))
    line = board.line()
    for part in ("step 3/10", "v2", "reward 0.500", "acc 25.0%", "learn 1234 tok/s",
                 "generators 2", "buffered 7"):
        assert part in line, line


def test_count_and_number() -> None:
    assert [count(v) for v in (3.9, -2.0, math.nan, math.inf, 1e300)] == [3, -2, 0, 0, 0]
    assert [number(v, ".1f") for v in (0.25, math.nan, -math.inf)] == ["0.2", "?", "?"]


def test_nan_over_the_wire_does_not_crash_the_board() -> None:
    puller = Puller("tcp://127.0.0.1:*")
    pusher = Pusher(puller.endpoint)
    board = StatusBoard(total_steps=10, interactive=False)
    try:
        assert pusher.send(Metrics(source="buffer", step=0, values={
            "buffer/generators": math.nan, "buffer/occupancy": math.inf}))
        message = puller.receive(5.0)
        assert isinstance(message, Metrics) and math.isnan(message.values["buffer/generators"])
        board.update(message)
        assert board.generators_attached() == 0 and "buffered 0" in board.line()
    finally:
        pusher.close()
        puller.close()


@pytest.mark.parametrize("step", [-1, 11, 10**12])
def test_a_step_outside_the_run_is_ignored_values_and_all(step: int) -> None:
    board = StatusBoard(total_steps=10, interactive=False)
    board.update(Metrics(source="learner", step=4, values={"version": 4.0}))
    board.update(Metrics(source="learner", step=step, values={"version": 99.0}))
    assert board.step == 4 and "step 4/10 | v4" in board.line()
    board.update(Metrics(source="learner", step=10, values={"version": 10.0}))
    assert board.step == 10
