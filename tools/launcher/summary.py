"""The end-of-run summary the launcher prints: how the run ended, its steps and wall time,
its held-out accuracy, where the trained model is and how to look at its metrics.

Everything comes from what the launcher already has: the status board (the steps it saw,
the held-out accuracy the learner reported for each evaluated step, the wall time), how
the run ended (the launcher's exit code and the process that failed it), the run
directory (``final/``, the model the learner writes at its last step) and the tracking
config (the MLflow store: ``tracking.uri``, or the run
directory's own ``mlflow.db``).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from relay.configs.rundir import FINAL_MODEL
from relay.launcher.status import StatusBoard, clock


def accuracy_line(accuracy: dict[int, float], evaluates: bool) -> str:
    """``final 81.2% (step 400), best 83.0% (step 350), first 42.0% (step 0)``: the last
    evaluated step's held-out accuracy, the best (the earliest of equals) and the first."""
    if not accuracy:
        return ("none reported (the evaluator reported no step)" if evaluates
                else "not evaluated (no data.val_files, or neither trainer.test_freq nor "
                     "trainer.val_before_train)")
    steps = sorted(accuracy)
    best = max(steps, key=lambda step: (accuracy[step], -step))
    parts = [f"final {accuracy[steps[-1]]:.1%} (step {steps[-1]})",
             f"best {accuracy[best]:.1%} (step {best})"]
    if len(steps) > 1:
        parts.append(f"first {accuracy[steps[0]]:.1%} (step {steps[0]})")
    return ", ".join(parts)


def model_line(run_dir: Path, code: int, failed: str) -> str:
    """The final model's folder, or why there is none."""
    final = run_dir / FINAL_MODEL
    if final.is_dir():
        return f"{final}/"
    if code == 0:
        why = f"the learner wrote none (see {run_dir / 'logs' / 'learner.log'})"
    elif failed:
        why = f"the run failed ({failed}) before its end"
    else:
        why = "the run was stopped before its end"
    return f"no final model was written: {why}"


def metrics_line(tracking_uri: str, run_dir: Path) -> str:
    """How to look at the run's metrics: the ``mlflow ui`` command for a local store, the
    address for a tracking server."""
    from relay.learner.tracking import default_uri  # imports mlflow: only here, at the end

    uri = tracking_uri or default_uri(run_dir)
    if uri.startswith(("http://", "https://")):
        return f"open {uri} (the MLflow tracking server)"
    return f"mlflow ui --backend-store-uri {shlex.quote(uri)}"


def summary(board: StatusBoard, *, code: int, failed: str, run_dir: Path, tracking_uri: str,
            evaluates: bool) -> str:
    """The summary, one item a line, of a run that ended with exit code ``code``; ``failed``
    names the process that failed it ("" when none did: it finished, or Ctrl-C)."""
    run_dir = run_dir.resolve()  # paths to copy from any directory
    if code == 0:
        head = "run finished"
    elif failed:
        head = f"run FAILED: {failed}"
    else:
        head = "run stopped (interrupted)"
    rows = [("steps", f"{board.step}/{board.total_steps} in {clock(board.elapsed_s())} "
                      "wall time"),
            ("held-out accuracy", accuracy_line(board.accuracy, evaluates)),
            ("model", model_line(run_dir, code, failed)),
            ("metrics", metrics_line(tracking_uri, run_dir)),
            ("logs", f"{run_dir / 'logs'}/")]
    width = max(len(name) for name, _ in rows)
    return "\n".join([f"relay launch: {head}"] +
                     [f"  {name.ljust(width)}  {text}" for name, text in rows])
