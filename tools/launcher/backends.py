"""How the plan's processes are started: the launcher's backends.

One plan (``relay.launcher.plan``) and one supervisor (``relay.launcher.supervisor``: start
order, the status line, the watchdog, restarts, the stop) serve every backend; a backend
only does what differs between them:

- ``place``: reserve what the processes need and fill in the topology's hosts and ports
  (``local`` and ``ssh``: free ports of this machine; ``ray``: reservations on the
  cluster's nodes, ports picked on each node);
- ``plan``: the plan's processes for that topology;
- ``start``: one process, its output in its log file, as a ``ProcessHandle`` the supervisor
  polls, signals and waits for;
- ``close``: release what ``place`` reserved.

``launcher.backend`` picks one: ``local`` (every process here), ``ssh`` (hosts named in
the topology; ``relay.launcher.plan.ProcessSpec.command_line``), ``ray``
(``relay.launcher.ray_backend``), ``slurm`` (``relay.launcher.slurm``: the job runs this
supervisor inside its allocation, each process an ``srun`` job step).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from relay.configs.run_schema import RunConfig
from relay.configs.rundir import RESOLVED_RUN, RESOLVED_TOPOLOGY
from relay.configs.topology_schema import Topology
from relay.launcher.plan import ProcessSpec, build_plan
from relay.launcher.ports import assign_ports


class PlacementError(Exception):
    """The backend cannot place the plan: the message names the process and what is
    missing."""


class ProcessHandle(Protocol):
    """A started process as the supervisor sees it, wherever it runs."""

    def poll(self) -> int | None:
        """Its exit code once it has ended (negative: the signal that killed it), else None."""

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to it and every process it started (nothing when all are gone)."""

    def wait(self) -> int:
        """Wait until it has ended; its exit code."""

    def group_alive(self) -> bool:
        """Whether it or a process it started is still alive (not a zombie)."""


class Backend(Protocol):
    """What differs between backends (module docstring)."""

    name: str

    def place(self, topology: Topology, run: RunConfig) -> Topology: ...

    def plan(self, topology: Topology, run: RunConfig, run_dir: Path) -> list[ProcessSpec]: ...

    def start(self, spec: ProcessSpec, topology: Topology, log: Path) -> ProcessHandle: ...

    def close(self) -> None: ...


def live_groups(groups: set[int]) -> set[int]:
    """Which of the process ``groups`` still have a member that is not a zombie (Linux's
    /proc; elsewhere none is known)."""
    live = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, group = stat.read_text().rpartition(")")[2].split()[:3]
        except (OSError, ValueError):
            continue  # gone meanwhile
        if int(group) in groups and state not in "ZX":
            live.add(int(group))
    return live


class PopenHandle:
    """A process this machine started in a process group (session) of its own: the command
    itself, or ssh running it on a remote host (whose hang-up ends the remote command)."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen

    def poll(self) -> int | None:
        return self.popen.poll()

    def signal(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def wait(self) -> int:
        return self.popen.wait()

    def group_alive(self) -> bool:
        return bool(live_groups({self.popen.pid}))


def child_env(spec_env: dict[str, str], *, local: bool) -> dict[str, str]:
    """The environment of a process this machine starts: the launcher's own, with the
    settings every Relay process runs best under, and the spec's ``env`` for a local
    process (a remote one gets it on its ssh command line)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # Idle OpenMP threads must sleep, not spin: the processes of a run share the cores, and
    # spinning made steps 6-15x slower on a busy 2-core machine.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # glibc's malloc returns blocks above 128 KiB to the kernel when they are freed, so each
    # pass's activations were fresh pages that the kernel zeroes on first touch; keeping
    # blocks up to 32 MiB in the heap for reuse made a 24M-parameter learner step 6-15%
    # faster (tools/bench-e2e.py --throughput's model, one rank, 2 threads).
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(32 << 20))
    env.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 40))
    if local:
        env.update(spec_env)
    return env


def start_popen(argv: list[str], env: dict[str, str], log: Path,
                preexec: Callable[[], None] | None = None) -> PopenHandle:
    """``argv`` in a session of its own, its output appended to ``log``; ``preexec`` runs in
    the child before it does."""
    with open(log, "ab") as out:
        popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True, env=env,
                                 preexec_fn=preexec)
    return PopenHandle(popen)


class SubprocessBackend:
    """``local`` and ``ssh``: processes started from this machine, a remote one through
    ``launcher.ssh`` after the run directory's configs were copied there."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._run_dir = Path()
        self._pushed: set[str] = set()

    def place(self, topology: Topology, run: RunConfig) -> Topology:
        return assign_ports(topology)

    def plan(self, topology: Topology, run: RunConfig, run_dir: Path) -> list[ProcessSpec]:
        self._run_dir = run_dir
        return build_plan(topology, run, run_dir)

    def start(self, spec: ProcessSpec, topology: Topology, log: Path) -> PopenHandle:
        if not spec.local and spec.host not in self._pushed:
            push_run_dir(spec.host, self._run_dir, topology)
            self._pushed.add(spec.host)
        argv = spec.command_line(topology.launcher.ssh, topology.launcher.remote_workdir)
        return start_popen(argv, child_env(spec.env, local=spec.local), log)

    def close(self) -> None:
        pass


def push_run_dir(host: str, run_dir: Path, topology: Topology) -> None:
    """Copy the resolved configs to the same run directory on a remote host, over ssh.

    Each file is written under a temporary name and renamed into place, so a run directory
    on a filesystem the hosts share is never truncated while it is being read.
    """
    ssh = [*shlex.split(topology.launcher.ssh), host]
    subprocess.run([*ssh, f"mkdir -p {shlex.quote(str(run_dir))}"], check=True, timeout=60)
    for name in (RESOLVED_TOPOLOGY, RESOLVED_RUN):
        target = shlex.quote(str(run_dir / name))
        partial = shlex.quote(str(run_dir / f".{name}.{os.getpid()}.partial"))
        with open(run_dir / name, "rb") as source:
            subprocess.run([*ssh, f"cat > {partial} && mv {partial} {target}"], stdin=source,
                           check=True, timeout=60)


def backend_for(topology: Topology) -> Backend:
    """The backend ``launcher.backend`` names."""
    name = topology.launcher.backend
    if name == "ray":
        from relay.launcher.ray_backend import RayBackend

        return RayBackend(topology.launcher.ray)
    if name == "slurm":
        from relay.launcher.slurm import SlurmStepBackend

        return SlurmStepBackend()
    return SubprocessBackend(name)
