"""``actor.strategy = "deepspeed"`` through the launcher: two learner ranks train the policy in
a ZeRO-3 engine, publish it to the generator and save a checkpoint and the final model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from transformers import AutoModelForCausalLM

from .conftest import launch, only_run_dir, small_run_overrides

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
pytest.importorskip("deepspeed")

STEPS = 3


def test_two_ranks_train_with_zero_3_end_to_end(random_model_dir: Path, run_root: Path,
                                               tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = launch(small_run_overrides(random_model_dir, run_root, steps=STEPS) + [
        f"tracking.uri={uri}", "tracking.experiment=deepspeed", "actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.strategy=deepspeed", "actor.deepspeed.zero_stage=3",
        "topology.learner.nproc_per_node=2", f"trainer.save_freq={STEPS}",
        "trainer.test_freq=-1"], timeout_s=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"trained {STEPS} steps" in result.stdout

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("deepspeed").experiment_id])
    for name in ("actor/loss", "actor/grad_norm"):
        history = client.get_metric_history(run.info.run_id, name)
        assert len(history) == STEPS and all(math.isfinite(m.value) for m in history), name
    versions = client.get_metric_history(run.info.run_id, "version")
    assert max(m.value for m in versions) == STEPS  # every step published to the generator

    run_dir = only_run_dir(run_root)
    initial = AutoModelForCausalLM.from_pretrained(random_model_dir)
    for folder in (run_dir / "checkpoints" / f"step-{STEPS}" / "hf", run_dir / "final"):
        trained = AutoModelForCausalLM.from_pretrained(folder)
        moved = [not torch.equal(a, b) for a, b in zip(trained.parameters(),
                                                        initial.parameters())]
        assert all(moved), f"{folder}: every parameter must have been trained"
