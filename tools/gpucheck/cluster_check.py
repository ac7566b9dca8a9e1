"""Check C: ``tools/launch-cluster.py`` with the learner, a generator and the evaluator on
the device, ``STEPS`` steps of a random small model on the shipped arithmetic task.

Tracking goes to ``sqlite:`` (MLflow's SQLAlchemy store), the URI a run defaults to: on the
GPU machine mlflow-skinny carries that store, with sqlalchemy and alembic beside it
(``gpucheck.wheels``). Passes when the launcher exits 0, every step logged a finite
``actor/loss``, the learner published at least version 1 and held-out evaluations were
logged (``eval/accuracy``, finite). The reward is ``spread_reward``'s, so gradients flow
(``actor/grad_norm`` above 0 on some step).
"""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpucheck.report import CheckResult

STEPS = 30
TEST_FREQ = 10
EXPERIMENT = "gpu-check"
OUTPUT_TAIL_CHARS = 3000
REWARD = Path(__file__).with_name("spread_reward.py")
STOP_WAIT_S = 60.0  # for the launcher to stop its processes after a Ctrl-C


def topology(device: str) -> str:
    """One learner rank, one lean generator and the evaluator, on ``device`` (``cuda``:
    all on GPU 0, which they share: none lists ``gpus``), free ports, one thread each."""
    learner = "cuda" if device == "cuda" else "cpu"
    engine = "cuda:0" if device == "cuda" else "cpu"
    return (f'[buffer]\nport = 0\n\n'
            f'[learner]\ndevice = "{learner}"\nweights_port = 0\nweights_stream_port = 0\n'
            f'threads = 1\n\n'
            f'[[generators]]\nname = "gen0"\nengine = "lean"\ndevice = "{engine}"\n'
            f'threads = 1\n\n'
            f'[evaluator]\nengine = "lean"\ndevice = "{engine}"\nthreads = 1\n\n'
            f'[launcher]\nmetrics_port = 0\n')


def run_overrides(model_dir: Path, work: Path, device: str) -> list[str]:
    """A short run: 4 prompts x 4 samples of 8 tokens a step, bf16 on a GPU (fp32, the
    default run's, on the CPU), evaluated every ``TEST_FREQ`` steps."""
    return [f"model.path={model_dir}",
            f"model.dtype={'bfloat16' if device == 'cuda' else 'float32'}",
            f"trainer.total_training_steps={STEPS}", f"trainer.test_freq={TEST_FREQ}",
            f"trainer.run_dir={work / 'runs'}", "data.train_batch_size=4", "rollout.n=4",
            "rollout.response_length=8", "rollout.prompts_per_lease=2",
            f"custom_reward_function.path={REWARD}",
            f"tracking.uri={tracking_uri(work)}", f"tracking.experiment={EXPERIMENT}"]


def tracking_uri(work: Path) -> str:
    return f"sqlite:///{work / 'mlflow.db'}"


def cluster_checks(root: Path, model_dir: Path, work: Path, device: str,
                   timeout_s: float) -> list[CheckResult]:
    name = "C/launch-cluster"
    topology_file = work / "topology.toml"
    topology_file.write_text(topology(device))
    command = [sys.executable, str(root / "tools" / "launch-cluster.py"), str(topology_file),
               *run_overrides(model_dir, work, device)]
    log = work / "launch-cluster.log"
    began = time.monotonic()
    with open(log, "w") as out:
        launcher = subprocess.Popen(command, cwd=root, stdout=out, stderr=subprocess.STDOUT)
        try:
            code = launcher.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            launcher.send_signal(signal.SIGINT)  # the launcher's Ctrl-C: it stops the run
            try:
                launcher.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.wait()
            code = None
    seconds = time.monotonic() - began
    output = log.read_text(errors="replace")[-OUTPUT_TAIL_CHARS:]
    if code != 0:
        verdict = f"no exit within {timeout_s:g} s" if code is None else f"exit {code}"
        return [CheckResult.failure(name, f"{verdict}:\n{output}", seconds=round(seconds, 1))]
    return [_tracked(name, tracking_uri(work), seconds, output)]


def _tracked(name: str, uri: str, seconds: float, output: str) -> CheckResult:
    """The verdict on what the run logged to MLflow (module docstring)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id]) if experiment else []
    if len(runs) != 1:
        return CheckResult.failure(name, f"{len(runs)} MLflow runs in {uri}:\n{output}")
    run_id = runs[0].info.run_id

    def history(metric: str) -> list[float]:
        return [m.value for m in sorted(client.get_metric_history(run_id, metric),
                                        key=lambda m: m.step)]

    losses, norms = history("actor/loss"), history("actor/grad_norm")
    versions, accuracy = history("version"), history("eval/accuracy")
    numbers = {"seconds": round(seconds, 1), "seconds_per_step": round(seconds / STEPS, 2),
               "steps_logged": len(losses), "version": max(versions, default=None),
               "evaluations": len(accuracy), "last_loss": losses[-1] if losses else None,
               "max_grad_norm": max(norms, default=None),
               "last_eval_accuracy": accuracy[-1] if accuracy else None}
    problems = []
    if len(losses) != STEPS or not all(math.isfinite(v) for v in losses + norms):
        problems.append(f"{len(losses)} actor/loss values for {STEPS} steps; losses and "
                        f"gradient norms finite: {all(math.isfinite(v) for v in losses + norms)}")
    if not any(v > 0 for v in norms):
        problems.append("no step had a gradient (actor/grad_norm is never above 0)")
    if not versions or max(versions) < 1:
        problems.append("no weight version was published")
    if not accuracy or not all(math.isfinite(v) for v in accuracy):
        problems.append(f"eval/accuracy: {accuracy}")
    return CheckResult(name=name, passed=not problems, numbers=numbers,
                       error="; ".join(problems) or None)
