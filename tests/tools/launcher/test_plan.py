"""The process plan: what runs where, with which command; the run directory the launcher
writes, whose sockets folder (a run without CURVE) is private."""

import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from relay.configs import DEFAULT_RUN, DEFAULT_TOPOLOGY, ConfigError
from relay.configs.checks import load_run_config, load_topology
from relay.configs.rundir import RunContext, load_run_dir, longest_socket_path
from relay.configs.run_schema import DataConfig, ModelConfig, RunConfig, TrainerConfig
from relay.configs.topology_schema import (
    EvaluatorPlacement,
    GeneratorPlacement,
    LauncherSettings,
    LearnerPlacement,
    Security,
    Topology,
)
from relay.launcher.child import module_argv
from relay.launcher.plan import build_plan, private_sockets, remove_sockets, write_resolved
from relay.transport.endpoints import IPC_PATH_MAX, split_endpoint
from relay.transport.messages import Ack, Heartbeat, Message
from relay.transport.sockets import Client, Peer, Server, ServerThread

NO_VALIDATION = RunConfig(data=DataConfig(train_files="train.jsonl"), model=ModelConfig(path="m"))
SSH = LauncherSettings(backend="ssh")  # processes on other hosts


def test_local_plan_is_buffer_learner_and_generators() -> None:
    topology = Topology(generators=[GeneratorPlacement(name="a"), GeneratorPlacement(name="b")])
    plan = build_plan(topology, NO_VALIDATION, Path("/runs/x"), python="py")
    assert [(p.name, p.role, p.essential) for p in plan] == [
        ("buffer", "buffer", True), ("learner", "learner", True),
        ("a", "generator", False), ("b", "generator", False)]
    assert plan[0].command_line() == module_argv("py", "relay.buffer.main", "--run-dir", "/runs/x")
    assert plan[1].argv == module_argv("py", "relay.learner.main", "--run-dir", "/runs/x")  # one rank
    assert plan[3].argv[-2:] == ["--name", "b"]


def test_one_hosts_ranks_meet_on_loopback_and_never_by_standalone() -> None:
    """``--standalone`` names its store ``localhost:0``, found by host name; Relay names
    127.0.0.1 and binds the ranks' own gloo and NCCL sockets to the loopback interface."""
    topology = Topology(learner=LearnerPlacement(nproc_per_node=4))
    (learner,) = [p for p in build_plan(topology, NO_VALIDATION, Path("/runs/x"), python="py",
                                        environ={}) if p.role == "learner"]
    assert learner.argv == module_argv(
        "py", "torch.distributed.run", "--nnodes=1", "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:0", "--rdzv-id=x", "--nproc-per-node=4", "--no-python",
        *module_argv("py", "relay.learner.main", "--run-dir", "/runs/x"))
    assert learner.env == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    (mine,) = [p for p in build_plan(topology, NO_VALIDATION, Path("/runs/x"), python="py",
                                     environ={"NCCL_SOCKET_IFNAME": "ib0"})
               if p.role == "learner"]
    assert mine.env == {"GLOO_SOCKET_IFNAME": "lo"}  # the user's choice is inherited


def test_remote_hosts_go_through_ssh_with_multi_node_torchrun() -> None:
    topology = Topology(
        learner=LearnerPlacement(hosts=["10.0.0.1", "10.0.0.2"], nproc_per_node=4,
                                 master_port=29600),
        generators=[GeneratorPlacement(name="g", host="10.0.0.3", engine="torch")],
        launcher=SSH)
    plan = build_plan(topology, NO_VALIDATION, Path("/runs/x"), python="py")
    learners = [p for p in plan if p.role == "learner"]
    assert [p.name for p in learners] == ["learner@10.0.0.1", "learner@10.0.0.2"]
    assert "--node-rank=1" in learners[1].argv and "--master-addr=10.0.0.1" in learners[1].argv
    assert "--nnodes=2" in learners[0].argv and "--master-port=29600" in learners[0].argv
    command = learners[1].command_line("ssh -p 22", "/srv/relay")
    assert command[:5] == ["ssh", "-p", "22", "-tt", "10.0.0.2"]
    torchrun = shlex.join(module_argv("python3", "torch.distributed.run"))
    assert command[5].startswith(f"cd /srv/relay && {torchrun}")


def test_the_evaluator_runs_only_when_the_run_has_something_to_evaluate() -> None:
    topology = Topology(evaluator=EvaluatorPlacement(host="10.0.0.9"), launcher=SSH)
    validated = RunConfig(data=DataConfig(train_files="train.jsonl", val_files="test.jsonl"),
                          model=ModelConfig(path="m"))
    plan = build_plan(topology, validated, Path("/runs/x"), python="py")
    (evaluator,) = [p for p in plan if p.role == "evaluator"]
    assert not evaluator.essential and evaluator.host == "10.0.0.9"
    assert evaluator.argv == module_argv("python3", "relay.generators.evaluator",
                                             "--run-dir", "/runs/x")
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
ONE_HOST = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}  # a one-host learner


