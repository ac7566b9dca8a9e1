"""The Ray backend's placement and process handles, on a local Ray cluster of two simulated
nodes (a head, and a node offering one ``fake_gpu``); the whole run is tests/e2e/test_ray.py."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from relay.configs.checks import load_run_config
from relay.configs.rundir import RESOLVED_TOPOLOGY
from relay.configs.topology_schema import GeneratorPlacement, RaySettings, Topology
from relay.launcher.backends import PlacementError
from relay.launcher.plan import ProcessSpec
from relay.launcher.ray_backend import (
    RayBackend,
    actor_resources,
    cluster_nodes,
    learner_bundle,
)
from relay.launcher.resources import Demand

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[3]
RUN = load_run_config(ROOT / "configs" / "arithmetic-grpo.toml")


def rank(node: int, **fields: object) -> Demand:
    return Demand(name=f"learner-{node}", role="learner", section="learner", cpus=1.0,
                  gpus=1, memory_gib=2.0, learner_node=node, **fields)  # type: ignore[arg-type]


def test_a_learner_bundle_holds_its_nodes_ranks() -> None:
    ranks = [rank(0, resources={"fake_gpu": 1.0}), rank(0, resources={"fake_gpu": 1.0})]
    assert learner_bundle(ranks) == {"CPU": 2.0, "GPU": 2, "memory": 4.0 * (1 << 30),
                                     "fake_gpu": 2.0}


def test_an_actor_reserves_its_process_demand() -> None:
    generator = Demand(name="gen0", role="generator", section="generators[0]", cpus=2.0,
                       gpus=4, memory_gib=0.0, resources={"node_a": 0.5})
    assert actor_resources(generator) == {"num_cpus": 2.0, "num_gpus": 4,
                                          "max_concurrency": 1,
                                          "resources": {"node_a": 0.5}}


def test_rays_nodes_become_capacities_without_its_bookkeeping_resources() -> None:
    nodes = cluster_nodes([
        {"NodeID": "a", "Alive": True, "Resources": {"CPU": 4.0, "GPU": 2.0,
                                                      "memory": 8.0 * (1 << 30),
                                                      "object_store_memory": 1e9,
                                                      "node:10.0.0.2": 1.0, "fake_gpu": 2.0}},
        {"NodeID": "gone", "Alive": False, "Resources": {"CPU": 64.0}}])
    assert [(n.name, n.cpus, n.gpus, n.memory_gib, n.resources) for n in nodes] == [
        ("a", 4.0, 2.0, 8.0, {"fake_gpu": 2.0})]


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    from ray.cluster_utils import Cluster

    local = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    local.add_node(num_cpus=2, resources={"fake_gpu": 1})
    local.wait_for_nodes()
    yield local
    local.shutdown()


def ray_topology(address: str, **generator: object) -> Topology:
    topology = Topology()
    return msgspec.structs.replace(
        topology, generators=[GeneratorPlacement(name="gen0", **generator)],  # type: ignore[arg-type]
        launcher=msgspec.structs.replace(topology.launcher, backend="ray",
                                         ray=RaySettings(address=address,
                                                         placement_timeout_s=120)))


def test_a_plan_no_node_can_hold_is_refused_naming_the_process(cluster) -> None:
    backend = RayBackend(RaySettings(address=cluster.address))
    try:
        with pytest.raises(PlacementError, match="gen0"):
            backend.place(ray_topology(cluster.address, resources={"fake_gpu": 2}), RUN)
    finally:
        backend.close()
    assert not backend.actors  # refused before anything was reserved


def test_processes_run_in_actors_placed_as_asked_and_die_with_them(
        cluster, tmp_path: Path) -> None:
    backend = RayBackend(RaySettings(address=cluster.address, placement_timeout_s=120))
    try:
        placed = backend.place(ray_topology(cluster.address, resources={"fake_gpu": 1}), RUN)
        # one machine: every node is this one, named by loopback (no CURVE needed)
        assert {placed.buffer.host, *placed.learner.hosts, placed.generators[0].host} == \
            {"127.0.0.1"}
        assert placed.buffer.port and placed.learner.master_port
        fake_gpu_node = next(n["NodeID"] for n in ray.nodes() if "fake_gpu" in n["Resources"])
        assert backend.where["gen0"]["node_id"] == backend.planned["gen0"] == fake_gpu_node
        assert all(backend.where[name]["node_id"] == node
                   for name, node in backend.planned.items())
        (tmp_path / RESOLVED_TOPOLOGY).write_text("")
        plan = backend.plan(placed, RUN, tmp_path)
        assert [s.name for s in plan if s.role == "learner"] == ["learner-0"]
        said = ProcessSpec(name="gen0", role="generator", host="127.0.0.1",
                           argv=[sys.executable, "-c", "import os; print('hello', "
                                 "os.environ['WHO'])"], env={"WHO": "gen0"})
        handle = backend.start(said, placed, tmp_path / "gen0.log")
        assert handle.wait() == 0
        assert (tmp_path / "gen0.log").read_text() == "hello gen0\n"
        sleeper = ProcessSpec(name="buffer", role="buffer", host="127.0.0.1",
                              argv=[sys.executable, "-c", "import time; time.sleep(600)"])
        handle = backend.start(sleeper, placed, tmp_path / "buffer.log")
        assert handle.poll() is None and handle.group_alive()
        os.kill(parent_of(handle.pid), signal.SIGKILL)  # the actor's process
        deadline = time.monotonic() + 90  # a loaded machine: Ray notices late
        while handle.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert handle.poll() == -signal.SIGKILL
        # Ray may see the actor's socket close before the kernel sends the child its
        # parent-death signal: the child goes a moment later
        deadline = time.monotonic() + 30
        while not gone(handle.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(handle.pid)
    finally:
        backend.close()


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited (reaped, or a zombie waiting for its new parent)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return True
    return state in "ZX"


def test_the_dry_run_shows_each_learner_rank_and_what_each_process_reserves(
        tmp_path: Path) -> None:
    from relay.launcher.resolve import dry_run_report, resolve_launch

    topology = tmp_path / "topology-ray.toml"
    topology.write_text((ROOT / "configs" / "topology-ray.toml").read_text().replace(
        'name = "gen0"', 'name = "gen0"\nresources = { fake_gpu = 1 }'))
    resolved = resolve_launch(str(topology), str(ROOT / "configs" / "arithmetic-grpo.toml"),
                              ["learner.nproc_per_node=2"], [f"trainer.run_dir={tmp_path}"])
    assert [p.name for p in resolved.processes if p.role == "learner"] == ["learner-0",
                                                                           "learner-1"]
    report = dry_run_report(resolved)
    assert "# Hosts and ports: chosen at launch by Ray" in report
    assert "#   learner-1: 1 CPU(s), 0 GPU(s)" in report
    assert "#   gen0: 1 CPU(s), 0 GPU(s), 1 fake_gpu" in report
