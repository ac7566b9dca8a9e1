"""Experiment tracking with MLflow (rank 0 only).

The default tracking URI is a SQLite store inside the run directory
(``sqlite:///RUN_DIR/mlflow.db``); any MLflow URI works (``http://host:5000``, a
``file:`` store, a database). A run records the flattened run config as params, the
resolved configs as artifacts, and per-step metrics with step = learner step.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlflow
import msgspec

logger = logging.getLogger(__name__)

MAX_PARAM_CHARS = 500


def default_uri(run_dir: Path) -> str:
    return f"sqlite:///{run_dir / 'mlflow.db'}"


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


class Tracker:
    """One MLflow run."""

    def __init__(self, *, uri: str, experiment: str, run_name: str, run_dir: Path) -> None:
        self.uri = uri or default_uri(run_dir)
        mlflow.set_tracking_uri(self.uri)
        mlflow.set_experiment(experiment)
        self.run = mlflow.start_run(run_name=run_name or run_dir.name)
        logger.info("tracking to %s (experiment %r, run %s)", self.uri, experiment,
                    self.run.info.run_id)

    def log_config(self, config: msgspec.Struct, files: list[Path]) -> None:
        params = flatten(config)
        keys = sorted(params)
        for start in range(0, len(keys), 100):  # MLflow takes at most 100 params per call
            mlflow.log_params({k: params[k] for k in keys[start:start + 100]})
        for file in files:
            mlflow.log_artifact(str(file), artifact_path="config")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        mlflow.log_metrics(metrics, step=step)

    def close(self, ok: bool) -> None:
        mlflow.end_run(status="FINISHED" if ok else "FAILED")
