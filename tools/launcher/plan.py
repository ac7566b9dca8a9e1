"""From a topology and a run config to the list of processes a run needs.

The plan is pure data: ``relay launch --dry-run`` prints it with ``--dry-run`` and the
supervisor starts it otherwise. Every process reads the resolved configs that the launcher
writes into the run directory (``relay.configs.rundir``), so what runs is exactly what was
printed.

Each process's ``env`` is what the launcher sets for it on top of what it inherits, before
it imports torch: ``CUDA_VISIBLE_DEVICES`` from its topology ``gpus``, PyTorch's
expandable-segments allocator on CUDA, and, for a process behind ssh (which forwards no
environment), the launcher's own ``NCCL_*``, ``CUDA_*`` and allocator settings.

The learner of one host opens no rendezvous port to the network where torch lets it: one
rank starts without torchrun, on a store inside its process (``relay.learner.main``); several
ranks start under torchrun with its c10d rendezvous named at ``127.0.0.1`` (torch's
TCPStore still listens on every interface: it has no option to bind one, see the README's
Security section). Either way its ranks' gloo and NCCL sockets are bound to the loopback
interface (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` = ``lo``, unless set). Learners
of several hosts meet at ``hosts[0]:master_port``. Under Ray the learner is one process per
rank instead (``learner_rank_specs``), each placed by Ray, with torchrun's environment.

Every process runs its module with the working directory off ``sys.path``
(``relay.launcher.child``), so a user's own ``relay/`` or ``learner/`` folder is never imported
in place of Relay's.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal

import msgspec

from relay.configs.gpu_placement import on_cuda
from relay.configs.loader import to_toml
from relay.configs.run_schema import RunConfig
from relay.configs.loader import ConfigError
from relay.configs.rundir import (
    RESOLVED_RUN,
    RESOLVED_TOPOLOGY,
    SOCKET_NAMES,
    longest_socket_path,
    socket_names,
    sockets_dir,
)
from relay.configs.topology_schema import LearnerPlacement, Topology
from relay.launcher.child import module_argv
from relay.transport.endpoints import IPC_PATH_MAX, is_loopback
from relay.transport.security import private_dir

VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
ALLOC_CONF = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
"""PyTorch's allocator settings: the name torch 2.9 and later read first, and the one before
it (still read when the first is absent, with a deprecation warning). The launcher sets both,
so that every torch takes its setting without a warning; a user's value in either wins."""
EXPANDABLE_SEGMENTS = "expandable_segments:True"
"""Segments that grow in place instead of new blocks of every size: less fragmentation of
the learner's changing batch shapes."""
OWN_ALLOCATOR_ENGINES = ("vllm", "sglang")
"""Engines that manage their GPU memory in pools of their own; vLLM's ``CuMemAllocator``
refuses to start under expandable segments (pytorch/pytorch#147851)."""
FORWARDED_PREFIXES = ("NCCL_", "CUDA_")
NOT_FORWARDED = ("CUDA_HOME", "CUDA_PATH", "CUDA_VERSION", "NCCL_VERSION")
"""What this machine has installed (NVIDIA's images set them), not how the run uses it: a
remote host has its own."""
LOOPBACK_INTERFACE = "lo"
ONE_HOST_SOCKETS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""torch's and NCCL's choice of network interface: the ranks of one host talk over the
loopback one."""


class ProcessSpec(msgspec.Struct, kw_only=True, frozen=True):
    """One process of a run: where it runs and the command that starts it.

    ``essential`` processes end the run when they die; a generator is not essential (the
    run goes on with the others while any is alive), nor is the evaluator (training goes
    on without held-out evaluation, and the launcher says so). A reward server
    (``reward_model``) is: the generators cannot score without it.
    """

    name: str
    role: Literal["buffer", "learner", "reward_model", "generator", "evaluator"]
    host: str
    argv: list[str]
    essential: bool = True
    env: dict[str, str] = msgspec.field(default_factory=dict)  # set on top of the inherited

    @property
    def local(self) -> bool:
        return is_loopback(self.host)

    def command_line(self, ssh: str = "ssh", remote_workdir: str = "") -> list[str]:
        """The argv to execute here: the command itself, or wrapped in ssh for a remote host.

        Remote commands get a pseudo-terminal (``ssh -tt``) so that stopping the local ssh
        hangs up, and so ends, the remote process, and their ``env`` through ``env(1)``
        (a local process gets it from the supervisor).
        """
        if self.local:
            return list(self.argv)
        assignments = [f"{name}={value}" for name, value in sorted(self.env.items())]
        remote = shlex.join(["env", *assignments, *self.argv] if assignments else self.argv)
        if remote_workdir:
            remote = f"cd {shlex.quote(remote_workdir)} && {remote}"
        return [*shlex.split(ssh), "-tt", self.host, remote]


def process_env(host: str, device: str, gpus: list[int] | None, *, engine: str = "",
                environ: Mapping[str, str]) -> dict[str, str]:
    """What the launcher sets for a process on ``host`` placed on ``device`` and ``gpus``
    (module docstring), given the launcher's own ``environ``: a variable the user set there
    wins, but for ``CUDA_VISIBLE_DEVICES`` where the topology lists the process's GPUs."""
    env = {} if is_loopback(host) else {
        name: value for name, value in environ.items()
        if (name.startswith(FORWARDED_PREFIXES) and name not in NOT_FORWARDED)
        or name in ALLOC_CONF}
    if gpus is not None:
        env[VISIBLE_DEVICES] = ",".join(str(gpu) for gpu in gpus)
    user_allocator = any(name in environ for name in ALLOC_CONF)
    if on_cuda(device) and engine not in OWN_ALLOCATOR_ENGINES and not user_allocator:
        env |= dict.fromkeys(ALLOC_CONF, EXPANDABLE_SEGMENTS)
    return env


