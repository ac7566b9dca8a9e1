"""A vLLM generator beside Relay's own, in a real launch: both lease and generate, and
vLLM receives weights mid-generation (per-token versions change inside its responses).
Slow tier (about 80 s, most of it vLLM's start), to keep the default suite near 15 minutes.

The model is a random Llama with heads of 32 (vLLM's CPU attention runs head_dim 32 and
up); learning on the built-in model is the slow tier's (``test_vllm_default_run``).
"""

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
[evaluator]
threads = 1
[[generators]]
name = "relay"
engine = "lean"
threads = 1
""" + VLLM_GENERATOR
STEPS = 96  # about 5 s of training: enough publishes that vLLM responses straddle some, even
# on a loaded machine where most publishes land between its batches (24 was not, twice in CI)


def test_a_vllm_generator_trains_beside_relays_own(run_root: Path, tmp_path: Path) -> None:
    model = save_random_model(tmp_path / "model", hidden=128)  # 4 heads of 32
    topology = tmp_path / "topology.toml"
    topology.write_text(TOPOLOGY)
    args = [a for a in small_run_overrides(model, run_root, steps=STEPS)
            if not a.startswith("topology.")]
    args += ["rollout.response_length=24", "buffer.max_staleness=4", "buffer.min_generators=2"]
    result = launch([str(topology), str(ROOT / "configs" / "arithmetic-grpo.toml"), *args],
                    timeout_s=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = only_run_dir(run_root)

    groups = list(read_rollout_log(run_dir / "rollouts"))
    by_generator = {g.generator_id for g in groups}
    assert by_generator == {"relay", "vllm"}, by_generator
    vllm_samples = [s for g in groups if g.generator_id == "vllm" for s in g.samples]
    assert all(len(s.versions) == len(s.response_ids) == len(s.logprobs) for s in vllm_samples)
    assert all(float(s.logprobs.max()) <= 0 for s in vllm_samples)
    swapped = [s for s in vllm_samples if len(set(s.versions.tolist())) > 1]
    assert swapped, "no vLLM response saw a weight update while it was generated"
    for s in swapped:  # versions only go forward inside a response
        assert s.versions.tolist() == sorted(s.versions.tolist())

    assert f"trained {STEPS} steps" in result.stdout
