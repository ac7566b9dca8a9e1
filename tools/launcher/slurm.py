"""The Slurm backend inside its job: the plan's processes as ``srun`` job steps.

``relay.launcher.slurm_job`` submits one ``sbatch`` script per run; the script runs Relay's
own supervisor (``relay.launcher.supervisor``) on the job's first node, and the supervisor
starts each process of the plan through ``SlurmStepBackend`` as a job step of its own.

Layout (``layout``; the same on the login node, where it sizes the job, and in the job,
where it names the nodes): each process's demand (``relay.launcher.resources.demands``: its
``cpus``, ``memory_gib`` and GPUs; the learner's per rank) placed first fit, biggest first,
a learner node's ranks together and learner nodes apart (``relay.launcher.resources.place``),
on as few nodes as hold them, each of ``launcher.slurm.gpus_per_node`` GPUs (0: as many as
the largest process takes) and ``cpus_per_node`` CPUs (0: not counted). A process's GPUs
follow from its device: none on the CPU; on ``cuda`` its tensor-parallel size under vLLM
and SGLang, else one; Slurm picks which (``--gpus-per-task``, and it sets
``CUDA_VISIBLE_DEVICES``), so a topology that lists ``gpus`` or names ``cuda:N`` is refused
(``relay.configs.checks.check_cluster_request``, ``check_engine_devices``). A step asks for
its CPUs rounded up (the learner's: per node) and its memory as ``--mem`` (0:
``--mem=0``, the job's memory without reserving any of it).

Steps (``step_argv``): every step is ``srun --exact`` with its nodes, tasks, GPUs, CPUs and
memory, generators and the evaluator with ``--kill-on-bad-exit=0`` (a restarted generator
is a new step, re-attaching under its lineage: ``relay.launcher.supervisor``). The learner is one step of
``nnodes`` tasks, one per node, each running torchrun for that node's ranks: on one node
with its c10d rendezvous on the loopback interface (``relay.launcher.plan.learner_argv``),
on several with torch's static rendezvous at ``hosts[0]:master_port`` and the node's rank
from Slurm (``PET_NODE_RANK=$SLURM_NODEID``). c10d's rendezvous across nodes would order
the nodes by host name, and Relay needs rank 0 on ``hosts[0]``, where the topology says it
binds the weights ports.

Addresses: a job of one node without CURVE keeps every host at 127.0.0.1 (its sockets are
files in the run directory); a job of several nodes needs CURVE (``[security] curve =
true`` and ``keys_dir``), and every host becomes its node's name, the launcher's the job's
first node's (where the batch script, and so the supervisor, runs). Ports left at 0 are
picked free on the first node.

Signals: the supervisor signals ``srun``, which forwards SIGTERM to the step's tasks; a
step whose ``srun`` was killed outright ends with the job, which ends when the supervisor
does.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import msgspec

from relay.configs.loader import ConfigError
from relay.configs.run_schema import RunConfig
from relay.configs.topology_schema import Topology
from relay.launcher.backends import (
    PlacementError,
    PopenHandle,
    child_env,
    start_popen,
)
from relay.launcher.child import module_argv
from relay.launcher.plan import ProcessSpec, build_plan
from relay.launcher.ports import assign_ports
from relay.launcher.resources import Demand, NodeCapacity, demands, learner_nodes, place

SRUN = "srun"
SCONTROL = "scontrol"
NODELIST_VARIABLE = "SLURM_JOB_NODELIST"
NODE_RANK = 'PET_NODE_RANK="$SLURM_NODEID" exec "$@"'
"""``sh -c`` script: the command with torchrun's ``--node-rank`` (its variable
``PET_NODE_RANK``) set to this task's node within the step."""
LOOPBACK = "127.0.0.1"
JOB_REQUESTS = ("SLURM_MEM_PER_NODE", "SLURM_MEM_PER_CPU", "SLURM_MEM_PER_GPU", "SLURM_GPUS",
                "SLURM_GPUS_PER_NODE", "SLURM_GPUS_PER_TASK", "SLURM_TRES_PER_TASK")
