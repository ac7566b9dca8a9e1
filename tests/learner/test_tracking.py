"""The learner's trackers: MLflow takes verl's metric names, which it refuses as they are,
and gets verl's aliases beside Relay's names; wandb (offline), TensorBoard and SwanLab
(offline) write their own files; runs sharing one SQLite store are found side by side under
one experiment, with no ``mlruns/`` in the working directory."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from relay.configs.run_schema import TrackingConfig
from relay.learner.tracking import Tracker
from relay.transport.messages import ValGeneration


def test_verls_at_names_are_logged_with_at_spelled_out(tmp_path: Path) -> None:
    tracker = Tracker(uri="", experiment="verl-names", run_name="", run_dir=tmp_path)
    try:
        tracker.log_metrics({"val-core/src/acc/mean@4": 0.5, "eval/accuracy": 0.25}, step=3)
    finally:
        tracker.close(ok=True)
    logged = MlflowClient(tracker.uri).get_run(tracker.run_id).data.metrics
    assert logged == {"val-core/src/acc/mean_at_4": 0.5, "eval/accuracy": 0.25}


def test_wandb_offline_and_tensorboard_write_their_files(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb", reason="the trackers extra: pip install -e .[trackers]")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = Tracker(uri="", experiment="verl-names", run_name="r1", run_dir=tmp_path,
                      loggers=["console", "mlflow", "wandb", "tensorboard"])
    try:
        tracker.log_config(TrackingConfig(run_name="r1"), [])
        tracker.log_metrics({"val-core/src/acc/mean@4": 0.25}, step=1)
        tracker.log_metrics({"actor/loss": 0.1}, step=3)
        tracker.log_metrics({"val-core/src/acc/mean@4": 0.5}, step=2)  # a late evaluation
        tracker.log_generations(2, [ValGeneration(input="1+1=", output="2", score=1.0)])
        (wandb_run,) = [sink.run for sink in tracker.sinks if hasattr(sink, "run")]
        assert wandb_run.summary["val-core/src/acc/mean@4"] == 0.5  # not dropped
        assert wandb_run.summary["trainer/step"] == 2
        wandb_keys = set(wandb_run.summary.keys())
        assert wandb_run.config["run_name"] == "r1"  # the config, flattened
    finally:
        tracker.close(ok=True)
    (run,) = (tmp_path / "wandb").glob("offline-run-*")  # for `wandb sync`
    (records,) = run.glob("run-*.wandb")
    assert b"val-core/src/acc/mean@4" in records.read_bytes()
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("val-core/src/acc/mean@4")
    assert [(s.step, s.value) for s in scalars] == [(1, 0.25), (2, 0.5)]
    assert "| 1+1= | 2 | 1 |" in events.Tensors("val/generations/text_summary")[0] \
        .tensor_proto.string_val[0].decode()
    assert "val/generations" in wandb_keys


def test_swanlab_offline_writes_its_run_under_the_run_dir(tmp_path: Path) -> None:
    pytest.importorskip("swanlab", reason="the trackers extra: pip install -e .[trackers]")
    tracker = Tracker(uri="", experiment="verl-project", run_name="verl-experiment",
                      run_dir=tmp_path, loggers=["console", "mlflow", "swanlab"])
    try:
        tracker.log_config(TrackingConfig(run_name="verl-experiment"), [])
        tracker.log_metrics({"val-core/src/acc/mean@4": 0.25}, step=1)
        tracker.log_generations(1, [ValGeneration(input="1+1=", output="2", score=1.0)])
    finally:
        tracker.close(ok=True)
    (run,) = (tmp_path / "swanlog").glob("run-*")  # for `swanlab sync`
    (records,) = run.glob("run-*.swanlab")
    logged = records.read_bytes()
    # the project and experiment names, and verl's metric name with its "@"
    assert b"verl-project" in logged and b"verl-experiment" in logged
    assert b"val-core/src/acc/mean@4" in logged
    assert "run_name" in (run / "files" / "config.yaml").read_text()  # the config, flattened
    (table,) = (run / "media" / "echarts").glob("*.json")
    assert "1+1=" in table.read_text()


def test_held_out_generations_are_an_mlflow_table(tmp_path: Path) -> None:
    tracker = Tracker(uri="", experiment="generations", run_name="", run_dir=tmp_path)
    try:
        tracker.log_generations(4, [ValGeneration(input="2+2=", output="it is 4", score=1.0),
                                    ValGeneration(input="3+3=", output="it is 7", score=0.0)])
    finally:
        tracker.close(ok=True)
    table = mlflow.load_table("val_generations/step-000004.json", run_ids=[tracker.run_id])
    assert table.to_dict("list") == {"step": [4, 4], "input": ["2+2=", "3+3="],
                                     "output": ["it is 4", "it is 7"], "score": [1.0, 0.0]}


def test_the_default_store_keeps_its_artifacts_in_the_run_dir(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow's database stores put artifacts in ./mlruns of the working directory: a
    user's project folder collected every run's configs."""
    run_dir, project = tmp_path / "run", tmp_path / "project"
    run_dir.mkdir()
    project.mkdir()
    monkeypatch.chdir(project)
    config = run_dir / "run.toml"
    config.write_text("[trainer]\n")
    tracker = Tracker(uri="", experiment="artifacts", run_name="", run_dir=run_dir)
    try:
        tracker.log_config(TrackingConfig(), [config])
    finally:
        tracker.close(ok=True)
    assert list(project.iterdir()) == []
    assert [p.name for p in (run_dir / "mlartifacts").rglob("run.toml")] == ["run.toml"]
    artifacts = MlflowClient(tracker.uri).list_artifacts(tracker.run_id, "config")
    assert [a.path for a in artifacts] == ["config/run.toml"]


