"""The process plan: what runs where, with which command."""

import subprocess
import sys
from pathlib import Path

import msgspec

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


FAKE_SSH = Path(__file__).parents[2] / "e2e" / "fake_ssh.py"
GPU_TOPOLOGY = Topology(
    learner=LearnerPlacement(nproc_per_node=2, device="cuda", gpus=[2, 3]),
    generators=[GeneratorPlacement(name="lean0", device="cuda", gpus=[0]),
                GeneratorPlacement(name="vllm0", engine="vllm", device="cuda", gpus=[4, 5]),
                GeneratorPlacement(name="cpu0")],
    evaluator=EvaluatorPlacement(device="cuda", gpus=[1]))
EVALUATES = RunConfig(data=DataConfig(train_files="train.jsonl", val_files="test.jsonl"),
                      model=ModelConfig(path="m"))
EXPANDABLE = {"PYTORCH_ALLOC_CONF": "expandable_segments:True",
              "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def test_each_process_sees_only_its_gpus_and_cuda_ones_grow_their_segments() -> None:
    plan = build_plan(GPU_TOPOLOGY, EVALUATES, Path("/runs/x"), python="py", environ={})
    env = {p.name: p.env for p in plan}
    assert env == {
        "buffer": {},
        # torchrun's ranks inherit it: local rank i takes cuda:i, which is gpus[i]
        "learner": {"CUDA_VISIBLE_DEVICES": "2,3", **EXPANDABLE},
        "lean0": {"CUDA_VISIBLE_DEVICES": "0", **EXPANDABLE},
        "vllm0": {"CUDA_VISIBLE_DEVICES": "4,5"},  # vLLM's memory pool refuses expandable
        "cpu0": {},
        "evaluator": {"CUDA_VISIBLE_DEVICES": "1", **EXPANDABLE}}
    learner = next(p for p in plan if p.role == "learner")
    assert "--nproc-per-node=2" in learner.argv


def test_a_users_allocator_setting_is_kept() -> None:
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        plan = build_plan(GPU_TOPOLOGY, NO_VALIDATION, Path("/runs/x"), python="py",
                          environ={name: "max_split_size_mb:128"})
        learner = next(p for p in plan if p.role == "learner")
        assert learner.env == {"CUDA_VISIBLE_DEVICES": "2,3"}  # inherited, not replaced


def test_cuda_without_gpus_sets_the_allocator_but_no_visible_devices() -> None:
    topology = Topology(learner=LearnerPlacement(device="auto"),
                        generators=[GeneratorPlacement(name="g", device="cuda:1")])
    plan = build_plan(topology, NO_VALIDATION, Path("/runs/x"), python="py", environ={})
    assert [p.env for p in plan] == [{}, EXPANDABLE, EXPANDABLE]


def test_the_cpu_default_topology_starts_as_before() -> None:
    """No environment of its own for any process, whatever the launcher's holds, and the
    command lines of before."""
    from configs import DEFAULT_TOPOLOGY, load_topology

    topology = load_topology(DEFAULT_TOPOLOGY)
    launcher_env = {"NCCL_DEBUG": "INFO", "CUDA_VISIBLE_DEVICES": "0", "PATH": "/usr/bin"}
    plan = build_plan(topology, EVALUATES, Path("/runs/x"), python="py", environ=launcher_env)
    assert [p.name for p in plan] == ["buffer", "learner", "gen0", "evaluator"]
    assert all(p.env == {} and p.command_line() == p.argv for p in plan)
    assert plan[1].argv == ["py", "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node=1", "-m", "learner.main", "--run-dir", "/runs/x"]


def test_ssh_forwards_nccl_cuda_and_allocator_variables_but_not_the_cuda_install() -> None:
    topology = Topology(
        learner=LearnerPlacement(hosts=["10.0.0.1", "10.0.0.2"], device="cuda", gpus=[6]),
        generators=[GeneratorPlacement(name="g", host="10.0.0.3")])
    launcher_env = {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "INFO", "CUDA_HOME": "/opt/c",
                    "NCCL_VERSION": "2.27.3",
                    "CUDA_VISIBLE_DEVICES": "0,1", "PYTORCH_CUDA_ALLOC_CONF": "x:1",
                    "HOME": "/home/me"}
    plan = build_plan(topology, NO_VALIDATION, Path("/runs/x"), python="py",
                      environ=launcher_env)
    learner = next(p for p in plan if p.name == "learner@10.0.0.2")
    assert learner.env == {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "INFO",
                           "CUDA_VISIBLE_DEVICES": "6", "PYTORCH_CUDA_ALLOC_CONF": "x:1"}
    command = learner.command_line("ssh", "/srv/relay")
    assert command[-1].startswith(
        "cd /srv/relay && env CUDA_VISIBLE_DEVICES=6 NCCL_DEBUG=INFO NCCL_SOCKET_IFNAME=eth0 "
        "PYTORCH_CUDA_ALLOC_CONF=x:1 python3 -m torch.distributed.run ")
    generator = next(p for p in plan if p.name == "g")  # on the CPU: the launcher's as they are
    assert generator.env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_a_remote_process_gets_its_environment_through_the_fake_ssh(tmp_path: Path) -> None:
    """The fake ssh here runs under ``env -i``, as sshd starts a remote command with none of
    the caller's environment: what the process sees came on its command line."""
    names = ("CUDA_VISIBLE_DEVICES", "NCCL_DEBUG", "PYTORCH_ALLOC_CONF", "CUDA_HOME")
    topology = Topology(generators=[GeneratorPlacement(name="g", host="gen-host.example",
                                                       device="cuda", gpus=[3])])
    plan = build_plan(topology, NO_VALIDATION, tmp_path, python="py",
                      environ={"NCCL_DEBUG": "WARN", "CUDA_HOME": "/opt/cuda"})
    generator = next(p for p in plan if p.name == "g")
    probe = msgspec.structs.replace(generator, argv=[
        sys.executable, "-c", f"import os; print([os.environ.get(n) for n in {names!r}])"])
    ssh = f"env -i FAKE_SSH_LOG={tmp_path / 'ssh.log'} {sys.executable} {FAKE_SSH}"
    result = subprocess.run(probe.command_line(ssh), capture_output=True, text=True,
                            timeout=60, check=True)
    assert result.stdout.strip() == str(["3", "WARN", "expandable_segments:True", None])
    assert (tmp_path / "ssh.log").read_text().startswith("gen-host.example\tenv ")
