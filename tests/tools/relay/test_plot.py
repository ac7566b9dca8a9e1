"""``relay plot``: real MLflow stores written by the learner's ``Tracker``, read back and
drawn, one line per run; the PNGs opened and measured; a run directory that cannot be
plotted is exit code 2 naming it."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import pytest

from relay.learner.tracking import Tracker
from relay.plot import (
    CURVES,
    FIGURE_SIZE,
    PNG_DPI,
    build_figures,
    main,
    read_run,
    trailing_mean,
)

STEPS = 12


def make_run(run_dir: Path, *, uri: str = "", slope: float = 0.01,
             metrics: bool = True) -> Path:
    """A run directory with the resolved config's tracking section and a store that the
    learner's Tracker filled: every plotted metric each step, evaluations every 4 steps."""
    run_dir.mkdir(parents=True)
    (run_dir / "run.toml").write_text(f'[tracking]\nuri = "{uri}"\nexperiment = "plots"\n')
    tracker = Tracker(uri=uri, experiment="plots", run_name="", run_dir=run_dir)
    for step in range(1, STEPS + 1) if metrics else ():
        tracker.log_metrics({"rollout/reward_mean": slope * step, "staleness/mean": 0.5,
                             "perf/learner_tokens_per_s": 1000.0 + step,
                             "perf/generator_tokens_per_s": 500.0}, step)
        if step % 4 == 0:
            tracker.log_metrics({"eval/accuracy": slope * step}, step)
    tracker.close(ok=True)
    return run_dir


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> tuple[Path, Path]:
    """Two run directories, each with its own store (a store takes seconds to create)."""
    root = tmp_path_factory.mktemp("runs")
    return make_run(root / "run-a", slope=0.01), make_run(root / "run-b", slope=0.02)


def test_two_runs_are_drawn_on_the_same_figures_one_line_each(two_runs, tmp_path: Path,
                                                               capsys) -> None:
    a, b = two_runs
    out = tmp_path / "plots"
    assert main([str(a), str(b), "--out", str(out)]) == 0
    written = capsys.readouterr().out.split()
    assert written == [str(out / curve.file) for curve in CURVES]
    for path in written:
        height, width, _ = matplotlib.image.imread(path).shape
        panels = 2 if path.endswith("throughput.png") else 1
        assert (width, height) == (FIGURE_SIZE[0] * PNG_DPI, FIGURE_SIZE[1] * PNG_DPI * panels)

    figures = build_figures([read_run(a), read_run(b)], smooth=1)
    reward = figures["reward.png"].axes[0]
    assert (reward.get_xlabel(), reward.get_ylabel()) == ("learner step", "reward")
    assert [line.get_label() for line in reward.get_lines()] == ["run-a", "run-b"]
    assert list(reward.get_lines()[1].get_ydata()) == pytest.approx(
        [0.02 * s for s in range(1, STEPS + 1)])
    by_time = figures["accuracy-time.png"].axes[0]
    assert by_time.get_xlabel() == "wall-clock (minutes)"
    assert len(by_time.get_lines()) == 2 and len(by_time.get_lines()[0].get_xdata()) == 3
    assert list(figures["accuracy-steps.png"].axes[0].get_lines()[0].get_xdata()) == [4, 8, 12]
    throughput = figures["throughput.png"].axes
    assert [ax.get_ylabel() for ax in throughput] == ["learner tokens/s", "generator tokens/s"]
    assert all(len(ax.get_lines()) == 2 for ax in throughput)


def test_runs_in_one_shared_store_are_told_apart_by_their_run_directory(
        tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'shared.db'}"
    a = make_run(tmp_path / "a", uri=uri, slope=0.01)
    make_run(tmp_path / "b", uri=uri, slope=0.03)
    series = read_run(a).metrics["rollout/reward_mean"]
    assert series.steps == list(range(1, STEPS + 1))
    assert series.values == pytest.approx([0.01 * s for s in series.steps])


def test_the_default_out_dir_is_the_first_runs_plots_folder(two_runs) -> None:
    a = two_runs[0]
    assert main([str(a)]) == 0
    assert sorted(p.name for p in (a / "plots").iterdir()) == sorted(c.file for c in CURVES)


def test_a_run_directory_without_a_store_is_exit_2_naming_it(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "never-ran"
    run_dir.mkdir()
    (run_dir / "run.toml").write_text("[tracking]\nexperiment = 'plots'\n")
    assert main([str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert str(run_dir) in err and "no MLflow store (mlflow.db)" in err
    assert not (run_dir / "mlflow.db").exists()  # reading made no empty store
    assert main([str(tmp_path)]) == 2
    assert "not a run directory (no run.toml" in capsys.readouterr().err


def test_a_run_that_logged_no_metric_is_exit_2_naming_it(tmp_path: Path, capsys) -> None:
    run_dir = make_run(tmp_path / "empty", metrics=False)
    assert main([str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert str(run_dir) in err and "has none of the metrics plotted" in err


def test_a_figure_no_run_has_data_for_is_left_out(two_runs) -> None:
    run = read_run(two_runs[0])
    no_eval = type(run)(label=run.label, metrics={
        name: series for name, series in run.metrics.items() if name != "eval/accuracy"})
    assert "accuracy-steps.png" not in build_figures([no_eval], smooth=1)
    assert "reward.png" in build_figures([no_eval], smooth=1)


def test_the_trailing_mean_averages_the_last_n_values() -> None:
    assert trailing_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert trailing_mean([1.0, 3.0], 1) == [1.0, 3.0]
