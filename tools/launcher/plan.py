"""From a topology and a run config to the list of processes a run needs.

The plan is pure data: ``tools/launch-cluster.py`` prints it with ``--dry-run`` and the
supervisor starts it otherwise. Every process reads the resolved configs that the launcher
writes into the run directory (``configs.rundir``), so what runs is exactly what was
printed.
"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path
from typing import Literal

import msgspec

from configs.loader import to_toml
from configs.run_schema import RunConfig
from configs.rundir import RESOLVED_RUN, RESOLVED_TOPOLOGY
from configs.topology_schema import Topology
from transport.endpoints import is_loopback


class ProcessSpec(msgspec.Struct, kw_only=True, frozen=True):
    """One process of a run: where it runs and the command that starts it.

    ``essential`` processes end the run when they die; a generator is not essential (the
    run goes on with the others while any is alive), nor is the evaluator (training goes
    on without held-out evaluation, and the launcher says so).
    """

    name: str
    role: Literal["buffer", "learner", "generator", "evaluator"]
    host: str
    argv: list[str]
    essential: bool = True

    @property
    def local(self) -> bool:
        return is_loopback(self.host)

    def command_line(self, ssh: str = "ssh", remote_workdir: str = "") -> list[str]:
        """The argv to execute here: the command itself, or wrapped in ssh for a remote host.

        Remote commands get a pseudo-terminal (``ssh -tt``) so that stopping the local ssh
        hangs up, and so ends, the remote process.
        """
        if self.local:
            return list(self.argv)
        remote = shlex.join(self.argv)
        if remote_workdir:
            remote = f"cd {shlex.quote(remote_workdir)} && {remote}"
        return [*shlex.split(ssh), "-tt", self.host, remote]


def new_run_dir(run: RunConfig, now: float | None = None) -> Path:
    """``trainer.run_dir/<experiment>-<YYYYmmdd-HHMMSS>`` (relative to the working dir)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return Path(run.trainer.run_dir).resolve() / f"{run.tracking.experiment}-{stamp}"


def build_plan(topology: Topology, run: RunConfig, run_dir: Path,
               python: str = sys.executable) -> list[ProcessSpec]:
    """The buffer, the learner (one torchrun per learner host), every generator, and the
    evaluator when the run evaluates held-out data."""
    local_py = python
    remote_py = topology.launcher.remote_python

    def py(host: str) -> str:
        return local_py if is_loopback(host) else remote_py

    common = ["--run-dir", str(run_dir)]
    plan = [ProcessSpec(name="buffer", role="buffer", host=topology.buffer.host,
                        argv=[py(topology.buffer.host), "-m", "buffer.main", *common])]
    learner = topology.learner
    for node_rank, host in enumerate(learner.hosts):
        if len(learner.hosts) == 1:
            rendezvous = ["--standalone"]
        else:
            rendezvous = [f"--nnodes={len(learner.hosts)}", f"--node-rank={node_rank}",
                          f"--master-addr={learner.hosts[0]}",
                          f"--master-port={learner.master_port}"]
        torchrun = [py(host), "-m", "torch.distributed.run", *rendezvous,
                    f"--nproc-per-node={learner.nproc_per_node}"]
        name = "learner" if len(learner.hosts) == 1 else f"learner@{host}"
        plan.append(ProcessSpec(name=name, role="learner", host=host,
                                argv=[*torchrun, "-m", "learner.main", *common]))
    for gen in topology.generators:
        plan.append(ProcessSpec(name=gen.name, role="generator", host=gen.host, essential=False,
                                argv=[py(gen.host), "-m", "generators.main", *common,
                                      "--name", gen.name]))
    if run.evaluates:
        host = topology.evaluator.host
        plan.append(ProcessSpec(name="evaluator", role="evaluator", host=host, essential=False,
                                argv=[py(host), "-m", "generators.evaluator", *common]))
    return plan


def write_resolved(topology: Topology, run: RunConfig, run_dir: Path) -> None:
    """Write the resolved configs every process of the run reads."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RESOLVED_TOPOLOGY).write_bytes(to_toml(topology))
    (run_dir / RESOLVED_RUN).write_bytes(to_toml(run))
