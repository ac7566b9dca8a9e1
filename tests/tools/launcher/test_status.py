"""relay.launcher.status: the status line survives any Metrics message a peer can send (NaN,
infinities, absurd magnitudes), whether it comes in process or over the wire, and takes a
learner's or buffer's metrics only from a key that may act as them; it shows the pace
(seconds per step, ETA) and smoothed rates, names the start-up phase, and without a tty
prints one plain line every few seconds."""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import pytest

from relay.launcher.status import (LOG_EVERY_S, SMOOTHING, Ema, StatusBoard, count,
                                   number)
from relay.launcher.watchdog import ProgressWatchdog
from relay.transport.endpoints import ipc_endpoint
from relay.transport.messages import Metrics
from relay.transport.security import ClientKeys, ServerKeys, load_keypair, load_public_key
from relay.transport.sockets import Puller, Pusher

MAKE_KEYS = Path(__file__).resolve().parents[3] / "tools" / "make-curve-keys.py"

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
    assert "v0" in line and "reward ?" in line and "acc ?" in line
    assert "gen ? tok/s" in line or "gen " not in line  # the smoothed rate skips NaN and inf
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
    for part in ("step 3/10 30%", "v2", "reward 0.500", "acc 25.0%", "learn 1.2k tok/s",
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
    assert board.step == 4 and "step 4/10 40%" in board.line() and "| v4 |" in board.line()
    board.update(Metrics(source="learner", step=10, values={"version": 10.0}))
    assert board.step == 10


def test_only_the_control_key_moves_the_learner_step_and_the_buffer_gauges(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Under CURVE a generator or evaluator key that claims to be the learner at the last
    step (which would blind the watchdog) or the buffer is ignored; the control key, which
    the learner and the buffer push with, is heard."""
    keys = tmp_path / "keys"
    assert runpy.run_path(str(MAKE_KEYS))["main"]([str(keys)]) == 0
    control = keys / "control"
    puller = Puller(ipc_endpoint(tmp_path / "metrics"), bind=True, keys=ServerKeys(
        load_keypair(control / "server.key_secret"), control / "authorized"))
    board = StatusBoard(total_steps=10, interactive=False)
    watchdog = ProgressWatchdog(60.0, batch_groups=4, started=0.0)
    sent = [("generator", Metrics(source="learner", step=10, values={"version": 9.0})),
            ("evaluator", Metrics(source="buffer", step=0, values={"buffer/generators": 5.0})),
            ("control", Metrics(source="learner", step=3, values={"version": 3.0})),
            ("generator", Metrics(source="learner", step=10, values={}))]
    pushers = {host: Pusher(puller.endpoint, keys=ClientKeys(
        load_keypair(keys / host / "client.key_secret"), load_public_key(keys / host /
                                                                          "server.key")))
               for host in ("generator", "evaluator", "control")}
    try:
        for host, message in sent:
            pushers[host].send(message)
            received = puller.receive_from(5.0)
            assert received is not None and isinstance(received.message, Metrics)
            board.update(received.message, key=received.key)
    finally:
        for pusher in pushers.values():
            pusher.close(linger_s=0.0)
        puller.close()
    assert board.step == 3 and "v3" in board.line() and board.generators_attached() == 0
    assert board.refused == 3
    notes = [line for line in capsys.readouterr().out.splitlines() if "ignored metrics" in line]
    assert len(notes) == 2, notes  # once per key and source
    assert "'generator' may act as generator, not as the learner" in notes[0]
    assert watchdog.stuck(board, now=1.0) is None
    assert watchdog.stuck(board, now=62.0) is not None  # no real step since: it fires


def test_a_source_that_is_no_role_is_ignored_without_curve_too() -> None:
    board = StatusBoard(total_steps=10, interactive=False)
    board.update(Metrics(source="learner ", step=5, values={"version": 5.0}))
    board.update(Metrics(source="buffer", step=0, values={"buffer/occupancy": 4.0}))
    assert board.step == 0 and board.refused == 1 and "buffered 4" in board.line()


def test_the_first_rollout_log_write_error_is_noted_once(capsys: pytest.CaptureFixture) -> None:
    """A full disk shows on the status line at the buffer's first failed write, once."""
    board = StatusBoard(total_steps=10, interactive=False)
    for errors in (0.0, 1.0, 5.0):
        board.update(Metrics(source="buffer", step=0,
                             values={"buffer/rollout_log/write_errors": errors}))
    notes = [line for line in capsys.readouterr().out.splitlines()
             if "could not write its rollout log" in line]
    assert notes == ["relay launch: the buffer could not write its rollout log (1 failed "
                     "writes so far; the first is in logs/buffer.log): is the run directory's "
                     "disk full? Training goes on, but the learner's next checkpoint may fail "
                     "and a replay will lack these groups (buffer.rollout_log_max_gb caps the "
                     "log)"]


def test_a_batch_whose_rewards_mostly_failed_is_a_loud_warning(
        capsys: pytest.CaptureFixture) -> None:
    """Issue 30, item 21: more than half of a batch's samples with a failed reward function
    is noted on a line of its own when it starts (and again after it recovers) and shown on
    the status line while it lasts; half or fewer, or a hostile value, shows nothing."""
    board = StatusBoard(total_steps=10, interactive=False)
    for step, share in enumerate((0.5, 0.75, 1.0, 0.0, math.nan, 0.625), start=1):
        board.update(Metrics(source="learner", step=step,
                             values={"rollout/reward_error_frac": share}))
        assert ("REWARD FN FAILING" in board.line()) == (share in (0.75, 1.0, 0.625))
    assert "| REWARD FN FAILING 62% |" in board.line()
    notes = [line for line in capsys.readouterr().out.splitlines() if "WARNING" in line]
    assert notes == [
        "relay launch: WARNING: the reward function failed on 75% of step 2's samples "
        "(rollout/reward_error_frac), which all score 0: the generators' logs name the most "
        "common error (\"REWARD FUNCTION FAILING\"); check custom_reward_function",
        "relay launch: WARNING: the reward function failed on 62% of step 6's samples "
        "(rollout/reward_error_frac), which all score 0: the generators' logs name the most "
        "common error (\"REWARD FUNCTION FAILING\"); check custom_reward_function"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_ema_weighs_each_sample_by_alpha() -> None:
    ema = Ema(alpha=0.25)
    assert ema.value is None
    for sample in (8.0, math.nan, 16.0, math.inf):
        ema.add(sample)
    assert ema.value == 0.25 * 16.0 + 0.75 * 8.0  # the first sample starts it; NaN/inf skipped
    with pytest.raises(ValueError, match="alpha"):
        Ema(alpha=0.0)


def test_a_rate_that_jumps_line_to_line_is_shown_smoothed() -> None:
    """``learn tok/s`` alternated 7.6k and 33k line to line; smoothed, it moves by a fifth of
    a jump at most and settles between the two."""
    board = StatusBoard(total_steps=100, interactive=False)
    shown = []
    for step, rate in enumerate([7600.0, 33000.0] * 10, start=1):
        board.update(Metrics(source="learner", step=step,
                             values={"perf/learner_tokens_per_s": rate}))
        shown.append(board.smoothed["perf/learner_tokens_per_s"].value)
    jumps = [abs(b - a) for a, b in zip(shown, shown[1:])]
    assert max(jumps) <= SMOOTHING * (33000 - 7600) + 1e-6
    assert 15000 < shown[-1] < 26000 and "learn 2" in board.line()


def test_seconds_per_step_and_eta_come_from_the_steps_the_launcher_sees() -> None:
    clock = Clock()
    board = StatusBoard(total_steps=100, interactive=False, now=clock)
    clock.now += 40  # start-up: not counted in the pace
    board.update(Metrics(source="learner", step=1, values={}))
    assert "step 1/100 1% | ? s/step | ETA ? | 00:40" in board.line()
    for step in range(2, 11):
        clock.now += 0.5
        board.update(Metrics(source="learner", step=step, values={}))
    assert "step 10/100 10% | 0.50 s/step | ETA 00:45 | 00:44" in board.line()
    clock.now += 2.0  # a burst: two steps in one
    board.update(Metrics(source="learner", step=12, values={}))
    assert board.step_seconds.value == pytest.approx(0.2 * 1.0 + 0.8 * 0.5)


def test_the_start_up_phase_is_named_until_the_first_step() -> None:
    clock = Clock()
    board = StatusBoard(total_steps=10, interactive=False, generators=2, now=clock)
    assert board.line() == ("starting 00:00 | learner starting (loading its model, opening "
                            "its MLflow store) | generators 0/2 | buffered 0")
    clock.now += 12
    board.update(Metrics(source="learner", step=0, values={},
                         phase="waiting for the first batch from the generators"))
    board.update(Metrics(source="buffer", step=0, values={"buffer/generators": 1.0}))
    assert board.line() == ("starting 00:12 | waiting for the first batch from the generators"
                            " | generators 1/2 | buffered 0")
    # the held-out report of step 0 comes late: the learner is still waiting
    board.update(Metrics(source="learner", step=0, values={"eval/accuracy": 0.25}))
    assert "waiting for the first batch" in board.line() and "acc 25.0%" in board.line()
    board.update(Metrics(source="learner", step=1, values={"version": 1.0}))
    assert "waiting" not in board.line() and board.line().startswith("step 1/10 10%")
    board.update(Metrics(source="learner", step=10, values={}))
    board.update(Metrics(source="learner", step=10, values={},
                         phase="waiting for the held-out evaluation of step 10"))
    assert board.line().endswith("| waiting for the held-out evaluation of step 10")


def test_without_a_tty_one_plain_line_every_few_seconds(
        capsys: pytest.CaptureFixture) -> None:
    clock = Clock()
    board = StatusBoard(total_steps=100, interactive=False, now=clock)
    for tick in range(200):  # the launcher renders every 0.25 s or so: 50 s here
        board.update(Metrics(source="learner", step=tick // 4, values={"version": 1.0}))
        board.render()
        clock.now += 0.25
    board.finish()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 50 / LOG_EVERY_S + 1  # and the last state at the end
    assert all("\x1b" not in line and "\r" not in line for line in lines)
    assert lines[0].startswith("starting 00:00 |")
    assert lines[-1].startswith("step 49/100 49% | 1.00 s/step | ETA 00:51 | 00:50 | v1 |")


def test_a_tty_gets_the_rich_display_with_notes_above_it(
        capsys: pytest.CaptureFixture) -> None:
    board = StatusBoard(total_steps=10, interactive=True)
    board.update(Metrics(source="learner", step=3, values={"version": 3.0}))
    board.render()
    board.note("generator gen1 died")
    board.finish()
    out = capsys.readouterr().out
    assert "relay launch: generator gen1 died" in out and "step 3/10 30%" in out
    assert "━" in out  # the progress bar
