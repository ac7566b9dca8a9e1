"""Two learner ranks through the launcher: one local, one on a "remote" host.

``topology.learner.hosts`` names two hosts, so the launcher starts one torchrun per host
(the second through ``fake_ssh.py``, which runs it on this machine: the whole multi-host
path, rendezvous at ``hosts[0]:master_port`` included). CURVE is on, as it must be for a
host that is not loopback.

- eta = 0 (``buffer.max_staleness=0``, synchronous): the two ranks (data-parallel) train to
  the weights of one rank, step for step, as in ``tests/learner/test_ranks.py`` but with
  the buffer, a generator and the weight publishing in the loop;
- eta = 1 with Ulysses sequence parallelism over the two ranks
  (``actor.ulysses_sequence_parallel_size=2``) and two generators: the run trains, publishes,
  evaluates, writes a checkpoint and exits cleanly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from .conftest import ROOT, launch, only_run_dir, processes_mentioning, small_run_overrides

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FAKE_SSH = Path(__file__).with_name("fake_ssh.py")
REMOTE_HOST = "learner-2.example"
LR = 2e-4  # the embedded default's actor.optim.lr
STEPS = 4


def two_hosts(keys: Path, ssh_log: Path) -> list[str]:
    """The learner on this host and on ``REMOTE_HOST`` (one rank each), under CURVE."""
    return ["topology.security.curve=true", f"topology.security.keys_dir={keys}",
            f'topology.learner.hosts=["127.0.0.1", "{REMOTE_HOST}"]',
            "topology.learner.master_port=0", "topology.launcher.backend=ssh",
            f"topology.launcher.ssh={sys.executable} {FAKE_SSH}",
            f"topology.launcher.remote_python={sys.executable}",
            f"topology.launcher.remote_workdir={ROOT}"]


def final_weights(run_root: Path) -> dict[str, torch.Tensor]:
    run_dir = only_run_dir(run_root)
    return load_file(run_dir / "checkpoints" / f"step-{STEPS}" / "hf" / "model.safetensors")


def test_two_learner_ranks_at_eta_zero_train_to_the_weights_of_one(
        random_model_dir: Path, curve_keys: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_SSH_LOG", str(tmp_path / "ssh.log"))
    common = ["buffer.max_staleness=0", "trainer.seed=3", "data.seed=3",
              f"trainer.save_freq={STEPS}", "trainer.test_freq=-1",
              "trainer.val_before_train=false"]
    weights = []
    for name, extra in (("one", []), ("two", two_hosts(curve_keys, tmp_path / "ssh.log"))):
        root = tmp_path / name
        root.mkdir()
        result = launch(small_run_overrides(random_model_dir, root, steps=STEPS)
                        + common + extra)
        assert result.returncode == 0, result.stdout + result.stderr
        assert processes_mentioning(str(root)) == []
        weights.append(final_weights(root))
    one, two = weights
    assert REMOTE_HOST in (tmp_path / "ssh.log").read_text()
    initial = load_file(random_model_dir / "model.safetensors")
    assert all(not torch.equal(initial[k], one[k]) for k in one)
    # as in tests/learner/test_ranks.py: a near-zero gradient summed in another order may
    # flip its sign, and Adam then moves that weight by ~lr the other way
    for name, tensor in one.items():
        close = torch.isclose(two[name], tensor, atol=LR / 100, rtol=1e-4)
        assert float(close.float().mean()) > 0.999, name
        torch.testing.assert_close(two[name], tensor, atol=2 * LR, rtol=1e-3)


def test_two_learner_ranks_with_sequence_parallelism_train_publish_and_evaluate(
        random_model_dir: Path, run_root: Path, curve_keys: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_SSH_LOG", str(tmp_path / "ssh.log"))
    result = launch(small_run_overrides(random_model_dir, run_root, steps=STEPS)
                    + two_hosts(curve_keys, tmp_path / "ssh.log")
                    + ["actor.ulysses_sequence_parallel_size=2", "buffer.max_staleness=1",
                       "trainer.save_freq=2", "topology.generators=["
                       '{name = "gen0", engine = "lean", threads = 1}, '
                       '{name = "gen1", engine = "lean", threads = 1}]'])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"trained {STEPS} steps" in result.stdout
    run_dir = only_run_dir(run_root)
    assert processes_mentioning(str(run_dir)) == []
    commands = (tmp_path / "ssh.log").read_text().splitlines()
    assert any(c.startswith(REMOTE_HOST) and "relay.learner.main" in c for c in commands)
    for rank_log in ("learner@127.0.0.1.log", f"learner@{REMOTE_HOST}.log"):
        assert (run_dir / "logs" / rank_log).is_file()
    for name in ("gen0", "gen1"):  # both generators trained with published weights
        log = (run_dir / "logs" / f"{name}.log").read_text()
        assert "now generating with weights version" in log, name
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-2", "step-4"]

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED"
    losses = client.get_metric_history(run.info.run_id, "actor/loss")
    assert sorted(m.step for m in losses) == list(range(1, STEPS + 1))
    assert client.get_metric_history(run.info.run_id, "eval/accuracy"), "no evaluation"
    assert run.data.params["actor.ulysses_sequence_parallel_size"] == "2"
