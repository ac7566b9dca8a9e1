"""What each process of a run asks of its node, and whether the nodes at hand can give it.

``demands`` turns a topology into one ``Demand`` per process (one per learner rank): its
CPUs, GPUs, memory and Ray custom resources, from the topology's ``cpus``, ``memory_gib``,
``resources`` and device (``relay.configs.topology_schema._Resources``). Two checks use them,
before anything starts:

- ``place``: a cluster's nodes (``NodeCapacity``, e.g. from ``ray.nodes()``) against the
  demands, first fit; a plan that cannot be placed is refused with a ``PlacementError``
  naming the process and the resource no node has free.
- ``check_local``: this machine against the demands of a local launch, GPUs and memory
  only (``check_local``'s docstring says why not CPUs).

The module knows nothing of how a backend reserves what it found (Ray's placement groups,
Slurm's options): it only says whether, and where, the demands fit.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import msgspec

from relay.configs.loader import ConfigError
from relay.configs.run_schema import RunConfig
from relay.configs.topology_schema import EnginePlacement, LearnerPlacement, Topology
from relay.launcher.backends import PlacementError

MEMINFO = Path("/proc/meminfo")
VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
GIB = 1 << 30
EPSILON = 1e-9  # fractional CPUs and resources: a sum of floats that fits, fits
Role = Literal["buffer", "learner", "reward_model", "generator", "evaluator"]


class Demand(msgspec.Struct, kw_only=True, frozen=True):
    """What one process asks of the node it runs on.

    ``name``: the process (``buffer``, ``learner-<rank>``, a generator's name,
    ``evaluator``); ``section``: its topology section, the prefix of the keys that set it
    (``generators[1]``); ``learner_node``: for a learner rank, the learner node it belongs
    to (its ranks run together on one node). ``devices``: the GPU indices of its host it
    takes when the launcher starts it there (local and ssh): its ``gpus`` list, the N of
    ``cuda:N``, else the host's first ``gpus`` (a learner rank: its local rank's);
    ``devices_key`` the key that chose them."""

    name: str
    role: Role
    section: str
    cpus: float
    gpus: int
    memory_gib: float
    resources: dict[str, float] = msgspec.field(default_factory=dict)
    learner_node: int | None = None
    devices: list[int] = msgspec.field(default_factory=list)
    devices_key: str = ""

    @property
    def listed(self) -> bool:
        """Whether its GPUs are a ``gpus`` list of the topology."""
        return self.devices_key.endswith(".gpus")

    @property
    def what(self) -> str:
        """The process as a message names it: ``generator gen1``, ``learner rank 2``."""
        if self.role == "learner":
            return f"learner rank {self.name.removeprefix('learner-')}"
        if self.role == "reward_model":
            return f"reward server {self.name}"
        return self.name if self.role in ("buffer", "evaluator") else f"{self.role} {self.name}"


class NodeCapacity(msgspec.Struct, kw_only=True, frozen=True):
    """What one node offers: ``cpus``, ``gpus``, ``memory_gib`` (0: not accounted) and Ray's
    custom ``resources``."""

    name: str
    cpus: float
    gpus: float
    memory_gib: float = 0.0
    resources: dict[str, float] = msgspec.field(default_factory=dict)


def learner_nodes(learner: LearnerPlacement) -> int:
    """How many nodes the learner spans: ``nnodes``, or with 0 its ``hosts``'s length."""
    return learner.nnodes or len(learner.hosts)


def engine_gpus(placement: EnginePlacement) -> int:
    """The GPUs a generator or the evaluator takes: none on the CPU, else its ``gpus``
    list's length or, with no list, vLLM's and SGLang's tensor-parallel size, one for
    Relay's own engines."""
    if placement.device == "cpu":
        return 0
    if placement.gpus is not None:
        return len(placement.gpus)
    if placement.engine in ("vllm", "sglang"):
        return getattr(placement, placement.engine).tensor_model_parallel_size
    return 1


def engine_devices(placement: EnginePlacement, section: str) -> tuple[list[int], str]:
    """The GPU indices of its host a generator or the evaluator takes, and the key that
    chose them (``Demand.devices``)."""
    if placement.device == "cpu":
        return [], ""
    if placement.gpus is not None:
        return list(placement.gpus), f"{section}.gpus"
    _, _, index = placement.device.partition(":")
    if index:
        return [int(index)], f"{section}.device"
    key = (f"{section}.{placement.engine}.tensor_model_parallel_size"
           if placement.engine in ("vllm", "sglang") else f"{section}.device")
    return list(range(engine_gpus(placement))), key


