"""The Ray backend (``launcher.backend = "ray"``): the plan's processes as Ray actors.

Each process of the plan is one ``ProcessRunner`` actor holding the reservation the topology
asks for it (``relay.launcher.resources``: ``num_cpus`` = its ``cpus``, ``num_gpus`` = its
GPUs, its ``memory_gib`` and custom ``resources``), which starts the process's command line
as a child on the actor's node, its output in ``RUN_DIR/logs/<name>.log``. Ray sets
``CUDA_VISIBLE_DEVICES`` for the actor and the child inherits it. The child is in a session
of its own (so that a stop reaches everything it started) and dies with its actor
(``PR_SET_PDEATHSIG``): killing an actor's process kills the process it runs.

Placement (``RayBackend.place``):

1. connect to ``[launcher.ray] address`` (a running cluster) or start a Ray instance here;
2. check the plan against the nodes' resources (``relay.launcher.resources.place``): a plan
   that cannot be placed is refused before anything starts, naming the process and what
   no node has;
3. reserve: the buffer, each reward server, each generator and the evaluator as an actor
   with its resources;
   the learner's ranks in one placement group, a bundle per learner node holding that
   node's ranks (``STRICT_PACK`` for one node, ``STRICT_SPREAD`` across several), each
   rank an actor in its node's bundle;
4. ask each actor where it runs and pick its ports there: the buffer's, each reward
   server's, and the learner's
   (rank 0's node meets the others: ``MASTER_ADDR``, the weight ports). A node that is this
   machine (same kernel boot id) is named ``127.0.0.1``, so a Ray cluster of one machine
   needs no CURVE; any other node needs it (``security.curve``).

The supervisor (``relay.launcher.supervisor``) does the rest as for every backend: start
order, the status line, the watchdog, restarts (a dead generator's actor is replaced by a
new one with the same reservation), the stop. The run directory must be at the same path on
every node (a shared filesystem); a node that does not see it refuses to start its process,
naming itself. ``RUN_DIR/ray-placement.json`` records where each process was placed (its
actor's id, Ray's node id, the node's address and host name).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from relay.configs.run_schema import RunConfig
from relay.configs.rundir import RESOLVED_TOPOLOGY
from relay.configs.topology_schema import RaySettings, Topology
from relay.launcher.backends import PlacementError, PopenHandle, child_env, start_popen
from relay.launcher.plan import VISIBLE_DEVICES, ProcessSpec, build_plan
from relay.launcher.ports import free_port
from relay.launcher.resources import Demand, NodeCapacity, demands, place

LOCALHOST = "127.0.0.1"
ACTOR_CALL_TIMEOUT_S = 60.0
PLACEMENT_FILE = "ray-placement.json"
PR_SET_PDEATHSIG = 1
GIB = 1 << 30


def missing_ray() -> PlacementError:
    return PlacementError("launcher.backend = \"ray\" needs Ray: pip install 'relay-rl[ray]' "
                          "(or 'ray[default]') on this machine and every node")


def boot_id() -> str:
    """This kernel's boot id: two processes that read the same one run on one machine."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def _die_with_parent() -> None:
    """In the child, before it runs: SIGKILL when the actor that started it dies."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class ProcessRunner:
    """The actor behind one process of the plan (module docstring); made a Ray actor class
    by ``RayBackend``."""

    def __init__(self) -> None:
        self.child: PopenHandle | None = None

    def where(self) -> dict[str, str]:
        """The node this actor runs on: Ray's node id, its address, its boot id."""
        import ray

        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "actor_id": context.get_actor_id(),
                "ip": ray.util.get_node_ip_address(), "boot_id": boot_id(),
                "hostname": socket.gethostname()}

    def free_ports(self, count: int) -> list[int]:
        """``count`` distinct ports free on this node now (``relay.launcher.ports``)."""
        ports: list[int] = []
        while len(ports) < count:
            port = free_port()
            if port not in ports:
                ports.append(port)
        return ports

    def start(self, argv: list[str], env: dict[str, str], run_dir: str, log: str) -> int:
        """Start ``argv`` (its interpreter replaced by this worker's) with this actor's
        environment (Ray's ``CUDA_VISIBLE_DEVICES`` included) and ``env``; its pid."""
        if not (Path(run_dir) / RESOLVED_TOPOLOGY).is_file():
            raise RuntimeError(
                f"the run directory {run_dir} is not on node {socket.gethostname()}: put "
                "trainer.run_dir on a filesystem every node of the Ray cluster shares")
        full_env = child_env({k: v for k, v in env.items() if k != VISIBLE_DEVICES},
                             local=True)
        self.child = start_popen([sys.executable, *argv[1:]], full_env, Path(log),
                                 preexec=_die_with_parent)
        return self.child.popen.pid

    def poll(self) -> int | None:
        assert self.child is not None
        return self.child.poll()

    def signal(self, sig: int) -> None:
        if self.child is not None:
            self.child.signal(signal.Signals(sig))

    def group_alive(self) -> bool:
        return self.child is not None and self.child.group_alive()


