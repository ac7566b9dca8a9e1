"""A verl example script (``tests/tools/launcher/verl_examples/grpo_qwen2-7b_seq_balance.sh``),
entry point swapped, trains Relay's embedded default model (``MODEL_PATH=builtin:tiny-arith``)
on the bundled arithmetic data for a few steps (slow: about 1-2 minutes once the model is
cached; the launcher builds it first when the cache lacks it, a few minutes more).

The script's own overrides stay as verl wrote them (GRPO with verl's dynamic batch sizes,
``data.filter_overlong_prompts``, ``data.truncation='error'``); the small ones a user appends
to ``$@`` follow them. The script's SGLang is refused on a CPU machine, so the user picks
vLLM (``actor_rollout_ref.rollout.name=vllm``, the last value wins: the embedded default's
heads of 32 run on vLLM's CPU attention) with one generator's worth of tensor parallelism,
the model's context length and small KV caches; without vLLM, Relay's own engine.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from relay.configs import CONFIG_DIR
from relay.configs.prompt_data import load_prompt_rows, write_prompt_rows
from relay.configs.rundir import RESOLVED_TOPOLOGY
from relay.learner.tiny_model.build import default_model_dir

from .conftest import ROOT, only_run_dir, processes_mentioning

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SCRIPT = ROOT / "tests" / "tools" / "launcher" / "verl_examples" / \
    "grpo_qwen2-7b_seq_balance.sh"
STEPS = 4
ENGINE_ARGS = [  # what a user of a CPU machine appends instead of the script's SGLang
    "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.max_model_len=256",  # the model's positions
    "topology.generators[0].vllm.kv_cache_gib=0.25", "topology.evaluator.vllm.kv_cache_gib=0.25",
] if importlib.util.find_spec("vllm") is not None else ["actor_rollout_ref.rollout.name=lean"]
VAL_ROWS = 100


def test_a_verl_example_trains_the_embedded_default(run_root: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"  # the script reads $HOME/data/gsm8k/{train,test}.parquet
    for name, source, count in (("train", "arithmetic-train.jsonl", 256),
                                ("test", "arithmetic-test.jsonl", VAL_ROWS)):
        rows = load_prompt_rows(CONFIG_DIR / "data" / source)[:count]
        write_prompt_rows(home / "data" / "gsm8k" / f"{name}.parquet", rows)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    small = [f"trainer.total_training_steps={STEPS}", f"trainer.test_freq={STEPS}",
             f"trainer.run_dir={run_root}", f"tracking.uri={uri}", "trainer.logger=['console']",
             "data.train_batch_size=16", "data.max_response_length=16",
             "actor_rollout_ref.actor.ppo_mini_batch_size=16",
             "actor_rollout_ref.actor.optim.lr=2e-4", "actor_rollout_ref.rollout.n=4",
             *ENGINE_ARGS,
             "trainer.n_gpus_per_node=1", "topology.buffer.port=0",
             "topology.learner.weights_port=0", "topology.learner.weights_stream_port=0",
             "topology.launcher.metrics_port=0"]
    # the model cache stays the user's own: $HOME above is a scratch folder
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    env = dict(os.environ, HOME=str(home), XDG_CACHE_HOME=cache,
               MODEL_PATH="builtin:tiny-arith", RELAY_LOG_LEVEL="INFO",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    result = subprocess.run(["bash", str(SCRIPT), *small], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"trained {STEPS} steps" in result.stdout
    run_dir = only_run_dir(run_root)
    assert processes_mentioning(str(run_dir)) == []
    topology = tomllib.loads((run_dir / RESOLVED_TOPOLOGY).read_text())
    engine = ENGINE_ARGS[0].rpartition("=")[2]
    assert topology["generators"][0]["engine"] == topology["evaluator"]["engine"] == engine

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name(
        "verl_grpo_example_gsm8k").experiment_id])  # trainer.project_name
    assert run.info.run_name == "qwen2_7b_function_rm_kl1e-3"  # trainer.experiment_name
    assert run.data.params["model.path"] == str(default_model_dir())  # built once, cached
    losses = client.get_metric_history(run.info.run_id, "actor/loss")
    assert sorted(m.step for m in losses) == list(range(1, STEPS + 1))  # one update a step
    norms = client.get_metric_history(run.info.run_id, "actor/grad_norm")
    assert all(m.value > 0 for m in norms), [(m.step, m.value) for m in norms]
    # held-out accuracy after the last step: the warm-started default answers some of the
    # questions (about 24% greedy before RL, README), where a random model answers none
    (accuracy,) = client.get_metric_history(run.info.run_id, "eval/accuracy")
    assert accuracy.step == STEPS and accuracy.value > 0.03, accuracy
    assert 0 < run.data.metrics["val-core/relay/arithmetic/reward/mean_at_1"] <= 1
