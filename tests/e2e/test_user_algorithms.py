"""A user's own advantage estimator and policy loss, from a file outside the package
(``user_algorithms.py``), named by module path and by file path, train the embedded default
through the launcher; an estimator that declares a critic gets one trained; one whose
signature does not fit is refused by ``--dry-run`` naming the key."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from mlflow import MlflowClient

from .conftest import ROOT, launch

pytestmark = pytest.mark.e2e

USER = Path(__file__).with_name("user_algorithms.py").relative_to(ROOT)  # from the cwd
FREE_PORTS = ["topology.buffer.port=0", "topology.learner.weights_port=0",
              "topology.learner.weights_stream_port=0", "topology.launcher.metrics_port=0"]


def test_a_users_estimator_and_loss_train_the_embedded_default(
        run_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimator by module path (the user's package on PYTHONPATH, as every process the
    launcher starts inherits it), the loss by file path (verl's custom_reward_function form)."""
    calls = tmp_path / "calls.log"
    monkeypatch.setenv("RELAY_USER_ALGORITHMS_CALLS", str(calls))
    monkeypatch.setenv("PYTHONPATH", str(ROOT / USER.parent))
    result = launch([f"trainer.run_dir={run_root}", *FREE_PORTS,
                     "trainer.total_training_steps=3", "trainer.test_freq=-1",
                     "trainer.val_before_train=false",
                     f"algorithm.adv_estimator={USER.stem}:centered_score",
                     f"actor.policy_loss.loss_mode={USER}:clipped_reinforce"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "steps              3/3" in result.stdout
    called = [line.split() for line in calls.read_text().splitlines()]
    # the learner computed every step's advantages and losses with them
    assert sum(what == "centered_score" for _, what in called) == 3
    assert {what for _, what in called} == {"centered_score", "clipped_reinforce"}


def test_a_loss_whose_signature_does_not_fit_is_refused_at_dry_run(run_root: Path) -> None:
    result = launch(["--dry-run", f"trainer.run_dir={run_root}",
                     f"actor.policy_loss.loss_mode={USER}:wrong_signature_loss"])
    assert result.returncode != 0
    assert ("relay launch: config error: command line: actor.policy_loss.loss_mode: "
            "wrong_signature_loss(logprobs, advantages)") in result.stderr
    assert "does not take the arguments Relay passes" in result.stderr


@pytest.mark.slow
def test_a_users_estimator_that_declares_a_critic_gets_one_trained(
        run_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = tmp_path / "calls.log"
    monkeypatch.setenv("RELAY_USER_ALGORITHMS_CALLS", str(calls))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = launch([f"trainer.run_dir={run_root}", *FREE_PORTS, f"tracking.uri={uri}",
                     "tracking.experiment=user", "trainer.total_training_steps=3",
                     "trainer.test_freq=-1", "trainer.val_before_train=false",
                     f"algorithm.adv_estimator={USER}:td_lambda"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "steps              3/3" in result.stdout
    called = [line.split() for line in calls.read_text().splitlines()]
    assert [what for _, what in called] == ["td_lambda"] * 3
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("user").experiment_id])
    for name in ("critic/vf_loss", "actor/pg_loss"):
        history = client.get_metric_history(run.info.run_id, name)
        assert len(history) == 3 and all(math.isfinite(m.value) for m in history), name
