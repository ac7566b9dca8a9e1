"""The embedded default, as the README runs it, must visibly learn (slow: ~5-8 minutes).

The acceptance bar: on a 2-core machine, held-out accuracy rises by at least
``ACCEPTANCE_LIFT`` (15 points) over the warm start within 10 minutes of wall time. The
launcher builds the tiny model first if the cache lacks it (a few minutes more, not counted
in the training time below).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from .conftest import ACCEPTANCE_LIFT, launch, only_run_dir

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FREE_PORTS = ["topology.buffer.port=0", "topology.learner.weights_port=0",
              "topology.learner.weights_stream_port=0",
              "topology.launcher.metrics_port=0"]


def test_default_run_lifts_heldout_accuracy_by_15_points(run_root: Path) -> None:
    started = time.monotonic()
    result = launch([f"trainer.run_dir={run_root}", *FREE_PORTS], timeout_s=1500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = only_run_dir(run_root)
    # the run ends with its summary: accuracy, the model folder, the command to see the curves
    summary = result.stdout[result.stdout.rindex("relay launch: run finished"):]
    assert summary.splitlines()[1].split()[:2] == ["steps", "400/400"], summary
    assert "held-out accuracy  final " in summary and ", best " in summary
    assert f"model              {run_dir.resolve() / 'final'}/" in summary
    assert f"mlflow ui --backend-store-uri sqlite:///{run_dir.resolve()}/mlflow.db" in summary

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("relay-arithmetic").experiment_id])
    history = sorted(client.get_metric_history(run.info.run_id, "eval/accuracy"),
                     key=lambda m: m.step)
    assert history[0].step == 0, "the warm start must be evaluated before training"
    minutes = (history[-1].timestamp - run.info.start_time) / 60_000
    launched = (time.monotonic() - started) / 60
    assert minutes <= 10, f"training took {minutes:.1f} min (whole launch {launched:.1f} min)"
    warm_start = history[0].value
    trained = statistics.mean(m.value for m in history[-3:])  # smooths eval noise
    assert trained - warm_start >= ACCEPTANCE_LIFT, [(m.step, m.value) for m in history]