def new_run_dir(run: RunConfig, now: float | None = None) -> Path:
    """``trainer.run_dir/<experiment>-<YYYYmmdd-HHMMSS>`` (relative to the working dir)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return Path(run.trainer.run_dir).resolve() / f"{run.tracking.experiment}-{stamp}"


def build_plan(topology: Topology, run: RunConfig, run_dir: Path,
               python: str = sys.executable,
               environ: Mapping[str, str] = os.environ,
               learner_ranks: bool = False) -> list[ProcessSpec]:
    """The buffer, the learner (one torchrun per learner host, or with ``learner_ranks``
    one process per rank: ``learner_rank_specs``), every reward server
    (``[[reward_models]]``, before the generators that call them), every generator, and the
    evaluator when the run evaluates held-out data; ``environ`` is the launcher's. The
    plan's order is the start order."""
    local_py = python
    remote_py = topology.launcher.remote_python

    def py(host: str) -> str:
        return local_py if is_loopback(host) else remote_py

    check_sockets_dir(topology, run_dir)
    common = ["--run-dir", str(run_dir)]
    plan = [ProcessSpec(name="buffer", role="buffer", host=topology.buffer.host,
                        argv=module_argv(py(topology.buffer.host), "relay.buffer.main", *common),
                        env=process_env(topology.buffer.host, "cpu", None, environ=environ))]
    learner = topology.learner
    if learner_ranks:
        plan += learner_rank_specs(learner, py, common, environ)
    for node_rank, host in enumerate([] if learner_ranks else learner.hosts):
        env = process_env(host, learner.device, learner.gpus, environ=environ)
        if len(learner.hosts) == 1:
            env |= {name: LOOPBACK_INTERFACE for name in ONE_HOST_SOCKETS if name not in environ}
        name = "learner" if len(learner.hosts) == 1 else f"learner@{host}"
        plan.append(ProcessSpec(name=name, role="learner", host=host, env=env,
                                argv=learner_argv(py(host), learner, node_rank,
                                                  run_id=run_dir.name, args=common)))
    judge_engine = run.reward_model.judge.engine if run.reward_model.judge.enable else ""
    for server in topology.reward_models:
        plan.append(ProcessSpec(name=server.name, role="reward_model", host=server.host,
                                argv=module_argv(py(server.host), "relay.generators.reward_server",
                                                 *common, "--name", server.name),
                                env=process_env(server.host, server.device, server.gpus,
                                                engine=judge_engine, environ=environ)))
    for gen in topology.generators:
        plan.append(ProcessSpec(name=gen.name, role="generator", host=gen.host, essential=False,
                                argv=module_argv(py(gen.host), "relay.generators.main", *common,
                                                 "--name", gen.name),
                                env=process_env(gen.host, gen.device, gen.gpus,
                                                engine=gen.engine, environ=environ)))
    if run.evaluates:
        evaluator = topology.evaluator
        plan.append(ProcessSpec(name="evaluator", role="evaluator", host=evaluator.host,
                                essential=False,
                                argv=module_argv(py(evaluator.host), "relay.generators.evaluator",
                                                 *common),
                                env=process_env(evaluator.host, evaluator.device,
                                                evaluator.gpus, engine=evaluator.engine,
                                                environ=environ)))
    return plan


def learner_rank_specs(learner: LearnerPlacement, python: Callable[[str], str],
                       args: list[str], environ: Mapping[str, str]) -> list[ProcessSpec]:
    """The learner as one process per rank, started by a backend that places each rank
    itself (Ray): ``relay.learner.main`` with torch.distributed's environment as torchrun
    sets it (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``),
    meeting at ``hosts[0]:master_port`` (``MASTER_ADDR``, ``MASTER_PORT``). ``hosts`` are the
    nodes the backend placed the learner's ranks on, one entry per node."""
    world = len(learner.hosts) * learner.nproc_per_node
    one_host = all(is_loopback(host) for host in learner.hosts)
    specs = []
    for rank in range(world):
        node, local_rank = divmod(rank, learner.nproc_per_node)
        host = learner.hosts[node]
        env = process_env(host, learner.device, None, environ=environ) | {
            "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(learner.nproc_per_node), "GROUP_RANK": str(node),
            "MASTER_ADDR": learner.hosts[0], "MASTER_PORT": str(learner.master_port)}
        if one_host:
            env |= {name: LOOPBACK_INTERFACE for name in ONE_HOST_SOCKETS if name not in environ}
        specs.append(ProcessSpec(name=f"learner-{rank}", role="learner", host=host, env=env,
                                 argv=module_argv(python(host), "relay.learner.main", *args)))
    return specs