"""What the job asked for, which ``srun`` would take from the environment as a step's own
request (``SLURM_GPUS_PER_NODE`` on top of ``--gpus-per-task``): a step asks for what its
options say, no more."""


class StepDemand(msgspec.Struct, frozen=True):
    """What one job step asks of each of its nodes (the learner's: one node's ranks)."""

    gpus: int
    cpus: int
    memory_gib: float


class Layout(msgspec.Struct, frozen=True):
    """Where each process goes, as indices of the job's nodes: the learner's nodes in the
    job's order (``learner_nodes``), every other process on one (``node_of``: by its plan
    name), and what each step asks for (``demand``, by plan name)."""

    nodes: int  # how many the job needs
    learner_nodes: list[int]
    node_of: dict[str, int]
    demand: dict[str, StepDemand]
    gpus_per_node: int  # what the job asks for on each node (0: none)
    cpus_per_node: int
    memory_gib_per_node: float


def check_engine_devices(topology: Topology, source: str) -> None:
    """``ConfigError`` for an engine placed on one GPU by its index (``cuda:N``): Slurm
    picks each step's GPUs and the step sees them from ``cuda:0``. (GPU lists and the
    learner's ``auto`` are refused for every cluster backend:
    ``relay.configs.checks.check_cluster_request``.)"""
    placed = [(f"generators[{i}].device", g.device) for i, g in enumerate(topology.generators)]
    placed += [(f"reward_models[{i}].device", r.device)
               for i, r in enumerate(topology.reward_models)]
    placed.append(("evaluator.device", topology.evaluator.device))
    for key, device in placed:
        if device.partition(":")[2]:
            raise ConfigError(source, key, (
                f"{device!r} with launcher.backend = \"slurm\", which picks each step's GPUs: "
                "say \"cuda\" (vLLM and SGLang take tensor_model_parallel_size GPUs, the rest "
                "one)"))


def layout(topology: Topology, run: RunConfig, source: str = "the topology") -> Layout:
    """Where each process goes (module docstring): the demands of
    ``relay.launcher.resources.demands`` placed by ``relay.launcher.resources.place`` on as
    few nodes of ``launcher.slurm``'s size as hold them. ``ConfigError`` for a process that
    no node can hold, or several nodes without CURVE."""
    check_engine_devices(topology, source)
    settings = topology.launcher.slurm
    found = demands(topology, run)
    learner = topology.learner
    learner_gpus = learner.nproc_per_node * (learner.device == "cuda")
    gpu_cap = settings.gpus_per_node or max(
        [learner_gpus, *(d.gpus for d in found if d.role != "learner")])
    node_size = NodeCapacity(name="", cpus=settings.cpus_per_node or math.inf, gpus=gpu_cap)
    where: dict[str, str] = {}
    for count in range(learner_nodes(learner), len(found) + 1):
        nodes = [msgspec.structs.replace(node_size, name=str(i)) for i in range(count)]
        try:
            where = place(found, nodes)
            break
        except PlacementError as exc:
            refusal = str(exc)
    if not where:
        raise ConfigError(source, "launcher.slurm", (
            f"{refusal}, on nodes of gpus_per_node = {gpu_cap} and cpus_per_node = "
            f"{settings.cpus_per_node or 'any'}"))
    steps: dict[str, list[Demand]] = {}
    for demand in found:
        steps.setdefault("learner" if demand.role == "learner" else demand.name,
                         []).append(demand)
    learner_on = sorted({int(where[d.name]) for d in steps["learner"]})
    node_of = {name: int(where[group[0].name]) for name, group in steps.items()
               if name != "learner"}
    per_node = len(learner_on)  # the learner's step asks each node for one node's ranks
    step_demand = {name: StepDemand(
        gpus=sum(d.gpus for d in group) // (per_node if name == "learner" else 1),
        cpus=math.ceil(sum(d.cpus for d in group) / (per_node if name == "learner" else 1)),
        memory_gib=sum(d.memory_gib for d in group) / (per_node if name == "learner" else 1))
        for name, group in steps.items()}
    count = max([*learner_on, *node_of.values()]) + 1
    used = [[0, 0, 0.0] for _ in range(count)]
    for name, demand in step_demand.items():
        for node in learner_on if name == "learner" else [node_of[name]]:
            used[node][0] += demand.gpus
            used[node][1] += demand.cpus
            used[node][2] += demand.memory_gib
    if count > 1 and not topology.security.curve:
        raise ConfigError(source, "security.curve", (
            f"the plan needs {count} nodes of the Slurm job, and Relay talks between nodes "
            "only over CURVE: set [security] curve = true and keys_dir (see "
            "tools/make-curve-keys.py)"))
    return Layout(nodes=count, learner_nodes=learner_on, node_of=node_of, demand=step_demand,
                  gpus_per_node=settings.gpus_per_node or max(u[0] for u in used),
                  cpus_per_node=settings.cpus_per_node or max(u[1] for u in used),
                  memory_gib_per_node=max(u[2] for u in used))


