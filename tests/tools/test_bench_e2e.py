"""tools/bench-e2e.py: TRL's JSON events and Relay's series become the same numbers."""

from __future__ import annotations

import json
import runpy
import sys
import types
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


def summary(system: str, seconds_per_step: float, to_target: float | None):
    return TOOL["Summary"](system=system, steps=400, seconds_per_step=seconds_per_step,
                           tokens_per_s=1.0, generator_tokens_per_s=None, accuracy_start=0.2,
                           accuracy_end=0.6, accuracy_peak=0.6, seconds_to_target=to_target)


def test_ratios_are_relays_advantage_and_none_where_a_system_missed_the_target() -> None:
    ratios = TOOL["comparison_ratios"](summary("Relay", 0.1, 30.0), summary("TRL", 0.4, 90.0))
    assert ratios == {"speed-up a step": pytest.approx(4.0),
                      "time to target": pytest.approx(3.0)}
    missed = TOOL["comparison_ratios"](summary("Relay", 0.1, None), summary("TRL", 0.4, 90.0))
    assert missed["time to target"] is None


def test_repeated_pairs_print_every_ratio_and_the_median_of_those_measured(
        capsys: pytest.CaptureFixture[str]) -> None:
    TOOL["print_repeats"]([{"speed-up a step": 3.5, "time to target": 2.0},
                           {"speed-up a step": 3.6, "time to target": None},
                           {"speed-up a step": 3.4, "time to target": 3.0}])
    out = capsys.readouterr().out
    assert "over 3 pairs" in out
    assert "speed-up a step  median 3.50x  (3.50x, 3.60x, 3.40x)" in out
    assert "time to target   median 2.50x  (2.00x, -, 3.00x)" in out


def test_repeats_run_trl_then_relay_per_pair_and_keep_every_pairs_series(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    order: list[str] = []
    series = TOOL["Series"]

    def fake(system: str, seconds: float):
        def run(_args, *_extra):
            order.append(system)
            return series(system=system, step_seconds=[seconds] * 8,
                          completion_tokens=[10.0] * 8, evals=[(0, 0.0, 0.2), (8, 8.0, 0.6)])
        return run

    main = TOOL["main"]
    monkeypatch.setitem(main.__globals__, "run_trl", fake("TRL", 0.4))
    monkeypatch.setitem(main.__globals__, "run_relay", fake("Relay", 0.1))
    out = tmp_path / "bench.json"
    main(["--repeats", "2", "--out", str(out)])
    assert order == ["TRL", "Relay", "TRL", "Relay"]
    saved = json.loads(out.read_text())
    assert [[s["system"] for s in pair["series"]] for pair in saved["pairs"]] == \
        [["TRL", "Relay"], ["TRL", "Relay"]]
    assert "speed-up a step  median 4.00x  (4.00x, 4.00x)" in capsys.readouterr().out


def test_repeats_need_both_systems() -> None:
    with pytest.raises(SystemExit):
        TOOL["parse_args"](["--repeats", "2", "--only", "relay"])
    with pytest.raises(SystemExit):
        TOOL["parse_args"](["--repeats", "0"])


def test_throughput_repeats_print_each_pairs_ratios_and_their_medians(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    series = TOOL["Series"]
    relay_seconds = iter([2.0, 1.0, 4.0])  # TRL takes 4 s a step: 2x, 4x, 1x

    def pair(_args, _model):
        seconds = next(relay_seconds)
        return (series(system="TRL", step_seconds=[4.0] * 4, completion_tokens=[100.0] * 4,
                       evals=[], learner_tokens_per_s=[1000.0] * 4),
                series(system="Relay", step_seconds=[seconds] * 4,
                       completion_tokens=[100.0] * 4, evals=[],
                       learner_tokens_per_s=[1000.0] * 4))

    throughput = TOOL["throughput"]
    monkeypatch.setitem(throughput.__globals__, "throughput_pair", pair)
    monkeypatch.setitem(sys.modules, "bench_model", types.SimpleNamespace(
        ensure_bench_model=lambda: tmp_path / "bench-qwen2-24m"))
    out = tmp_path / "bench.json"
    throughput(TOOL["parse_args"](["--throughput", "--repeats", "3", "--out", str(out)]))
    printed = capsys.readouterr().out
    assert "pair 3 of 3" in printed
    assert "seconds per step    median 2.00x  (2.00x, 4.00x, 1.00x)" in printed
    assert "learner tokens/s    median 1.00x  (1.00x, 1.00x, 1.00x)" in printed
    saved = json.loads(out.read_text())
    assert [[s["system"] for s in pair["series"]] for pair in saved["pairs"]] == \
        [["TRL", "Relay"]] * 3