class RayHandle:
    """A process run by a ``ProcessRunner`` actor, for the supervisor: ``pid`` on the
    actor's node. An actor that died (its node lost, its process killed) took its process
    with it: it reads as killed."""

    def __init__(self, actor: Any, pid: int) -> None:
        self.actor, self.pid = actor, pid
        self._code: int | None = None

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get(getattr(self.actor, method).remote(*args),
                       timeout=ACTOR_CALL_TIMEOUT_S)

    def poll(self) -> int | None:
        import ray

        if self._code is None:
            try:
                self._code = self._call("poll")
            except ray.exceptions.RayActorError:
                self._code = -signal.SIGKILL
        return self._code

    def signal(self, sig: signal.Signals) -> None:
        import ray

        try:
            self._call("signal", int(sig))
        except ray.exceptions.RayActorError:
            pass  # the actor is gone, and its process with it

    def wait(self) -> int:
        while (code := self.poll()) is None:
            time.sleep(0.1)
        return code

    def group_alive(self) -> bool:
        import ray

        try:
            return bool(self._call("group_alive"))
        except ray.exceptions.RayActorError:
            return False


class RayBackend:
    """Places and starts the plan on a Ray cluster (module docstring)."""

    name = "ray"

    def __init__(self, settings: RaySettings) -> None:
        self.settings = settings
        self.actor_options: dict[str, dict[str, Any]] = {}
        self.actors: dict[str, Any] = {}
        self.where: dict[str, dict[str, str]] = {}  # what each actor says of its node
        self.planned: dict[str, str] = {}  # process -> the Ray node id the plan gives it
        self.group: Any = None
        self.run_dir = Path()
        self._started_ray = False

    # -- placement ------------------------------------------------------------------------

    def place(self, topology: Topology, run: RunConfig) -> Topology:
        try:
            import ray
        except ImportError:
            raise missing_ray() from None
        self._connect(ray)
        wanted = demands(topology, run)
        nodes = cluster_nodes(ray.nodes())
        place(wanted, nodes)  # refuses at once what no node can hold
        self._reserve(ray, topology, wanted, nodes)
        return self._addressed(ray, topology)

    def _connect(self, ray: Any) -> None:
        settings = self.settings
        if ray.is_initialized():
            return
        if settings.address:
            ray.init(address=settings.address, namespace=settings.namespace,
                     log_to_driver=False)
        else:
            ray.init(namespace=settings.namespace, num_cpus=settings.num_cpus,
                     num_gpus=settings.num_gpus, log_to_driver=False)
            self._started_ray = True

    def _reserve(self, ray: Any, topology: Topology, wanted: list[Demand],
                 nodes: list[NodeCapacity]) -> None:
        """The learner's placement group first, then every other process pinned to the node
        ``relay.launcher.resources.place`` gives it among what the group left: the plan
        Ray follows, recorded in ``self.planned`` (process -> Ray node id)."""
        from ray.util.placement_group import placement_group, placement_group_table
        from ray.util.scheduling_strategies import (
            NodeAffinitySchedulingStrategy,
            PlacementGroupSchedulingStrategy,
        )

        learner = [d for d in wanted if d.role == "learner"]
        learner_nodes = sorted({d.learner_node for d in learner})
        bundles = [learner_bundle([d for d in learner if d.learner_node == n])
                   for n in learner_nodes]
        self.group = placement_group(bundles, strategy="STRICT_SPREAD"
                                     if len(learner_nodes) > 1 else "STRICT_PACK",
                                     name="relay-learner")
        try:
            ray.get(self.group.ready(), timeout=self.settings.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise PlacementError(
                f"Ray could not reserve the learner's {len(learner_nodes)} node(s) of "
                f"{topology.learner.nproc_per_node} rank(s) ({bundles}) within "
                f"launcher.ray.placement_timeout_s = {self.settings.placement_timeout_s:g} s"
                + (": STRICT_SPREAD needs that many distinct nodes"
                   if len(learner_nodes) > 1 else "")) from None
        bundle_nodes = placement_group_table(self.group)["bundles_to_node_id"]
        left = {node.name: node for node in nodes}
        for index, bundle in enumerate(bundles):
            left[bundle_nodes[index]] = without(left[bundle_nodes[index]], bundle)
        rest = [d for d in wanted if d.role != "learner"]
        self.planned = place(rest, list(left.values())) | {
            d.name: bundle_nodes[learner_nodes.index(d.learner_node)] for d in learner}
        runner = ray.remote(ProcessRunner)
        for demand in wanted:
            options = actor_resources(demand)
            if demand.role == "learner":
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=self.group,
                    placement_group_bundle_index=learner_nodes.index(demand.learner_node))
            else:
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                    node_id=self.planned[demand.name], soft=False)
            self.actor_options[demand.name] = options
            self.actors[demand.name] = runner.options(**options).remote()
        pending = {name: actor.where.remote() for name, actor in self.actors.items()}
        deadline = time.monotonic() + self.settings.placement_timeout_s
        for name, ref in pending.items():
            try:
                self.where[name] = ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                raise PlacementError(
                    f"Ray could not place {name} ({self.actor_options[name]}) within "
                    f"launcher.ray.placement_timeout_s = "
                    f"{self.settings.placement_timeout_s:g} s") from None

    def _addressed(self, ray: Any, topology: Topology) -> Topology:
        """The topology with the hosts the actors run on and ports picked on their nodes."""
        replace = msgspec.structs.replace
        here = boot_id()

        def host(name: str) -> str:
            where = self.where[name]
            return LOCALHOST if where["boot_id"] == here else where["ip"]

        def ports(name: str, count: int) -> list[int]:
            return ray.get(self.actors[name].free_ports.remote(count),
                           timeout=ACTOR_CALL_TIMEOUT_S)

        learner = topology.learner
        per_node = learner.nproc_per_node
        ranks = sorted((n for n in self.where if n.startswith("learner-")),
                       key=lambda n: int(n.rsplit("-", 1)[1]))
        hosts = [host(ranks[i]) for i in range(0, len(ranks), per_node)]
        weights, stream, master = ports(ranks[0], 3)
        learner = replace(learner, hosts=hosts, nnodes=len(hosts),
                          weights_port=learner.weights_port or weights,
                          weights_stream_port=learner.weights_stream_port or stream,
                          master_port=learner.master_port or master)
        buffer = replace(topology.buffer, host=host("buffer"),
                         port=topology.buffer.port or ports("buffer", 1)[0])
        generators = [replace(g, host=host(g.name)) for g in topology.generators]
        reward_models = [replace(r, host=host(r.name), port=r.port or ports(r.name, 1)[0])
                         for r in topology.reward_models]
        evaluator = topology.evaluator
        if "evaluator" in self.where:
            evaluator = replace(evaluator, host=host("evaluator"))
        launcher = topology.launcher
        address = launcher.ray.address or ray.get_runtime_context().gcs_address
        launcher = replace(launcher, metrics_port=launcher.metrics_port or free_port(),
                           ray=replace(launcher.ray, address=address))
        placed = replace(topology, buffer=buffer, learner=learner, generators=generators,
                         evaluator=evaluator, launcher=launcher, reward_models=reward_models)
        remote = sorted({h for h in [buffer.host, *hosts, *(g.host for g in generators),
                                     *(r.host for r in reward_models), evaluator.host]
                         if h != LOCALHOST})
        if remote and not topology.security.curve:
            raise PlacementError(
                f"Ray placed processes on other machines ({', '.join(remote)}), and Relay "
                "never talks over a network without CURVE: set [security] curve = true and "
                "keys_dir (tools/make-curve-keys.py), with the keys on a shared path")
        return placed

    # -- running --------------------------------------------------------------------------

    def plan(self, topology: Topology, run: RunConfig, run_dir: Path) -> list[ProcessSpec]:
        self.run_dir = run_dir
        record = {name: {"planned_node_id": self.planned[name], **where}
                  for name, where in self.where.items()}
        (run_dir / PLACEMENT_FILE).write_text(json.dumps(record, indent=1))
        return build_plan(topology, run, run_dir, learner_ranks=True)

    def start(self, spec: ProcessSpec, topology: Topology, log: Path) -> RayHandle:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor = self.actors.get(spec.name)
        if actor is None or self._dead(actor):  # a restart: a new actor, same reservation,
            options = dict(self.actor_options[spec.name])  # on its node if it still has room
            if isinstance(options.get("scheduling_strategy"), NodeAffinitySchedulingStrategy):
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                    node_id=self.planned[spec.name], soft=True)
            actor = ray.remote(ProcessRunner).options(**options).remote()
            self.actors[spec.name] = actor
        try:
            pid = ray.get(actor.start.remote(spec.argv, spec.env, str(self.run_dir), str(log)),
                          timeout=self.settings.placement_timeout_s)
        except (ray.exceptions.RayTaskError, ray.exceptions.GetTimeoutError) as exc:
            raise PlacementError(f"could not start {spec.name} on Ray: {exc}") from None
        return RayHandle(actor, pid)

    @staticmethod
    def _dead(actor: Any) -> bool:
        import ray

        try:
            ray.get(actor.group_alive.remote(), timeout=ACTOR_CALL_TIMEOUT_S)
        except ray.exceptions.RayActorError:
            return True
        return False

    def close(self) -> None:
        try:
            import ray
        except ImportError:
            return
        if not ray.is_initialized():
            return
        for actor in self.actors.values():
            ray.kill(actor)
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
        ray.shutdown()