def test_each_process_sees_only_its_gpus_and_cuda_ones_grow_their_segments() -> None:
    plan = build_plan(GPU_TOPOLOGY, EVALUATES, Path("/runs/x"), python="py", environ={})
    env = {p.name: p.env for p in plan}
    assert env == {
        "buffer": {},
        # torchrun's ranks inherit it: local rank i takes cuda:i, which is gpus[i]
        "learner": {"CUDA_VISIBLE_DEVICES": "2,3", **EXPANDABLE, **ONE_HOST},
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
        assert learner.env == {"CUDA_VISIBLE_DEVICES": "2,3", **ONE_HOST}  # not replaced


def test_cuda_without_gpus_sets_the_allocator_but_no_visible_devices() -> None:
    topology = Topology(learner=LearnerPlacement(device="auto"),
                        generators=[GeneratorPlacement(name="g", device="cuda:1")])
    plan = build_plan(topology, NO_VALIDATION, Path("/runs/x"), python="py", environ={})
    assert [p.env for p in plan] == [{}, EXPANDABLE | ONE_HOST, EXPANDABLE]


def test_the_cpu_default_topology_starts_as_before() -> None:
    """No environment of its own for any process but the learner's loopback sockets,
    whatever the launcher's holds, and the command lines of before but the learner's: one
    rank, started without torchrun."""
    from relay.configs import DEFAULT_TOPOLOGY, load_topology

    topology = load_topology(DEFAULT_TOPOLOGY)
    launcher_env = {"NCCL_DEBUG": "INFO", "CUDA_VISIBLE_DEVICES": "0", "PATH": "/usr/bin"}
    plan = build_plan(topology, EVALUATES, Path("/runs/x"), python="py", environ=launcher_env)
    assert [p.name for p in plan] == ["buffer", "learner", "gen0", "evaluator"]
    assert [p.env for p in plan] == [{}, ONE_HOST, {}, {}]
    assert all(p.command_line() == p.argv for p in plan)
    assert plan[1].argv == module_argv("py", "relay.learner.main", "--run-dir", "/runs/x")


def test_ssh_forwards_nccl_cuda_and_allocator_variables_but_not_the_cuda_install() -> None:
    topology = Topology(
        learner=LearnerPlacement(hosts=["10.0.0.1", "10.0.0.2"], device="cuda", gpus=[6]),
        generators=[GeneratorPlacement(name="g", host="10.0.0.3")], launcher=SSH)
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
        "PYTORCH_CUDA_ALLOC_CONF=x:1 " + shlex.join(module_argv("python3", "torch.distributed.run")))
    generator = next(p for p in plan if p.name == "g")  # on the CPU: the launcher's as they are
    assert generator.env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_a_remote_process_gets_its_environment_through_the_fake_ssh(tmp_path: Path) -> None:
    """The fake ssh here runs under ``env -i``, as sshd starts a remote command with none of
    the caller's environment: what the process sees came on its command line."""
    names = ("CUDA_VISIBLE_DEVICES", "NCCL_DEBUG", "PYTORCH_ALLOC_CONF", "CUDA_HOME")
    topology = Topology(generators=[GeneratorPlacement(name="g", host="gen-host.example",
                                                       device="cuda", gpus=[3])], launcher=SSH)
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


def say_who(_msg: Message, peer: Peer) -> Message:
    return Ack(detail="heard")


def test_a_run_directory_the_launcher_wrote_serves_in_a_private_folder(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    topology = write_resolved(load_topology(DEFAULT_TOPOLOGY), load_run_config(DEFAULT_RUN),
                              run_dir)
    folder = run_dir / "sockets"
    assert topology.security.sockets_dir == ""  # the default folder fits: nothing to name
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.stat().st_uid == os.getuid()
    ctx = load_run_dir(run_dir)  # what every process of the run reads back
    server = Server(ctx.buffer_endpoint, say_who)
    with ServerThread(server, poll_s=0.01):
        client = Client(ctx.buffer_endpoint)
        try:
            assert client.request(Heartbeat(generator_id="g", version=0), 5.0) == \
                Ack(detail="heard")
        finally:
            client.close()
    assert split_endpoint(server.endpoint)[0] == "ipc"


def test_a_folder_open_to_others_is_tightened_and_a_foreign_one_refused(
        tmp_path: Path) -> None:
    topology = load_topology(DEFAULT_TOPOLOGY)
    open_folder = tmp_path / "open" / "sockets"
    open_folder.mkdir(parents=True)
    open_folder.chmod(0o777)
    private_sockets(topology, tmp_path / "open")
    assert stat.S_IMODE(open_folder.stat().st_mode) == 0o700
    foreign = tmp_path / "foreign" / "sockets"
    foreign.mkdir(parents=True)
    if os.getuid() != 0:
        pytest.skip("making a folder another user's needs root")
    os.chown(foreign, 4242, 4242)
    with pytest.raises(ConfigError) as caught:
        private_sockets(topology, tmp_path / "foreign")
    assert caught.value.key == "security.sockets_dir"
    assert "owned by uid 4242" in str(caught.value) and str(foreign) in str(caught.value)


def test_a_run_directory_too_deep_for_a_unix_socket_gets_a_private_folder_of_its_own(
        tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 100)
    topology = private_sockets(load_topology(DEFAULT_TOPOLOGY), deep)
    folder = Path(topology.security.sockets_dir)
    assert folder.is_dir() and folder != deep / "sockets"
    assert longest_socket_path(folder) <= IPC_PATH_MAX
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    ctx = RunContext(run_dir=deep, topology=topology, run=load_run_config(DEFAULT_RUN))
    assert ctx.buffer_endpoint == f"ipc://{folder}/buffer"
    Server(ctx.buffer_endpoint, say_who).close()  # ZeroMQ leaves the socket file behind
    assert (folder / "buffer").is_socket()
    remove_sockets(folder)  # what the launcher does at the end of the run
    assert not folder.exists()
    named = msgspec.structs.replace(topology, security=Security(sockets_dir=str(deep)))
    with pytest.raises(ConfigError, match="too long for the run's sockets"):
        private_sockets(named, deep)  # a folder the user named is never replaced
