"""Held-out evaluation is a job of its own: training never waits for it.

The held-out reward is made slow (``slow_eval_reward_fn``: 300 rows x 0.02 s, about 6 s an
evaluation) while a training step of this run takes a fraction of a second. If the learner
waited for an evaluation, its step-1 metrics could only be logged after the report of the
step-0 evaluation; here they must be logged before it. Every evaluation is still logged at
the step whose weights it measured, and the last step is always evaluated.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from .conftest import launch, only_run_dir, small_run_overrides

pytestmark = pytest.mark.e2e

SLOW_EVAL_REWARD = Path(__file__).with_name("slow_eval_reward_fn.py")


def test_training_goes_on_while_the_evaluator_evaluates(random_model_dir: Path, run_root: Path,
                                                        tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = small_run_overrides(random_model_dir, run_root, steps=8) + [
        f"tracking.uri={uri}", "tracking.experiment=eval",
        f"custom_reward_function.path={SLOW_EVAL_REWARD}"]
    result = launch(args)
    assert result.returncode == 0, result.stdout + result.stderr

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("eval").experiment_id])
    evaluations = {m.step: m for m in client.get_metric_history(run.info.run_id,
                                                                 "eval/accuracy")}
    trained = {m.step: m for m in client.get_metric_history(run.info.run_id,
                                                             "rollout/reward_mean")}
    assert sorted(trained) == list(range(1, 9))
    assert {0, 8} <= set(evaluations) <= {0, 2, 4, 6, 8}  # offers the evaluator missed are skipped
    assert trained[1].timestamp < evaluations[0].timestamp, \
        "the learner waited for the evaluation of step 0 before training step 1"
    evaluator_log = (only_run_dir(run_root) / "logs" / "evaluator.log").read_text()
    assert "held-out accuracy" in evaluator_log and "the run is over" in evaluator_log
