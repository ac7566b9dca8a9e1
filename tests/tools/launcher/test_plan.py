"""The process plan: what runs where, with which command."""

from pathlib import Path

from configs.topology_schema import GeneratorPlacement, LearnerPlacement, Topology
from launcher.plan import build_plan


def test_local_plan_is_buffer_torchrun_and_generators() -> None:
    topology = Topology(generators=[GeneratorPlacement(name="a"), GeneratorPlacement(name="b")])
    plan = build_plan(topology, Path("/runs/x"), python="py")
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
    plan = build_plan(topology, Path("/runs/x"), python="py")
    learners = [p for p in plan if p.role == "learner"]
    assert [p.name for p in learners] == ["learner@10.0.0.1", "learner@10.0.0.2"]
    assert "--node-rank=1" in learners[1].argv and "--master-addr=10.0.0.1" in learners[1].argv
    assert "--nnodes=2" in learners[0].argv and "--master-port=29600" in learners[0].argv
    command = learners[1].command_line("ssh -p 22", "/srv/relay")
    assert command[:5] == ["ssh", "-p", "22", "-tt", "10.0.0.2"]
    assert command[5].startswith("cd /srv/relay && python3 -m torch.distributed.run")