def placed(topology: Topology, plan_layout: Layout, hosts: list[str]) -> Topology:
    """The topology with its hosts set to the job's nodes ``hosts`` (all 127.0.0.1 for a
    job of one node without CURVE) and port 0 picked free here."""
    if len(hosts) < plan_layout.nodes:
        raise PlacementError(f"the plan needs {plan_layout.nodes} nodes and the job has "
                             f"{len(hosts)} ({', '.join(hosts)})")
    curve = topology.security.curve

    def host(node: int) -> str:
        return hosts[node] if curve else LOOPBACK

    replace = msgspec.structs.replace
    node_of = plan_layout.node_of
    learner = replace(topology.learner, hosts=[host(i) for i in plan_layout.learner_nodes])
    generators = [replace(g, host=host(node_of[g.name])) for g in topology.generators]
    reward_models = [replace(r, host=host(node_of[r.name])) for r in topology.reward_models]
    evaluator = topology.evaluator
    if "evaluator" in node_of:
        evaluator = replace(evaluator, host=host(node_of["evaluator"]))
    topology = replace(topology, buffer=replace(topology.buffer, host=host(node_of["buffer"])),
                       learner=learner, generators=generators, evaluator=evaluator,
                       reward_models=reward_models,
                       launcher=replace(topology.launcher, host=host(0)))
    return assign_ports(topology)


def job_hosts(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The job's nodes, in Slurm's order (``scontrol show hostnames $SLURM_JOB_NODELIST``)."""
    nodelist = environ.get(NODELIST_VARIABLE, "")
    if not nodelist:
        raise PlacementError(f"{NODELIST_VARIABLE} is not set: the Slurm backend places a "
                             "run inside its job (tools/launch-cluster.py submits one)")
    if shutil.which(SCONTROL) is None:
        raise PlacementError(f"{SCONTROL} is not on PATH inside the job: it names the "
                             f"job's nodes ({NODELIST_VARIABLE}={nodelist})")
    done = subprocess.run([SCONTROL, "show", "hostnames", nodelist], capture_output=True,
                          text=True, timeout=60)
    hosts = done.stdout.split()
    if done.returncode != 0 or not hosts:
        raise PlacementError(f"{SCONTROL} show hostnames {nodelist} failed "
                             f"(exit code {done.returncode}): {done.stderr.strip()}")
    return hosts


def srun_options(demand: StepDemand, nodes: list[str], *, per_node: bool) -> list[str]:
    """``srun``'s options for a step on ``nodes``: one task per node when ``per_node`` (the
    learner), else one task in all, each with the ``demand`` given."""
    options = [SRUN, "--exact", f"--nodes={len(nodes)}", f"--nodelist={','.join(nodes)}",
               "--ntasks-per-node=1" if per_node else "--ntasks=1"]
    if demand.gpus:
        options.append(f"--gpus-per-task={demand.gpus}")
    options.append(f"--cpus-per-task={max(demand.cpus, 1)}")
    # --mem=0: within the job's memory, reserving none of it (a step that names no memory
    # would reserve all the job has on its node, and the next step there would wait)
    options.append(f"--mem={math.ceil(demand.memory_gib * 1024)}M" if demand.memory_gib
                   else "--mem=0")
    return options


def step_argv(spec: ProcessSpec, demand: StepDemand, nodes: list[str]) -> list[str]:
    """The ``srun`` command line that runs the plan's process ``spec`` on ``nodes``."""
    if spec.role == "learner":
        return [*srun_options(demand, nodes, per_node=True), "--kill-on-bad-exit=1",
                *(["sh", "-c", NODE_RANK, "sh"] if len(nodes) > 1 else []), *spec.argv]
    optional = [] if spec.essential else ["--kill-on-bad-exit=0"]
    return [*srun_options(demand, nodes, per_node=False), *optional, *spec.argv]