def actor_resources(demand: Demand) -> dict[str, Any]:
    """The Ray actor options reserving ``demand``."""
    options: dict[str, Any] = {"num_cpus": demand.cpus, "num_gpus": demand.gpus,
                               "max_concurrency": 1}
    if demand.memory_gib:
        options["memory"] = int(demand.memory_gib * GIB)
    if demand.resources:
        options["resources"] = dict(demand.resources)
    return options


def learner_bundle(ranks: list[Demand]) -> dict[str, float]:
    """The placement-group bundle of one learner node: the sum of its ranks' reservations."""
    bundle: dict[str, float] = {"CPU": sum(d.cpus for d in ranks)}
    gpus = sum(d.gpus for d in ranks)
    if gpus:
        bundle["GPU"] = gpus
    memory = sum(d.memory_gib for d in ranks)
    if memory:
        bundle["memory"] = memory * GIB
    for demand in ranks:
        for name, amount in demand.resources.items():
            bundle[name] = bundle.get(name, 0.0) + amount
    return bundle


def without(node: NodeCapacity, bundle: dict[str, float]) -> NodeCapacity:
    """``node`` less what a placement-group ``bundle`` reserved on it."""
    resources = {name: amount - bundle.get(name, 0.0)
                 for name, amount in node.resources.items()}
    return msgspec.structs.replace(
        node, cpus=node.cpus - bundle.get("CPU", 0.0), gpus=node.gpus - bundle.get("GPU", 0.0),
        memory_gib=node.memory_gib - bundle.get("memory", 0.0) / GIB, resources=resources)


