"""Experiment tracking with MLflow (rank 0 only), and optionally Weights & Biases,
TensorBoard and SwanLab (``tracking.loggers``).

The default tracking URI is a SQLite store inside the run directory
(``sqlite:///RUN_DIR/mlflow.db``), whose artifacts go to ``RUN_DIR/mlartifacts`` (MLflow's own
default for a database store is ``./mlruns`` under the working directory: the user's project
folder). Any MLflow URI works (``http://host:5000``, a ``file:`` store, a database). To
compare runs, give them one store: ``tracking.uri=sqlite:////abs/runs/mlflow.db`` puts every
run of an experiment side by side (``mlflow ui --backend-store-uri`` that URI); a SQLite
store's experiments, when Relay creates them, keep their artifacts beside the database
(``/abs/runs/mlartifacts/<run id>/``: MLflow gives each run an artifact folder under its
experiment's, not one of the run's choosing); each run carries its run directory as the tag
``relay.run_dir``. Other stores and servers keep the artifact location their experiment or
server decides. A run records the flattened run config as params, the
resolved configs as artifacts, and per-step metrics with step = learner step.

A resumed run logs into the MLflow run of the run it resumes (the checkpoint names it), from
the checkpoint's step + 1 on: one history per metric across restarts. Steps after the
checkpoint that the interrupted run had already logged appear twice in a metric's history
(MLflow keeps every value logged at a step). The params are not logged again (MLflow
refuses a changed value, and ``trainer.resume_*`` did change); the resumed run's resolved
configs go to ``config/resumed-at-step-<N>/`` and the tag ``relay.resumed_at_step`` says
where it went on. When that run cannot be continued (not in the store: another tracking
URI; deleted; in another experiment), a new run named "<name> (resumed at step N)" is
started instead, with the params as usual.

The other trackers are thin adapters over their libraries' own APIs (``Sink``), each
receiving the same params and metrics: ``wandb.init(project=experiment, name=run_name,
dir=run_dir, mode=wandb_mode)`` (offline by default: the files are under run_dir/wandb, for
``wandb sync``), TensorBoard's ``SummaryWriter(run_dir/tensorboard)`` and
``swanlab.init(project=experiment, name=run_name, log_dir=run_dir/swanlog, mode="offline")``
(always offline: ``swanlab sync run_dir/swanlog/run-*`` uploads a run). A resumed run starts a
new run in each of them. MLflow refuses "@" in a metric's name, so verl's
``mean@4`` reaches MLflow as ``mean_at_4`` and the others as it is.
"""

from __future__ import annotations

import logging
from pathlib import Path
from collections.abc import Sequence
from typing import Any, Protocol

import mlflow
import msgspec
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from relay.learner.metric_names import with_verl_aliases
from relay.transport.messages import ValGeneration

logger = logging.getLogger(__name__)

MAX_PARAM_CHARS = 500
SQLITE_PREFIX = "sqlite:///"
RUN_DIR_TAG = "relay.run_dir"
"""Every MLflow run of a run directory carries its absolute path under this tag (the offline
replay, ``relay.learner.replay``, finds the live metrics by it)."""


def default_uri(run_dir: Path) -> str:
    return f"sqlite:///{run_dir / 'mlflow.db'}"


def artifact_root(uri: str) -> Path | None:
    """Where a new experiment of SQLite store ``uri`` keeps its artifacts: ``mlartifacts``
    beside the database file (for the default store, in the run directory); None for any
    other store (its own default, or its server's)."""
    if not uri.startswith(SQLITE_PREFIX):
        return None
    return Path(uri.removeprefix(SQLITE_PREFIX)).parent / "mlartifacts"


def experiment_for(experiment: str, artifacts: Path | None) -> str:
    """The id of MLflow experiment ``experiment`` in the current store, created with its
    artifacts under ``artifacts`` (None: where the store decides) if it does not exist."""
    found = mlflow.get_experiment_by_name(experiment)
    if found is not None:
        return found.experiment_id
    location = None if artifacts is None else artifacts.resolve().as_uri()
    return mlflow.create_experiment(experiment, artifact_location=location)