def test_verls_aliases_are_logged_beside_relays_names(tmp_path: Path) -> None:
    tracker = Tracker(uri="", experiment="aliases", run_name="", run_dir=tmp_path)
    try:
        tracker.log_metrics({"rollout/reward_mean": 0.5, "actor/clip_frac": 0.1}, step=1)
    finally:
        tracker.close(ok=True)
    logged = MlflowClient(tracker.uri).get_run(tracker.run_id).data.metrics
    assert logged == {"rollout/reward_mean": 0.5, "critic/score/mean": 0.5,
                      "critic/rewards/mean": 0.5, "actor/clip_frac": 0.1,
                      "actor/pg_clipfrac": 0.1}


def test_runs_sharing_one_store_are_found_under_one_experiment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs, project = tmp_path / "runs", tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    uri = f"sqlite:///{runs / 'mlflow.db'}"  # sqlite:////abs/runs/mlflow.db
    ids = {}
    for name, reward in (("a", 0.25), ("b", 0.75)):
        run_dir = runs / name
        run_dir.mkdir(parents=True)
        config = run_dir / "run.toml"
        config.write_text("[trainer]\n")
        tracker = Tracker(uri=uri, experiment="compare", run_name=name, run_dir=run_dir)
        try:
            tracker.log_config(TrackingConfig(), [config])
            tracker.log_metrics({"rollout/reward_mean": reward}, step=1)
        finally:
            tracker.close(ok=True)
        ids[name] = tracker.run_id
    client = MlflowClient(uri)
    found = client.search_runs([client.get_experiment_by_name("compare").experiment_id])
    assert {run.info.run_name: run.info.run_id for run in found} == ids
    assert {run.info.run_name: run.data.tags["relay.run_dir"] for run in found} == {
        name: str(runs / name) for name in ids}
    assert {run.info.run_name: run.data.metrics["critic/score/mean"] for run in found} == {
        "a": 0.25, "b": 0.75}
    assert list(project.iterdir()) == []  # no ./mlruns
    assert sorted(p.relative_to(runs).parts[1] for p in
                  (runs / "mlartifacts").rglob("run.toml")) == sorted(ids.values())