def cluster_nodes(nodes: list[dict[str, Any]]) -> list[NodeCapacity]:
    """Ray's live nodes (``ray.nodes()``) as capacities for ``relay.launcher.resources``."""
    capacities = []
    for node in nodes:
        if not node.get("Alive", False):
            continue
        total = dict(node.get("Resources", {}))
        custom = {k: v for k, v in total.items()
                  if k not in ("CPU", "GPU", "memory", "object_store_memory")
                  and not k.startswith("node:")}
        capacities.append(NodeCapacity(name=node["NodeID"], cpus=total.get("CPU", 0.0),
                                       gpus=total.get("GPU", 0.0),
                                       memory_gib=total.get("memory", 0.0) / GIB,
                                       resources=custom))
    return capacities


def run_attached(settings: RaySettings, spec: ProcessSpec, demand: Demand, run_dir: Path,
                 log: Path) -> int:
    """``tools/attach-generator.py --ray``: run ``spec`` (a generator joining a running
    job) in a new actor of the job's Ray cluster (``settings.address``, which the launcher
    records in the run directory's topology) reserving ``demand``; its log is copied to
    this terminal until it ends, SIGINT and SIGTERM go on to it as SIGTERM (the generator
    then detaches), and its exit code is returned."""
    try:
        import ray
    except ImportError:
        raise missing_ray() from None
    ray.init(address=settings.address or "auto", namespace=settings.namespace,
             log_to_driver=False)
    stop = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: stop.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        actor = ray.remote(ProcessRunner).options(**actor_resources(demand)).remote()
        try:
            ray.get(actor.where.remote(), timeout=settings.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise PlacementError(f"Ray could not place {spec.name} ({actor_resources(demand)}) "
                                 f"within {settings.placement_timeout_s:g} s") from None
        log.parent.mkdir(parents=True, exist_ok=True)
        log.touch()
        with open(log, errors="replace") as out:
            out.seek(0, os.SEEK_END)
            handle = RayHandle(actor, ray.get(actor.start.remote(
                spec.argv, spec.env, str(run_dir), str(log)), timeout=ACTOR_CALL_TIMEOUT_S))
            signalled = False
            while (code := handle.poll()) is None:
                if stop and not signalled:
                    handle.signal(signal.SIGTERM)
                    signalled = True
                sys.stdout.write(out.read())
                sys.stdout.flush()
                time.sleep(0.2)
            sys.stdout.write(out.read())
        return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        ray.shutdown()
