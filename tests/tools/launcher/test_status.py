"""relay.launcher.status: the status line survives any Metrics message a peer can send (NaN,
infinities, absurd magnitudes), whether it comes in process or over the wire, and takes a
learner's or buffer's metrics only from a key that may act as them."""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import pytest

from relay.launcher.status import StatusBoard, count, number
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
    assert notes == ["launch-cluster: the buffer could not write its rollout log (1 failed "
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
        "launch-cluster: WARNING: the reward function failed on 75% of step 2's samples "
        "(rollout/reward_error_frac), which all score 0: the generators' logs name the most "
        "common error (\"REWARD FUNCTION FAILING\"); check custom_reward_function",
        "launch-cluster: WARNING: the reward function failed on 62% of step 6's samples "
        "(rollout/reward_error_frac), which all score 0: the generators' logs name the most "
        "common error (\"REWARD FUNCTION FAILING\"); check custom_reward_function"]