def demands(topology: Topology, run: RunConfig) -> list[Demand]:
    """One ``Demand`` per process of the run: the buffer, each learner rank
    (``learner_nodes`` x ``nproc_per_node``, each with the learner's per-rank ``cpus``,
    ``memory_gib`` and ``resources``; one GPU each on ``"cuda"``, none on ``"cpu"`` or
    ``"auto"``, which takes a GPU only where it finds one), each reward server
    (``[[reward_models]]``: its GPUs as an engine's of the judge's engine,
    ``reward_model.judge.engine``, when it serves a judge, else as Relay's own), each
    generator, and the evaluator when the run evaluates held-out data."""
    buffer = topology.buffer
    found = [Demand(name="buffer", role="buffer", section="buffer", cpus=buffer.cpus, gpus=0,
                    memory_gib=buffer.memory_gib, resources=dict(buffer.resources))]
    learner = topology.learner
    on_gpu = learner.device == "cuda"
    per_node = learner.nproc_per_node
    for rank in range(learner_nodes(learner) * per_node):
        local = rank % per_node
        listed = learner.gpus is not None
        found.append(Demand(name=f"learner-{rank}", role="learner", section="learner",
                            cpus=learner.cpus, gpus=int(on_gpu), memory_gib=learner.memory_gib,
                            resources=dict(learner.resources), learner_node=rank // per_node,
                            devices=[learner.gpus[local] if listed else local]
                            if on_gpu else [],
                            devices_key="" if not on_gpu else "learner.gpus" if listed
                            else "learner.nproc_per_node"))
    judge = run.reward_model.judge
    engines: list[tuple[str, Role, str, EnginePlacement]] = [
        (r.name, "reward_model", f"reward_models[{i}]",
         r.engine_placement(judge.engine if judge.enable else "lean"))
        for i, r in enumerate(topology.reward_models)]
    engines += [
        (g.name, "generator", f"generators[{i}]", g) for i, g in enumerate(topology.generators)]
    if run.evaluates:
        engines.append(("evaluator", "evaluator", "evaluator", topology.evaluator))
    for name, role, section, placement in engines:
        devices, key = engine_devices(placement, section)
        found.append(Demand(name=name, role=role, section=section, cpus=placement.cpus,
                            gpus=engine_gpus(placement), memory_gib=placement.memory_gib,
                            resources=dict(placement.resources), devices=devices,
                            devices_key=key))
    return found


class _Unit(msgspec.Struct, kw_only=True):
    """What ``place`` puts on one node at once: one process, or a learner node's ranks."""

    demands: list[Demand]
    what: str
    learner_node: int | None

    def amount(self, kind: str) -> float:
        """How much of ``kind`` its processes ask for together."""
        if kind == "cpus":
            return sum(d.cpus for d in self.demands)
        if kind == "gpus":
            return sum(d.gpus for d in self.demands)
        if kind == "memory_gib":
            return sum(d.memory_gib for d in self.demands)
        return sum(d.resources.get(kind, 0.0) for d in self.demands)

    def kinds(self) -> list[str]:
        """The resources it asks for, GPUs first (the scarcest), custom ones last."""
        custom = sorted({name for d in self.demands for name in d.resources})
        return [k for k in ("gpus", "cpus", "memory_gib", *custom) if self.amount(k) > 0]

    def size(self) -> tuple[float, float, float, float]:
        """Its GPUs, CPUs, memory and custom resources: what orders ``place``."""
        custom = sum(sum(d.resources.values()) for d in self.demands)
        return (self.amount("gpus"), self.amount("cpus"), self.amount("memory_gib"), custom)


def _units(found: Sequence[Demand]) -> list[_Unit]:
    """The demands as placed together: each learner node's ranks as one unit."""
    units: list[_Unit] = []
    by_node: dict[int, _Unit] = {}
    for demand in found:
        node = demand.learner_node
        if node is None:
            units.append(_Unit(demands=[demand], what=demand.what, learner_node=None))
        elif node in by_node:
            by_node[node].demands.append(demand)
        else:
            by_node[node] = _Unit(demands=[demand], what="", learner_node=node)
            units.append(by_node[node])
    for node, unit in by_node.items():
        ranks = [d.name.removeprefix("learner-") for d in unit.demands]
        span = ranks[0] if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"
        unit.what = f"learner node {node} (rank{'s' if len(ranks) > 1 else ''} {span})"
    return units