def learner_nodes_argv(topology: Topology, run_dir: Path, python: str) -> list[str]:
    """The learner of several nodes: torchrun on each, static rendezvous at
    ``hosts[0]:master_port``, the node's rank from ``PET_NODE_RANK`` (``NODE_RANK``)."""
    learner = topology.learner
    learner_main = module_argv(python, "relay.learner.main", "--run-dir", str(run_dir))
    return module_argv(python, "torch.distributed.run", f"--nnodes={len(learner.hosts)}",
                       f"--master-addr={learner.hosts[0]}",
                       f"--master-port={learner.master_port}",
                       f"--nproc-per-node={learner.nproc_per_node}", "--no-python",
                       *learner_main)


def slurm_plan(topology: Topology, run: RunConfig, run_dir: Path, plan_layout: Layout,
               hosts: list[str], python: str = sys.executable) -> list[ProcessSpec]:
    """The plan of a topology ``placed`` on ``hosts``, each process an ``srun`` step: the
    learner one step over its nodes (named ``learner``), each other process one of its own
    on its node (``ProcessSpec.host``: that node)."""
    # every node runs the supervisor's python (the script's), not launcher.remote_python
    same_python = msgspec.structs.replace(topology.launcher, remote_python=python)
    plan = build_plan(msgspec.structs.replace(topology, launcher=same_python), run, run_dir,
                      python=python)
    learner_hosts = [hosts[i] for i in plan_layout.learner_nodes]
    steps = []
    for spec in plan:
        if spec.role == "learner":
            if steps and steps[-1].role == "learner":
                continue  # build_plan's learner@host of a further node: one step holds all
            if len(learner_hosts) > 1:
                spec = msgspec.structs.replace(
                    spec, name="learner", argv=learner_nodes_argv(topology, run_dir, python))
            nodes, demand = learner_hosts, plan_layout.demand["learner"]
        else:
            nodes = [hosts[plan_layout.node_of[spec.name]]]
            demand = plan_layout.demand[spec.name]
        steps.append(msgspec.structs.replace(spec, host=nodes[0],
                                             argv=step_argv(spec, demand, nodes)))
    return steps


class SlurmStepBackend:
    """``slurm``, inside the job: places the plan on the job's nodes and starts each process
    as a job step (module docstring)."""

    name = "slurm"

    def __init__(self, python: str = sys.executable) -> None:
        self.python = python
        self._layout: Layout | None = None
        self._hosts: list[str] = []

    def place(self, topology: Topology, run: RunConfig) -> Topology:
        try:
            self._layout = layout(topology, run)
        except ConfigError as exc:
            raise PlacementError(str(exc)) from None
        self._hosts = job_hosts()
        if shutil.which(SRUN) is None:
            raise PlacementError(f"{SRUN} is not on PATH on the job's first node: it starts "
                                 "each process of the run as a job step")
        return placed(topology, self._layout, self._hosts)

    def plan(self, topology: Topology, run: RunConfig, run_dir: Path) -> list[ProcessSpec]:
        if self._layout is None:
            raise PlacementError("the Slurm backend plans only after place()")
        return slurm_plan(topology, run, run_dir, self._layout, self._hosts, self.python)

    def start(self, spec: ProcessSpec, topology: Topology, log: Path) -> PopenHandle:
        """The step's ``srun`` on this node, polled, signalled and waited for as any process
        the supervisor starts (``srun`` forwards the signals to the step's tasks)."""
        env = {name: value for name, value in child_env(spec.env, local=True).items()
               if name not in JOB_REQUESTS}
        return start_popen(spec.argv, env, log)

    def close(self) -> None:
        pass
