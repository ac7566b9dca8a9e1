"""relay.launcher.summary: the end-of-run summary names how the run ended, its steps and
wall time, the final and best held-out accuracy, the model folder (or why there is none),
the ``mlflow ui`` command for the run's store and the logs."""

from __future__ import annotations

from pathlib import Path

from relay.launcher.status import StatusBoard
from relay.launcher.summary import accuracy_line, summary
from relay.transport.messages import Metrics


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def finished_board(clock: Clock) -> StatusBoard:
    """A 400-step run evaluated at steps 0, 200 and 400, the best at 200, in 92 s."""
    board = StatusBoard(total_steps=400, interactive=False, now=clock)
    for step, accuracy in ((0, 0.25), (200, 0.8125), (400, 0.75)):
        board.update(Metrics(source="learner", step=step, values={"version": float(step)}))
        board.update(Metrics(source="learner", step=step, values={"eval/accuracy": accuracy}))
    clock.now += 92
    return board


def test_a_finished_run_names_accuracy_time_model_and_the_mlflow_command(
        tmp_path: Path) -> None:
    (tmp_path / "final").mkdir()
    text = summary(finished_board(Clock()), code=0, failed="", run_dir=tmp_path,
                   tracking_uri="", evaluates=True)
    lines = text.splitlines()
    assert lines[0] == "relay launch: run finished"
    assert lines[1].split() == ["steps", "400/400", "in", "01:32", "wall", "time"]
    assert "final 75.0% (step 400), best 81.2% (step 200), first 25.0% (step 0)" in lines[2]
    assert lines[3].endswith(f"{tmp_path / 'final'}/")
    assert lines[4].endswith(f"mlflow ui --backend-store-uri sqlite:///{tmp_path}/mlflow.db")
    assert lines[5].endswith(f"{tmp_path / 'logs'}/")


def test_a_run_without_a_final_model_says_why(tmp_path: Path) -> None:
    board = finished_board(Clock())
    finished = summary(board, code=0, failed="", run_dir=tmp_path, tracking_uri="",
                       evaluates=True)
    assert "no final model was written: the learner wrote none (see " in finished
    failed = summary(board, code=1, failed="learner (learner) exit code 1", run_dir=tmp_path,
                     tracking_uri="", evaluates=True)
    assert failed.startswith("relay launch: run FAILED: learner (learner) exit code 1\n")
    assert "no final model was written: the run failed (learner (learner) exit code 1)" in failed
    stopped = summary(board, code=130, failed="", run_dir=tmp_path, tracking_uri="",
                      evaluates=True)
    assert stopped.startswith("relay launch: run stopped (interrupted)\n")
    assert "no final model was written: the run was stopped before its end" in stopped


def test_a_shared_store_and_a_tracking_server(tmp_path: Path) -> None:
    board = finished_board(Clock())
    shared = summary(board, code=0, failed="", run_dir=tmp_path, evaluates=True,
                     tracking_uri="sqlite:////srv/runs/my store.db")
    assert "mlflow ui --backend-store-uri 'sqlite:////srv/runs/my store.db'" in shared
    server = summary(board, code=0, failed="", run_dir=tmp_path, evaluates=True,
                     tracking_uri="http://mlflow.internal:5000")
    assert "open http://mlflow.internal:5000 (the MLflow tracking server)" in server


def test_accuracy_without_evaluations() -> None:
    assert accuracy_line({}, evaluates=False).startswith("not evaluated")
    assert accuracy_line({}, evaluates=True).startswith("none reported")
    assert accuracy_line({3: 0.5}, evaluates=True) == "final 50.0% (step 3), best 50.0% (step 3)"
    # equals: the earliest is the best
    assert "best 50.0% (step 1)" in accuracy_line({1: 0.5, 2: 0.5, 3: 0.25}, evaluates=True)