def learner_argv(python: str, learner: LearnerPlacement, node_rank: int, run_id: str,
                 args: list[str]) -> list[str]:
    """The learner of node ``node_rank`` (module docstring): ``relay.learner.main`` itself for
    one rank on one host, else torchrun starting it on each rank (``--no-python``: torchrun
    runs the same working-directory-proof command, ``launcher.child``)."""
    learner_main = module_argv(python, "relay.learner.main", *args)
    hosts = learner.hosts
    if len(hosts) == 1 and learner.nproc_per_node == 1:
        return learner_main
    if len(hosts) == 1:
        rendezvous = ["--nnodes=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
                      f"--rdzv-id={run_id}"]
    else:
        rendezvous = [f"--nnodes={len(hosts)}", f"--node-rank={node_rank}",
                      f"--master-addr={hosts[0]}", f"--master-port={learner.master_port}"]
    return module_argv(python, "torch.distributed.run", *rendezvous,
                       f"--nproc-per-node={learner.nproc_per_node}", "--no-python",
                       *learner_main)


def check_sockets_dir(topology: Topology, run_dir: Path) -> None:
    """``ConfigError`` when the ``security.sockets_dir`` a user set is too long for the
    run's socket paths (the default folder falls back: ``private_sockets``)."""
    folder = sockets_dir(topology, run_dir)
    if folder is None or not topology.security.sockets_dir:
        return
    longest = longest_socket_path(folder, socket_names(topology))
    if longest > IPC_PATH_MAX:
        raise ConfigError("the topology", "security.sockets_dir", (
            f"{folder} is too long for the run's sockets: their paths would be "
            f"{longest} characters, more than a Unix socket takes "
            f"({IPC_PATH_MAX}); name a shorter folder, or leave it empty"))


def private_sockets(topology: Topology, run_dir: Path) -> Topology:
    """Make the run's sockets folder (``relay.configs.rundir.sockets_dir``; nothing to do for a
    run over tcp) 0700 and check that it is this user's and open to no one else
    (``ConfigError`` otherwise). The default folder, ``RUN_DIR/sockets``, gives way to a new
    one from ``tempfile.mkdtemp`` when its socket paths would not fit a Unix socket; the
    topology returned names it (``security.sockets_dir``) for every process to read."""
    check_sockets_dir(topology, run_dir)
    folder = sockets_dir(topology, run_dir)
    if folder is None:
        return topology
    if longest_socket_path(folder, socket_names(topology)) > IPC_PATH_MAX:
        folder = Path(tempfile.mkdtemp(prefix="relay-"))  # 0700, a name nobody held
        topology = msgspec.structs.replace(topology, security=msgspec.structs.replace(
            topology.security, sockets_dir=str(folder)))
    try:
        private_dir(folder)
        owner, mode = folder.stat().st_uid, stat.S_IMODE(folder.stat().st_mode)
        problem = "" if owner == os.getuid() and not mode & 0o077 else \
            f"it is owned by uid {owner} with mode {mode:04o}"
    except OSError as exc:
        problem = str(exc)
    if problem:
        raise ConfigError(str(run_dir / RESOLVED_TOPOLOGY), "security.sockets_dir", (
            f"the run's sockets folder {folder} must be this user's and open to no one "
            f"else, but {problem}: remove it, or name another with "
            "topology.security.sockets_dir"))
    return topology


def remove_sockets(folder: Path, names: tuple[str, ...] = SOCKET_NAMES) -> None:
    """Remove a sockets folder the launcher made outside the run directory
    (``private_sockets``) once the run is over: its socket files (``names``:
    ``relay.configs.rundir.socket_names``), then the folder, which is left where anything
    else is in it."""
    for name in names:
        if (folder / name).is_socket():
            (folder / name).unlink()
    with contextlib.suppress(OSError):
        folder.rmdir()


def write_resolved(topology: Topology, run: RunConfig, run_dir: Path) -> Topology:
    """Write the resolved configs every process of the run reads, with the run's private
    sockets folder made (``private_sockets``); returns the topology written."""
    run_dir.mkdir(parents=True, exist_ok=True)
    topology = private_sockets(topology, run_dir)
    (run_dir / RESOLVED_TOPOLOGY).write_bytes(to_toml(topology))
    (run_dir / RESOLVED_RUN).write_bytes(to_toml(run))
    return topology
