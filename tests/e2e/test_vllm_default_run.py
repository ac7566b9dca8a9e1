"""The embedded default with a vLLM generator beside Relay's own must learn as the default
run does (slow: ~5-8 minutes): held-out accuracy up by at least ``ACCEPTANCE_LIFT``, the
bar of ``test_default_run``, with a real share of the training groups from vLLM."""

from __future__ import annotations

import importlib.util
import statistics
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from relay.buffer.rollout_log import read_rollout_log
from relay.configs import DEFAULT_RUN, DEFAULT_TOPOLOGY

from .conftest import ACCEPTANCE_LIFT, VLLM_GENERATOR, launch, only_run_dir

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed (the `vllm` extra; tools/with-venv installs it by default)")]

FREE_PORTS = ["topology.buffer.port=0", "topology.learner.weights_port=0",
              "topology.learner.weights_stream_port=0", "topology.launcher.metrics_port=0"]


def test_the_default_run_learns_with_a_vllm_generator(run_root: Path, tmp_path: Path) -> None:
    topology = tmp_path / "topology.toml"
    topology.write_text(DEFAULT_TOPOLOGY.read_text() + VLLM_GENERATOR)
    result = launch([str(topology), str(DEFAULT_RUN), f"trainer.run_dir={run_root}",
                     "buffer.min_generators=2", *FREE_PORTS], timeout_s=1500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = only_run_dir(run_root)

    groups = [g.generator_id for g in read_rollout_log(run_dir / "rollouts")]
    # vLLM's share depends on how the two generators share the cores: that it worked to
    # the end is what counts (its groups in the last third of those trained on)
    last_third = groups[len(groups) * 2 // 3:]
    assert "vllm" in last_third, f"vLLM made {groups.count('vllm')} of {len(groups)} groups, " \
        f"none of the last {len(last_third)}"

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("relay-arithmetic").experiment_id])
    history = sorted(client.get_metric_history(run.info.run_id, "eval/accuracy"),
                     key=lambda m: m.step)
    warm_start = history[0].value
    trained = statistics.mean(m.value for m in history[-3:])
    assert trained - warm_start >= ACCEPTANCE_LIFT, [(m.step, m.value) for m in history]
