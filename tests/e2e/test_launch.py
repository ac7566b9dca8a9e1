"""The whole system as a user runs it: launcher, buffer, torchrun learner, generator.

Real processes, real ZeroMQ sockets on loopback with CURVE encryption and authentication,
a real MLflow store; the process tree must end by itself and leave nothing behind.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from transformers import AutoModelForCausalLM, AutoTokenizer

from relay.buffer.rollout_log import read_rollout_log

from .conftest import launch, only_run_dir, processes_mentioning, small_run_overrides

pytestmark = pytest.mark.e2e

EXPECTED_METRICS = [
    "rollout/reward_mean", "rollout/reward_std", "eval/accuracy", "staleness/mean",
    "staleness/max", "staleness/frac_0", "staleness/frac_1", "actor/kl", "actor/entropy",
    "actor/clip_frac", "actor/importance_weight_mean", "actor/importance_weight_max",
    "actor/behav_prox_logprob_gap", "actor/grad_norm", "perf/learner_tokens_per_s",
    "perf/generator_tokens_per_s", "buffer/occupancy", "buffer/dropped/stale",
    "buffer/rejected/duplicate",
]


def test_a_short_run_trains_logs_and_exits_cleanly(random_model_dir: Path, run_root: Path,
                                                    curve_keys: Path, tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    keys = curve_keys
    args = small_run_overrides(random_model_dir, run_root, steps=4) + [
        f"tracking.uri={uri}", "tracking.experiment=e2e", "actor.use_kl_loss=true",
        "actor.optim.lr=1e-3", "trainer.save_freq=4", "topology.security.curve=true",
        f"topology.security.keys_dir={keys}"]
    result = launch(args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "trained 4 steps" in result.stdout
    run_dir = only_run_dir(run_root)
    summary = result.stdout[result.stdout.rindex("relay launch: run finished"):].splitlines()
    assert [line.split()[0] for line in summary[1:]] == ["steps", "held-out", "model",
                                                         "metrics", "logs"], summary
    assert summary[1].split()[1] == "4/4" and "final " in summary[2] and "best " in summary[2]
    assert summary[4].endswith(f"mlflow ui --backend-store-uri {uri}")
    assert processes_mentioning(str(run_dir)) == []

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("e2e")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    for name in EXPECTED_METRICS:
        history = client.get_metric_history(run.info.run_id, name)
        assert history, f"metric {name} was never logged"
        assert all(math.isfinite(m.value) for m in history), name
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "rollout/reward_mean")]
    assert steps == [1, 2, 3, 4]
    accuracy_steps = [m.step for m in client.get_metric_history(run.info.run_id, "eval/accuracy")]
    assert accuracy_steps == [0, 2, 4]
    assert run.data.params["data.train_batch_size"] == "4"
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id, "config")]
    assert artifacts == ["config/run.toml", "config/topology.toml"]

    groups = list(read_rollout_log(run_dir / "rollouts"))
    assert len(groups) >= 4 * 4  # every trained group was logged
    assert {len(g.samples) for g in groups} == {4}
    checkpoint = run_dir / "checkpoints" / "step-4"
    assert (checkpoint / "dcp").is_dir()
    trained = AutoModelForCausalLM.from_pretrained(checkpoint / "hf")
    AutoTokenizer.from_pretrained(checkpoint / "hf")
    initial = AutoModelForCausalLM.from_pretrained(random_model_dir)
    moved = [not torch.equal(a, b) for a, b in zip(trained.parameters(), initial.parameters())]
    assert all(moved), "every parameter must have been trained"
