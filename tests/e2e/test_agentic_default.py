"""The agentic default, ``configs/arithmetic-tools-grpo.toml``, as the README runs it, must
visibly learn to use its calculator (slow: ~3-5 minutes, more if the launcher builds the
tool model first).

The acceptance bar of issue 33: held-out accuracy (sampled, the calculator's calls run)
rises by at least ``ACCEPTANCE_LIFT`` (15 points) over the warm start, the mean of the last
three evaluations against the evaluation at step 0, and the tool metrics are logged: the
episodes call the tool more as training goes on.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from relay.configs import CONFIG_DIR, DEFAULT_TOPOLOGY

from .conftest import ACCEPTANCE_LIFT, launch, only_run_dir

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FREE_PORTS = ["topology.buffer.port=0", "topology.learner.weights_port=0",
              "topology.learner.weights_stream_port=0",
              "topology.launcher.metrics_port=0"]


def test_the_agentic_default_learns_to_call_its_calculator(run_root: Path) -> None:
    result = launch([str(DEFAULT_TOPOLOGY), str(CONFIG_DIR / "arithmetic-tools-grpo.toml"),
                     f"trainer.run_dir={run_root}", *FREE_PORTS], timeout_s=1500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = only_run_dir(run_root)
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs(
        [client.get_experiment_by_name("relay-arithmetic-tools").experiment_id])

    def history(name: str) -> list[float]:
        return [m.value for m in sorted(client.get_metric_history(run.info.run_id, name),
                                        key=lambda m: m.step)]

    accuracy = history("eval/accuracy")
    lift = statistics.mean(accuracy[-3:]) - accuracy[0]
    assert lift >= ACCEPTANCE_LIFT, accuracy
    calls = history("rollout/tool_calls_mean")
    assert statistics.mean(calls[-10:]) > statistics.mean(calls[:3]), calls
    assert history("rollout/turns_mean") and history("rollout/tool_latency_p95_s")
    assert history("eval/tool_calls_mean")[-1] > history("eval/tool_calls_mean")[0]
