"""The process plan: what runs where, with which command."""

from pathlib import Path

from configs.run_schema import DataConfig, ModelConfig, RunConfig, TrainerConfig
from configs.topology_schema import (
    EvaluatorPlacement,
    GeneratorPlacement,
    LearnerPlacement,
    Topology,
)
from launcher.plan import build_plan

NO_VALIDATION = RunConfig(data=DataConfig(train_files="train.jsonl"), model=ModelConfig(path="m"))


def test_local_plan_is_buffer_torchrun_and_generators() -> None:
    topology = Topology(generators=[GeneratorPlacement(name="a"), GeneratorPlacement(name="b")])
    plan = build_plan(topology, NO_VALIDATION, Path("/runs/x"), python="py")
    assert [(p.name, p.role, p.essential) for p in plan] == [
        ("buffer", "buffer", True), ("learner", "learner", True),
        ("a", "generator", False), ("b", "generator", False)]
    assert plan[0].command_line() == ["py", "-m", "buffer.main", "--run-dir", "/runs/x"]
    assert plan[1].argv[:5] == ["py", "-m", "torch.distributed.run", "--standalone",
                                "--nproc-per-node=1"]
    assert plan[1].argv[-3:] == ["learner.main", "--run-dir", "/runs/x"]
    assert plan[3].argv[-2:] == ["--name", "b"]


def test_remote_hosts_go_through_ssh_with_multi_node_torchrun() -> None:
    topology = Topology(
        learner=LearnerPlacement(hosts=["10.0.0.1", "10.0.0.2"], nproc_per_node=4,
                                 master_port=29600),
        generators=[GeneratorPlacement(name="g", host="10.0.0.3", engine="torch")])
    plan = build_plan(topology, NO_VALIDATION, Path("/runs/x"), python="py")
    learners = [p for p in plan if p.role == "learner"]
    assert [p.name for p in learners] == ["learner@10.0.0.1", "learner@10.0.0.2"]
    assert "--node-rank=1" in learners[1].argv and "--master-addr=10.0.0.1" in learners[1].argv
    assert "--nnodes=2" in learners[0].argv and "--master-port=29600" in learners[0].argv
    command = learners[1].command_line("ssh -p 22", "/srv/relay")
    assert command[:5] == ["ssh", "-p", "22", "-tt", "10.0.0.2"]
    assert command[5].startswith("cd /srv/relay && python3 -m torch.distributed.run")


def test_the_evaluator_runs_only_when_the_run_has_something_to_evaluate() -> None:
    topology = Topology(evaluator=EvaluatorPlacement(host="10.0.0.9"))
    validated = RunConfig(data=DataConfig(train_files="train.jsonl", val_files="test.jsonl"),
                          model=ModelConfig(path="m"))
    plan = build_plan(topology, validated, Path("/runs/x"), python="py")
    (evaluator,) = [p for p in plan if p.role == "evaluator"]
    assert not evaluator.essential and evaluator.host == "10.0.0.9"
    assert evaluator.argv == ["python3", "-m", "generators.evaluator", "--run-dir", "/runs/x"]
    never = RunConfig(data=validated.data, model=validated.model,
                      trainer=TrainerConfig(test_freq=-1, val_before_train=False))
    assert not [p for p in build_plan(topology, never, Path("/runs/x")) if p.role == "evaluator"]
    assert not [p for p in build_plan(topology, NO_VALIDATION, Path("/runs/x"))
                if p.role == "evaluator"]
