"""A user's own advantage estimator and policy loss, from a file outside the package
(``user_algorithms.py``), train the embedded default through the launcher; one whose
signature does not fit is refused by ``--dry-run`` naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import ROOT, launch

pytestmark = pytest.mark.e2e

USER = Path(__file__).with_name("user_algorithms.py").relative_to(ROOT)  # from the cwd
FREE_PORTS = ["topology.buffer.port=0", "topology.learner.weights_port=0",
              "topology.learner.weights_stream_port=0", "topology.launcher.metrics_port=0"]


def test_a_users_estimator_and_loss_train_the_embedded_default(
        run_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = tmp_path / "calls.log"
    monkeypatch.setenv("RELAY_USER_ALGORITHMS_CALLS", str(calls))
    result = launch([f"trainer.run_dir={run_root}", *FREE_PORTS,
                     "trainer.total_training_steps=3", "trainer.test_freq=-1",
                     "trainer.val_before_train=false",
                     f"algorithm.adv_estimator={USER}:centered_score",
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
