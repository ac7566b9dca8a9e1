"""tools/bench-e2e.py: TRL's JSON events and Relay's series become the same numbers."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

TOOL = runpy.run_path(str(Path(__file__).resolve().parents[2] / "tools" / "bench-e2e.py"))


def test_trl_events_become_per_step_series_and_a_summary() -> None:
    events = [{"event": "eval", "step": 0, "train_seconds": 0.0, "accuracy": 0.1}]
    for step in range(1, 9):
        events.append({"event": "step", "step": step, "train_seconds": 2.0 * step,
                       "generated_tokens": 100 * step, "trained_tokens": 300 * step,
                       "generation_seconds": 0.5 * step, "reward_mean": 0.5})
        if step % 4 == 0:
            events.append({"event": "eval", "step": step, "train_seconds": 2.0 * step,
                           "accuracy": 0.1 * step})
    series = TOOL["trl_series"](events)
    assert series.step_seconds == [2.0] * 8 and series.completion_tokens == [100.0] * 8
    assert series.learner_tokens_per_s == [pytest.approx(200.0)] * 8  # 300 in 2 - 0.5 s
    summary = TOOL["summarize"](series, 0.5)
    assert summary.seconds_per_step == 2.0  # the median after the 5 warm-up steps
    assert summary.tokens_per_s == pytest.approx(50.0)
    assert (summary.accuracy_start, summary.accuracy_end) == (0.1, pytest.approx(0.8))
    assert summary.seconds_to_target == 16.0  # first evaluation >= 50%: step 8
    assert TOOL["summarize"](series, 0.9).seconds_to_target is None


def test_accuracy_at_a_training_time_is_the_last_measured_by_then() -> None:
    evals = [(0, 0.0, 0.1), (10, 5.0, 0.3), (20, 11.0, 0.4)]
    assert TOOL["accuracy_at"](evals, 10.9) == 0.3
    assert TOOL["accuracy_at"](evals, 11.0) == 0.4
    assert TOOL["accuracy_at"](evals, -1.0) is None


def test_throughput_rows_compare_medians_after_the_first_step() -> None:
    series = TOOL["Series"]
    trl = series(system="TRL", step_seconds=[9.0, 4.0, 60.0, 4.0],  # step 3 compiles
                 completion_tokens=[100.0] * 4, evals=[],
                 learner_tokens_per_s=[1.0, 1000.0, 1000.0, 1000.0])
    relay = series(system="Relay", step_seconds=[9.0, 2.0, 2.0, 2.0],
                   completion_tokens=[100.0] * 4, evals=[],
                   learner_tokens_per_s=[1.0, 1500.0, 1500.0, 1500.0])
    rows = {label.split(" (")[0]: (theirs, ours, ratio)
            for label, theirs, ours, ratio, _ in TOOL["throughput_rows"](trl, relay)}
    assert rows["seconds per step"] == (4.0, 2.0, 2.0)
    assert rows["generated tokens/s"] == (25.0, 50.0, 2.0)
    assert rows["learner tokens/s"] == (1000.0, 1500.0, 1.5)


def test_trl_runs_without_the_wait_policy_relays_processes_get(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """tools/with-venv sets OMP_WAIT_POLICY=PASSIVE for Relay; TRL's process runs as its
    users run it (unset), unless --trl-omp-wait-policy names a value."""
    seen: list[dict[str, str]] = []

    class FakePopen:
        def __init__(self, command, *, env, **_kwargs) -> None:
            seen.append(env)
            self.stdout, self.returncode = iter(['{"event": "done"}\n']), 0

        def __enter__(self):
            return self

        def __exit__(self, *_exc) -> None:
            pass

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setitem(TOOL["run_trl"].__globals__, "subprocess",
                        type("FakeSubprocess", (), {"Popen": FakePopen, "PIPE": -1}))
    for policy in ("", "ACTIVE"):
        args = TOOL["parse_args"](["--only", "trl", "--trl-omp-wait-policy", policy])
        TOOL["run_trl"](args)
    assert "OMP_WAIT_POLICY" not in seen[0] and "PATH" in seen[0]
    assert seen[1]["OMP_WAIT_POLICY"] == "ACTIVE"
