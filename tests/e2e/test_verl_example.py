"""A verl example script (``tests/tools/launcher/verl_examples/grpo_qwen3-8b.sh``), entry point
swapped, trains a few steps: its own overrides, then small ones appended as a verl user
appends them to ``$@``; the run logs verl's validation metrics, the held-out generations
table, and wandb (offline), TensorBoard and SwanLab (offline) files, and dumps every held-out
response (``trainer.validation_data_dir``).

The script's ``rollout.name=vllm`` runs vLLM where it is installed (a random model with heads
of 32, which vLLM's CPU attention needs; vLLM takes ~15 s to start in each of the generator
and the evaluator): a CPU user appends one generator's worth of tensor parallelism, the
model's context length (the script's prompts may be longer) and small KV caches. Without
vLLM the user appends ``rollout.name=lean``, Relay's own engine."""

from __future__ import annotations

import importlib.util
import json
import os
import tomllib
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from relay.configs import CONFIG_DIR
from relay.configs.prompt_data import load_prompt_rows, write_prompt_rows
from relay.configs.rundir import RESOLVED_TOPOLOGY

from ..conftest import save_random_model
from .conftest import ROOT, only_run_dir, processes_mentioning, small_run_overrides

pytestmark = pytest.mark.e2e

SCRIPT = ROOT / "tests" / "tools" / "launcher" / "verl_examples" / "grpo_qwen3-8b.sh"
ENGINE = "vllm" if importlib.util.find_spec("vllm") is not None else "lean"
ENGINE_ARGS = {  # what a user of a CPU machine appends for the script's vLLM rollouts
    "vllm": ["actor_rollout_ref.rollout.tensor_model_parallel_size=1",
             "actor_rollout_ref.rollout.max_model_len=128",  # the model's positions
             "topology.generators[0].vllm.kv_cache_gib=0.25",
             "topology.evaluator.vllm.kv_cache_gib=0.25"],
    "lean": ["actor_rollout_ref.rollout.name=lean"]}[ENGINE]


def test_a_verl_example_trains_and_logs_to_every_tracker(run_root: Path, tmp_path: Path) -> None:
    pytest.importorskip("wandb", reason="the trackers extra: pip install -e .[trackers]")
    pytest.importorskip("tensorboard", reason="the trackers extra")
    pytest.importorskip("swanlab", reason="the trackers extra")
    random_model_dir = save_random_model(tmp_path / "model", hidden=128)  # 4 heads of 32
    home = tmp_path / "home"
    for name, source, count in (("train", "arithmetic-train.jsonl", 64),
                                ("test", "arithmetic-test.jsonl", 4)):
        rows = load_prompt_rows(CONFIG_DIR / "data" / source)[:count]
        write_prompt_rows(home / "data" / "gsm8k" / f"{name}.parquet", rows)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    small = small_run_overrides(random_model_dir, run_root, steps=2) + [
        "trainer.n_gpus_per_node=1", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "data.max_response_length=8",
        "actor_rollout_ref.rollout.val_kwargs.n=2",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0", "trainer.log_val_generations=2",
        "trainer.logger=['console','mlflow','wandb','tensorboard','swanlab']",
        f"tracking.uri={uri}", f"trainer.validation_data_dir={tmp_path / 'val_dump'}",
        *ENGINE_ARGS]
    small.remove("rollout.response_length=8")  # data.max_response_length says it, verl's way
    env = dict(os.environ, HOME=str(home), MODEL_PATH=str(random_model_dir),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               WANDB_SILENT="true")
    result = subprocess.run(["bash", str(SCRIPT), *small], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "trained 2 steps" in result.stdout
    run_dir = only_run_dir(run_root)
    assert processes_mentioning(str(run_dir)) == []
    topology = tomllib.loads((run_dir / RESOLVED_TOPOLOGY).read_text())
    assert topology["generators"][0]["engine"] == topology["evaluator"]["engine"] == ENGINE

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name(
        "verl_grpo_example_gsm8k").experiment_id])  # trainer.project_name
    assert run.info.run_name == "qwen3_8b_function_rm"  # trainer.experiment_name
    metrics = run.data.metrics
    assert 0 <= metrics["val-core/relay/arithmetic/reward/mean_at_2"] <= 1
    assert "val-aux/relay/arithmetic/reward/std_at_2" in metrics
    assert "val-core/relay/arithmetic/reward/best_at_2/mean" in metrics
    tables = [a.path for a in client.list_artifacts(run.info.run_id, "val_generations")]
    assert "val_generations/step-000002.json" in tables
    (wandb_run,) = (run_dir / "wandb").glob("offline-run-*")
    assert list(wandb_run.glob("run-*.wandb"))
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    (swanlab_run,) = (run_dir / "swanlog").glob("run-*")
    (records,) = swanlab_run.glob("run-*.swanlab")
    assert b"val-core/relay/arithmetic/reward/mean@2" in records.read_bytes()
    dumped = [json.loads(line) for line in (tmp_path / "val_dump" / "2.jsonl").open()]
    assert len(dumped) == 4 * 2  # 4 held-out rows, val_kwargs.n = 2
    assert {d["step"] for d in dumped} == {2} and all("gts" in d for d in dumped)
