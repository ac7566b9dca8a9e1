"""A LoRA run whose only generator is vLLM publishes the adapters alone, and vLLM's LoRA
support runs them: the learner says so at its start, the run trains to its end, and vLLM's
responses carry the versions it loaded. Slow tier (about a minute, most of it vLLM's
start). The model is a random Llama with heads of 32 (what vLLM's CPU attention runs)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from relay.buffer.rollout_log import read_rollout_log

from ..conftest import save_random_model
from .conftest import ROOT, VLLM_GENERATOR, launch, only_run_dir, small_run_overrides

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed (the `vllm` extra; tools/with-venv installs it by default)")]

TOPOLOGY = """
[buffer]
port = 0
[learner]
weights_port = 0
weights_stream_port = 0
threads = 1
[launcher]
metrics_port = 0
""" + VLLM_GENERATOR
STEPS = 12


def test_a_lora_run_on_vllm_publishes_and_runs_the_adapters_alone(run_root: Path,
                                                                   tmp_path: Path) -> None:
    model = save_random_model(tmp_path / "model", hidden=128)  # 4 heads of 32
    topology = tmp_path / "topology.toml"
    topology.write_text(TOPOLOGY)
    args = [a for a in small_run_overrides(model, run_root, steps=STEPS)
            if not a.startswith(("topology.", "trainer.test_freq"))]
    args += ["trainer.test_freq=-1", "trainer.val_before_train=false", "model.lora_rank=8", "model.lora_alpha=16",
             "actor.optim.lr=1e-2", "buffer.max_staleness=4"]
    result = launch([str(topology), str(ROOT / "configs" / "arithmetic-grpo.toml"), *args],
                    timeout_s=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"trained {STEPS} steps" in result.stdout
    run_dir = only_run_dir(run_root)
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert "publish: LoRA adapters only" in learner_log
    generator_log = (run_dir / "logs" / "vllm.log").read_text()
    assert "WeightMismatch" not in generator_log and "did not load" not in generator_log
    samples = [s for g in read_rollout_log(run_dir / "rollouts") for s in g.samples]
    versions = {int(v) for s in samples for v in s.versions.tolist()}
    assert max(versions) >= 2, versions  # vLLM generated with versions the learner published