def _offered(node: NodeCapacity, kind: str) -> float | None:
    """What ``node`` offers of ``kind`` (None: a custom resource it does not have;
    ``float('inf')``: memory it does not account)."""
    if kind in ("cpus", "gpus"):
        return getattr(node, kind)
    if kind == "memory_gib":
        return node.memory_gib or float("inf")
    return node.resources.get(kind)


_NAMES = {"gpus": "GPU(s)", "cpus": "CPU(s)", "memory_gib": "GiB of memory"}


def _amount(kind: str, value: float) -> str:
    """``value`` of resource ``kind`` as a message says it: ``4 GPU(s)``."""
    if kind in _NAMES:
        return f"{value:g} {_NAMES[kind]}"
    return f"{value:g} of custom resource {kind!r}"


def place(found: Sequence[Demand], nodes: Sequence[NodeCapacity]) -> dict[str, str]:
    """Each process's node: the name of the first node in ``nodes`` with what it asks for
    free, the biggest demands (GPUs, then CPUs, memory, custom resources) placed first, the
    ranks of one learner node together on one node and no two learner nodes on one node.
    Deterministic: the same demands and nodes give the same answer. ``PlacementError``
    naming the first process that fits nowhere and the resource no node has free, as left
    by the bigger ones placed before it (first fit may refuse a plan that a cleverer
    packing would place: order ``nodes`` to prefer some, or pin processes with custom
    resources)."""
    free = {node.name: {kind: _offered(node, kind) for kind in _kinds(found)}
            for node in nodes}
    learner_on: dict[str, int] = {}  # node name -> the learner node placed there
    placed: dict[str, str] = {}
    units = sorted(_units(found), key=lambda u: tuple(-x for x in u.size()))  # stable
    for unit in units:
        taken = set() if unit.learner_node is None else set(learner_on)
        node = next((n for n in nodes if n.name not in taken and _fits(unit, free[n.name])),
                    None)
        if node is None:
            raise PlacementError(_refusal(unit, nodes, free, learner_on))
        left = free[node.name]
        for kind in unit.kinds():
            left[kind] = (left[kind] or 0.0) - unit.amount(kind)  # not None: it fit
        if unit.learner_node is not None:
            learner_on[node.name] = unit.learner_node
        placed.update((d.name, node.name) for d in unit.demands)
    return {d.name: placed[d.name] for d in found}


def _kinds(found: Sequence[Demand]) -> list[str]:
    """Every resource ``place`` accounts: GPUs, CPUs, memory and the custom ones asked for."""
    return ["gpus", "cpus", "memory_gib", *sorted({k for d in found for k in d.resources})]


def _fits(unit: _Unit, free: dict[str, float | None]) -> bool:
    """Whether a node with ``free`` left can take ``unit``."""
    return all((have := free[kind]) is not None and unit.amount(kind) <= have + EPSILON
               for kind in unit.kinds())


def _refusal(unit: _Unit, nodes: Sequence[NodeCapacity], free: dict[str, dict[str, float | None]],
             learner_on: dict[str, int]) -> str:
    """Why ``unit`` fits on no node: the first resource no node has free, else that no
    node has all of them free together."""
    if not nodes:
        return f"{unit.what} cannot be placed: the cluster has no node"
    asked = ", ".join(_amount(kind, unit.amount(kind)) for kind in unit.kinds())
    holders = [n for n in nodes if unit.learner_node is not None and n.name in learner_on
               and _fits(unit, free[n.name])]
    if holders:
        held = ", ".join(f"{n.name}: learner node {learner_on[n.name]}" for n in holders)
        with_free = f" with {asked} free" if asked else ""
        return f"{unit.what} needs a node of its own{with_free}, but each node that has " \
               f"them holds another learner node ({held})"
    eligible = [n for n in nodes if unit.learner_node is None or n.name not in learner_on]
    for kind in unit.kinds():
        need = unit.amount(kind)
        if kind not in _NAMES and all(free[n.name][kind] is None for n in nodes):
            return f"the cluster has no node with custom resource {kind!r}: {unit.what} " \
                   f"asks for {need:g} of it"
        if any((free[n.name][kind] or 0.0) + EPSILON >= need for n in eligible):
            continue
        states = ", ".join(_state(n, kind, free, learner_on, unit) for n in nodes)
        them = "them" if kind in ("gpus", "cpus") else "it"
        return f"{unit.what} needs {_amount(kind, need)} but no node has {them} free ({states})"
    states = "; ".join(
        f"{n.name}: " + ", ".join(_free_text(kind, free[n.name][kind]) for kind in unit.kinds())
        for n in eligible)
    return f"{unit.what} needs {asked} on one node, but no node has them all free ({states})"