def flatten(config: msgspec.Struct) -> dict[str, str]:
    """``{"actor.optim.lr": "1e-06", ...}`` for MLflow params."""
    out: dict[str, str] = {}

    def walk(value: Any, prefix: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{prefix}.{key}" if prefix else key)
        else:
            out[prefix] = str(value)[:MAX_PARAM_CHARS]

    walk(msgspec.to_builtins(config), "")
    return out


class Resumed(msgspec.Struct, frozen=True):
    """A resumed run: the checkpoint's step and the MLflow run it was written by."""

    step: int
    run_id: str


GENERATION_COLUMNS = ("step", "input", "output", "score")


def generation_rows(step: int, generations: Sequence[ValGeneration]) -> list[list[Any]]:
    """The rows of a held-out generations table (``GENERATION_COLUMNS``)."""
    return [[step, g.input, g.output, g.score] for g in generations]


class Sink(Protocol):
    """A tracker besides MLflow: it gets the same params, metrics and tables."""

    def log_params(self, params: dict[str, str]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_generations(self, step: int, generations: Sequence[ValGeneration]) -> None: ...

    def close(self, ok: bool) -> None: ...


class WandbSink:
    """A Weights & Biases run (``wandb.init``); offline mode writes run_dir/wandb.

    Every metric is plotted against ``STEP_METRIC``, the learner step, rather than wandb's
    own step: an evaluation's report arrives after later training steps were logged, and
    wandb drops a row whose own step goes back."""

    STEP_METRIC = "trainer/step"

    def __init__(self, *, project: str, name: str, run_dir: Path, mode: str) -> None:
        import wandb  # only when asked for: an optional package

        self.run = wandb.init(project=project, name=name, dir=str(run_dir), mode=mode)
        self.run.define_metric(self.STEP_METRIC)
        self.run.define_metric("*", step_metric=self.STEP_METRIC)

    def log_params(self, params: dict[str, str]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log({**metrics, self.STEP_METRIC: step})

    def log_generations(self, step: int, generations: Sequence[ValGeneration]) -> None:
        import wandb

        table = wandb.Table(columns=list(GENERATION_COLUMNS),
                            data=generation_rows(step, generations))
        self.run.log({"val/generations": table, self.STEP_METRIC: step})

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


class TensorBoardSink:
    """TensorBoard event files under run_dir/tensorboard (``SummaryWriter``)."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log_params(self, params: dict[str, str]) -> None:
        lines = (f"{key} = {value}" for key, value in sorted(params.items()))
        self.writer.add_text("config", "\n\n".join(lines))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)

    def log_generations(self, step: int, generations: Sequence[ValGeneration]) -> None:
        rows = ["| input | output | score |", "| --- | --- | --- |"]
        rows += [f"| {_cell(g.input)} | {_cell(g.output)} | {g.score:g} |" for g in generations]
        self.writer.add_text("val/generations", "\n".join(rows), global_step=step)

    def close(self, ok: bool) -> None:
        self.writer.close()


class SwanlabSink:
    """A SwanLab run (``swanlab.init``), offline: its files under run_dir/swanlog, for
    ``swanlab sync``; the held-out generations as an ECharts table, as verl logs them."""

    def __init__(self, *, project: str, name: str, run_dir: Path) -> None:
        import swanlab  # only when asked for: an optional package

        self.run = swanlab.init(project=project, name=name, log_dir=str(run_dir / "swanlog"),
                                mode="offline")

    def log_params(self, params: dict[str, str]) -> None:
        self.run.config.update(params)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_generations(self, step: int, generations: Sequence[ValGeneration]) -> None:
        import swanlab

        table = swanlab.echarts.Table()
        table.add(headers=list(GENERATION_COLUMNS), rows=generation_rows(step, generations))
        self.run.log({"val/generations": table}, step=step)

    def close(self, ok: bool) -> None:
        self.run.finish(state="success" if ok else "crashed",
                        error=None if ok else "the learner failed")


def _cell(text: str) -> str:
    """Text for one markdown table cell."""
    return text.replace("|", "\\|").replace("\n", "<br>")


def build_sinks(loggers: Sequence[str], *, project: str, name: str, run_dir: Path,
                wandb_mode: str = "offline") -> list[Sink]:
    """The trackers ``loggers`` names besides MLflow and the console (``TrackingConfig``)."""
    sinks: list[Sink] = []
    if "wandb" in loggers:
        sinks.append(WandbSink(project=project, name=name, run_dir=run_dir, mode=wandb_mode))
    if "tensorboard" in loggers:
        sinks.append(TensorBoardSink(run_dir))
    if "swanlab" in loggers:
        sinks.append(SwanlabSink(project=project, name=name, run_dir=run_dir))
    return sinks


class Tracker:
    """One MLflow run: a new one, or, resuming, the one the checkpoint names (module
    docstring); and the other trackers ``loggers`` names."""

    def __init__(self, *, uri: str, experiment: str, run_name: str, run_dir: Path,
                 resumed: Resumed | None = None, loggers: Sequence[str] = (),
                 wandb_mode: str = "offline") -> None:
        self.uri = uri or default_uri(run_dir)
        self.resumed = resumed
        mlflow.set_tracking_uri(self.uri)
        experiment_id = mlflow.set_experiment(experiment_id=experiment_for(
            experiment, artifact_root(self.uri))).experiment_id
        name = run_name or run_dir.name
        self.continued = resumed is not None and self._continuable(resumed.run_id,
                                                                   experiment_id)
        if resumed is None:
            self.run = mlflow.start_run(run_name=name)
        elif self.continued:
            self.run = mlflow.start_run(run_id=resumed.run_id)
        else:
            self.run = mlflow.start_run(run_name=f"{name} (resumed at step {resumed.step})")
        mlflow.set_tag(RUN_DIR_TAG, str(run_dir.resolve()))
        if resumed is not None:
            mlflow.set_tag("relay.resumed_at_step", str(resumed.step))
        logger.info("tracking to %s (experiment %r, run %s%s)", self.uri, experiment,
                    self.run.info.run_id, " continued" if self.continued else "")
        self.sinks = build_sinks(loggers, project=experiment, name=name, run_dir=run_dir,
                                 wandb_mode=wandb_mode)

    @property
    def run_id(self) -> str:
        return self.run.info.run_id

    def _continuable(self, run_id: str, experiment_id: str) -> bool:
        """Whether a resumed run can go on logging into ``run_id``: the store holds it, in
        this experiment, not deleted."""
        if not run_id:
            return False
        try:
            found = MlflowClient(self.uri).get_run(run_id).info
        except MlflowException as exc:
            logger.warning("the checkpoint's MLflow run %s is not in %s (%s); starting a new "
                           "run", run_id, self.uri, exc.message)
            return False
        if found.lifecycle_stage == "deleted" or found.experiment_id != experiment_id:
            logger.warning("the checkpoint's MLflow run %s is deleted or in another experiment; "
                           "starting a new run", run_id)
            return False
        return True

    def log_config(self, config: msgspec.Struct, files: list[Path]) -> None:
        if self.continued:
            assert self.resumed is not None
            for file in files:
                mlflow.log_artifact(str(file),
                                    artifact_path=f"config/resumed-at-step-{self.resumed.step}")
            return
        params = flatten(config)
        for sink in self.sinks:
            sink.log_params(params)
        keys = sorted(params)
        for start in range(0, len(keys), 100):  # MLflow takes at most 100 params per call
            mlflow.log_params({k: params[k] for k in keys[start:start + 100]})
        for file in files:
            mlflow.log_artifact(str(file), artifact_path="config")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log ``metrics`` at ``step``, with verl's names beside Relay's
        (``relay.learner.metric_names``); MLflow refuses "@" in a name, so verl's ``mean@4``
        is logged as ``mean_at_4`` (as verl's own MLflow logger does)."""
        metrics = with_verl_aliases(metrics)  # verl's names beside Relay's (metric_names)
        mlflow.log_metrics({name.replace("@", "_at_"): value for name, value in metrics.items()},
                           step=step)
        for sink in self.sinks:
            sink.log_metrics(metrics, step)

    def log_generations(self, step: int, generations: Sequence[ValGeneration]) -> None:
        """A table of held-out responses (``trainer.log_val_generations``): MLflow's
        ``val_generations/step-<N>.json`` artifact, and each other tracker's own table."""
        rows = generation_rows(step, generations)
        mlflow.log_table({column: [row[i] for row in rows]
                          for i, column in enumerate(GENERATION_COLUMNS)},
                         artifact_file=f"val_generations/step-{step:06d}.json")
        for sink in self.sinks:
            sink.log_generations(step, generations)

    def close(self, ok: bool) -> None:
        for sink in self.sinks:
            sink.close(ok)
        mlflow.end_run(status="FINISHED" if ok else "FAILED")
