"""Draw the curves of one or more runs as PNG files, from their MLflow stores.

    relay plot RUN_DIR [RUN_DIR ...] [--out DIR] [--smooth N]

Each run is read from the store its resolved config (``RUN_DIR/run.toml``) names:
``tracking.uri``, or by default the run's own ``RUN_DIR/mlflow.db``
(``relay.learner.tracking.default_uri``). In a store shared by many runs a run directory's
MLflow runs are those tagged with its absolute path (``relay.learner.tracking.RUN_DIR_TAG``);
a resumed run that started a new MLflow run is one history, the later value winning at a
step. Figures, one line per run, the legend naming each run directory:

    reward.png          mean training reward of each step's batch   against learner step
    accuracy-steps.png  held-out accuracy                           against learner step
    accuracy-time.png   held-out accuracy                           against wall-clock minutes
    staleness.png       mean staleness of each step's samples       against learner step
    throughput.png      learner and generator tokens/s (two panels) against learner step

The per-step series (reward, staleness, throughput) are drawn as the trailing mean over
``--smooth`` steps (default 10; 1 draws the raw values): y_s = mean(x_{s-N+1}, ..., x_s).
Wall-clock time is the metric's timestamp minus the start of the run directory's first
MLflow run. A figure whose metric no run logged is left out (and said so). The PNGs go to
``--out``, by default the first run directory's ``plots/``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: never a window, nor a display needed

import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
import msgspec  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from relay.configs import ConfigError  # noqa: E402
from relay.configs.loader import read_toml  # noqa: E402
from relay.configs.rundir import RESOLVED_RUN  # noqa: E402

PNG_DPI = 100
FIGURE_SIZE = (8.0, 4.5)  # inches: 800 x 450 pixels at PNG_DPI


class PlotError(ValueError):
    """A run directory that cannot be plotted (the message names it and says why)."""


class Series(msgspec.Struct, frozen=True):
    """One metric of one run: values by learner step, and seconds since the run began."""

    steps: list[int]
    values: list[float]
    seconds: list[float]


class Curve(msgspec.Struct, frozen=True):
    """What one figure draws: its file, title, axis labels, and the metric per panel (the
    first of each tuple that a run logged: Relay's name, then verl's)."""

    file: str
    title: str
    panels: tuple[tuple[str, ...], ...]
    ylabels: tuple[str, ...]
    against_time: bool = False
    smoothed: bool = True


CURVES = (
    Curve(file="reward.png", title="training reward, mean of each step's batch",
          panels=(("rollout/reward_mean", "critic/score/mean"),), ylabels=("reward",)),
    Curve(file="accuracy-steps.png", title="held-out accuracy",
          panels=(("eval/accuracy",),), ylabels=("accuracy",), smoothed=False),
    Curve(file="accuracy-time.png", title="held-out accuracy against wall-clock time",
          panels=(("eval/accuracy",),), ylabels=("accuracy",), against_time=True,
          smoothed=False),
    Curve(file="staleness.png", title="staleness: learner version - sample version, batch mean",
          panels=(("staleness/mean",),), ylabels=("mean staleness (versions)",)),
    Curve(file="throughput.png", title="throughput",
          panels=(("perf/learner_tokens_per_s",), ("perf/generator_tokens_per_s",)),
          ylabels=("learner tokens/s", "generator tokens/s")),
)
NEEDED = sorted({name for curve in CURVES for panel in curve.panels for name in panel})


class RunCurves(msgspec.Struct, frozen=True):
    """A run directory's label (its name) and its metrics by name."""

    label: str
    metrics: dict[str, Series]


def store_of(run_dir: Path) -> tuple[str, str, bool]:
    """(tracking URI, experiment, whether the store is the run's own) from ``run.toml``."""
    config = run_dir / RESOLVED_RUN
    if not config.is_file():
        raise PlotError(f"{run_dir}: not a run directory (no {RESOLVED_RUN}; `relay launch` "
                        "writes one into every run directory)")
    try:
        tracking = read_toml(config).get("tracking", {})
    except ConfigError as exc:
        raise PlotError(f"{run_dir}: {exc}") from None
    uri = tracking.get("uri", "")
    experiment = tracking.get("experiment", "relay")
    if uri:
        return uri, experiment, False
    if not (run_dir / "mlflow.db").is_file():
        raise PlotError(f"{run_dir}: no MLflow store (mlflow.db): the run logged nothing yet, "
                        "or its store was removed")
    from relay.learner.tracking import default_uri

    return default_uri(run_dir), experiment, True