def _state(node: NodeCapacity, kind: str, free: dict[str, dict[str, float | None]],
           learner_on: dict[str, int], unit: _Unit) -> str:
    """What ``node`` has free of ``kind`` for ``unit``, in a refusal."""
    have = free[node.name][kind]
    if unit.learner_node is not None and node.name in learner_on:
        return f"{node.name}: taken by learner node {learner_on[node.name]}"
    if have == float("inf"):
        return f"{node.name}: memory not accounted"
    return f"{node.name}: {'none' if have is None else format(have, 'g')} free"


def _free_text(kind: str, have: float | None) -> str:
    """``have`` free of ``kind``, in a refusal that lists every resource."""
    if have is None:
        return f"no {kind!r}"
    if have == float("inf"):
        return "memory not accounted"
    return f"{have:g} {_NAMES.get(kind, repr(kind))} free"


def meminfo_total_gib(path: Path = MEMINFO) -> float | None:
    """This machine's memory (``MemTotal`` of /proc/meminfo) in GiB; None where it cannot
    be read (not Linux)."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(":")
            if name == "MemTotal":
                return int(value.split()[0]) * 1024 / GIB  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def cuda_device_count() -> int:
    """The GPUs torch sees on this machine (the launcher's ``CUDA_VISIBLE_DEVICES``
    applies): without initializing CUDA, so the launcher's later children can."""
    import torch

    return torch.cuda.device_count()


def local_capacity() -> NodeCapacity:
    """This machine as a node: its cores, GPUs (``cuda_device_count``) and memory
    (``meminfo_total_gib``; 0: unknown)."""
    return NodeCapacity(name="this machine", cpus=float(os.cpu_count() or 1),
                        gpus=float(cuda_device_count()), memory_gib=meminfo_total_gib() or 0.0)


def check_local(found: Sequence[Demand], source: str) -> None:
    """A launch whose processes all run on this machine fits it, or ``ConfigError`` naming
    the process and the key (in ``source``, the topology):

    - GPUs: every GPU a process takes (``Demand.devices``) exists, as torch counts them
      (asked only when a process is on a GPU). Processes without ``gpus`` lists may share
      a GPU (``relay.configs.gpu_placement``), so the GPUs are not summed. A ``gpus`` list
      replaces the launcher's own ``CUDA_VISIBLE_DEVICES`` (``relay.launcher.plan``), so
      where the launcher runs under one, torch's count here is not the machine's and listed
      GPUs are left to the process (a missing one fails its start).
    - Memory: the processes' ``memory_gib`` together fit /proc/meminfo's ``MemTotal``.

    CPUs are not refused: the processes of one machine time-share its cores (the default
    topology runs four processes on two), so ``cpus`` is a reservation only where a
    cluster manager schedules by it (Ray, Slurm)."""
    on_gpu = [d for d in found if d.devices]
    asked = sum(d.memory_gib for d in found)
    if not on_gpu and not asked:
        return
    here = local_capacity()
    count = int(here.gpus)
    restricted = VISIBLE_DEVICES in os.environ
    for demand in on_gpu:
        if restricted and demand.listed:
            continue
        missing = [index for index in demand.devices if index >= count]
        if missing:
            raise ConfigError(source, demand.devices_key, (
                f"{demand.what} runs on GPU {missing[0]} of this machine, which has "
                f"{count} GPU(s) (torch.cuda.device_count()): "
                + ("list GPUs it has, or run it on 'cpu'" if count else "run it on 'cpu'")))
    total = here.memory_gib
    if total and asked > total + EPSILON:
        biggest = max(found, key=lambda d: d.memory_gib)
        shares = ", ".join(f"{d.what} {d.memory_gib:g}" for d in found if d.memory_gib)
        raise ConfigError(source, f"{biggest.section}.memory_gib", (
            f"the processes of this machine ask for {asked:g} GiB of memory together "
            f"({shares}), but it has {total:.1f} GiB (/proc/meminfo MemTotal); "
            f"{biggest.what} asks for the most: lower it"))

