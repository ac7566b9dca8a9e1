"""The learner's MLflow tracker takes verl's metric names, which MLflow refuses as they are."""

from __future__ import annotations

from pathlib import Path

from mlflow.tracking import MlflowClient

from learner.tracking import Tracker


def test_verls_at_names_are_logged_with_at_spelled_out(tmp_path: Path) -> None:
    tracker = Tracker(uri="", experiment="verl-names", run_name="", run_dir=tmp_path)
    try:
        tracker.log_metrics({"val-core/src/acc/mean@4": 0.5, "eval/accuracy": 0.25}, step=3)
    finally:
        tracker.close(ok=True)
    logged = MlflowClient(tracker.uri).get_run(tracker.run_id).data.metrics
    assert logged == {"val-core/src/acc/mean_at_4": 0.5, "eval/accuracy": 0.25}