def read_run(run_dir: Path) -> RunCurves:
    """The plotted metrics of ``run_dir`` (module docstring); ``PlotError`` when its store
    holds no MLflow run of it, or none of the metrics."""
    from mlflow.tracking import MlflowClient  # slow to import: only once a run dir is found

    from relay.learner.tracking import RUN_DIR_TAG

    run_dir = run_dir.resolve()
    uri, experiment_name, own = store_of(run_dir)
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(experiment_name)
    query = "" if own else f"tags.`{RUN_DIR_TAG}` = '{run_dir}'"
    runs = [] if experiment is None else client.search_runs(
        [experiment.experiment_id], query, order_by=["attributes.start_time ASC"])
    if not runs:
        raise PlotError(f"{run_dir}: {uri} holds no MLflow run of it (experiment "
                        f"{experiment_name!r}" + ("" if own else f", tag {RUN_DIR_TAG}") + ")")
    began_ms = runs[0].info.start_time
    metrics: dict[str, Series] = {}
    for name in NEEDED:
        by_step: dict[int, tuple[float, int]] = {}
        for run in runs:
            history = sorted(client.get_metric_history(run.info.run_id, name),
                             key=lambda m: m.timestamp)
            by_step.update({m.step: (m.value, m.timestamp) for m in history})
        if by_step:
            steps = sorted(by_step)
            metrics[name] = Series(steps=steps, values=[by_step[s][0] for s in steps],
                                   seconds=[(by_step[s][1] - began_ms) / 1000 for s in steps])
    if not metrics:
        raise PlotError(f"{run_dir}: its MLflow run in {uri} has none of the metrics plotted "
                        f"({', '.join(NEEDED)}): did it make a step?")
    return RunCurves(label=run_dir.name, metrics=metrics)


def trailing_mean(values: Sequence[float], window: int) -> list[float]:
    """y_s = mean of the last ``window`` values up to s (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def build_figure(curve: Curve, runs: Sequence[RunCurves], smooth: int) -> Figure | None:
    """``curve`` for ``runs``, one line per run that logged its metric; None when none did."""
    found = [[(run, next((run.metrics[n] for n in names if n in run.metrics), None))
              for run in runs] for names in curve.panels]
    if not any(series for panel in found for _, series in panel):
        return None
    figure, axes = plt.subplots(len(curve.panels), 1, squeeze=False, sharex=True,
                                figsize=(FIGURE_SIZE[0], FIGURE_SIZE[1] * len(curve.panels)))
    window = smooth if curve.smoothed else 1
    for ax, panel, ylabel in zip(axes[:, 0], found, curve.ylabels):
        for run, series in panel:
            if series is None:
                continue
            x = [s / 60 for s in series.seconds] if curve.against_time else series.steps
            y = trailing_mean(series.values, window)
            ax.plot(x, y, label=run.label, marker="" if curve.smoothed else "o", markersize=3)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    axes[-1, 0].set_xlabel("wall-clock (minutes)" if curve.against_time else "learner step")
    suffix = f" (trailing mean over {window} steps)" if window > 1 else ""
    axes[0, 0].set_title(curve.title + suffix)
    figure.tight_layout()
    return figure


def build_figures(runs: Sequence[RunCurves], smooth: int) -> dict[str, Figure]:
    """Every figure of ``CURVES`` that some run has data for, by file name."""
    figures = {}
    for curve in CURVES:
        figure = build_figure(curve, runs, smooth)
        if figure is not None:
            figures[curve.file] = figure
    return figures


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Figures: reward, held-out accuracy against steps and against wall-clock "
               "time, staleness, throughput; one line per run.")
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR",
                        help="run directories to draw on the same figures")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="where the PNGs go (default: the first RUN_DIR's plots/)")
    parser.add_argument("--smooth", type=int, default=10, metavar="N",
                        help="draw per-step series as the trailing mean over N steps "
                             "(default 10; 1: raw)")
    args = parser.parse_args(argv)
    if args.smooth < 1:
        parser.error(f"--smooth {args.smooth}: must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        runs = [read_run(run_dir) for run_dir in args.run_dirs]
    except PlotError as exc:
        print(f"relay plot: {exc}", file=sys.stderr)
        return 2
    out = args.out or args.run_dirs[0] / "plots"
    figures = build_figures(runs, args.smooth)
    for curve in CURVES:
        if curve.file not in figures:
            print(f"no run logged {' or '.join(curve.panels[0])}: {curve.file} left out")
    try:
        out.mkdir(parents=True, exist_ok=True)
        for file, figure in figures.items():
            figure.savefig(out / file, dpi=PNG_DPI)
            plt.close(figure)
            print(out / file)
    except OSError as exc:
        print(f"relay plot: cannot write to {out}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
