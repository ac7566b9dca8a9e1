"""The Ray backend end to end, on a local Ray cluster of three simulated nodes
(``ray.cluster_utils.Cluster``): a head, and two nodes offering two ``fake_gpu`` each, the
custom resource that stands for GPUs here.

- The embedded default (configs/topology-ray.toml, configs/arithmetic-grpo.toml) trains
  through ``tools/launch-cluster.py`` to the local backend's bar (``ACCEPTANCE_LIFT`` over
  the warm start, the same 400 steps) with the buffer and the evaluator on the head, the
  learner's two ranks on the two GPU nodes and a generator beside each, as Ray's state API
  shows; a generator's actor process killed mid-run is replaced and its generator
  re-attached within 30 s, training goes on and the buffer's accounting holds.
- ``tools/attach-generator.py --ray`` adds a generator to such a run as an actor of the
  same cluster; killing the buffer's actor process ends the run, naming it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomli_w
from mlflow.tracking import MlflowClient

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from .conftest import ACCEPTANCE_LIFT, LAUNCHER, ROOT, processes_mentioning, small_run_overrides
from .test_failures import first_run_dir, pid_of, wait_for

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RAY_TOPOLOGY = ROOT / "configs" / "topology-ray.toml"
ATTACH = ROOT / "tools" / "attach-generator.py"
GPU_NODES = ("node_a", "node_b")


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    from ray.cluster_utils import Cluster

    local = Cluster(initialize_head=True,
                    head_node_args={"num_cpus": 3, "resources": {"head": 1}})
    for node in GPU_NODES:  # a CPU each to spare: a generator attached, one started again
        local.add_node(num_cpus=3, resources={"fake_gpu": 2, node: 1})
    local.wait_for_nodes()
    yield local
    local.shutdown()


def ray_topology(path: Path, address: str, generator_gpus: int = 1) -> Path:
    """configs/topology-ray.toml joined to ``address``: the buffer and the evaluator on
    the head, the learner on two nodes of one rank each, each rank holding one
    ``fake_gpu`` and each generator ``generator_gpus``."""
    topology = tomllib.loads(RAY_TOPOLOGY.read_text())
    topology["launcher"]["ray"]["address"] = address
    topology["buffer"]["resources"] = {"head": 0.5}
    topology["evaluator"]["resources"] = {"head": 0.5}
    topology["learner"] |= {"nnodes": 2, "nproc_per_node": 1, "resources": {"fake_gpu": 1}}
    for generator in topology["generators"]:
        generator["resources"] = {"fake_gpu": generator_gpus} if generator_gpus else {}
    path.write_text(tomli_w.dumps(topology))
    return path


def start_launcher(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(LAUNCHER), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env=dict(os.environ, RELAY_LOG_LEVEL="INFO"))


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def node_names(cluster_address: str) -> dict[str, str]:
    """Ray's node id of the head and of each GPU node, by its custom resource."""
    names = {}
    for node in ray.nodes():
        for name in ("head", *GPU_NODES):
            if name in node["Resources"]:
                names[node["NodeID"]] = name
    return names


def check_placement(run_dir: Path, address: str) -> None:
    """Every actor sits on the node the plan put it on (``ray-placement.json``), as Ray's
    state API reports, and the plan is the one the topology asks for."""
    from ray.util.state import list_actors

    placed = json.loads((run_dir / "ray-placement.json").read_text())
    ray.init(address=address, namespace="relay-test", log_to_driver=False)
    try:
        names = node_names(address)
        actors = {a.actor_id: a for a in list_actors(filters=[("class_name", "=",
                                                               "ProcessRunner")], limit=1000)}
        for process, where in placed.items():  # Ray's state API: each where the plan said
            assert actors[where["actor_id"]].node_id == where["planned_node_id"], process
        node = {process: names[where["node_id"]] for process, where in placed.items()}
    finally:
        ray.shutdown()
    assert node["buffer"] == node["evaluator"] == "head", node
    assert {node["learner-0"], node["learner-1"]} == set(GPU_NODES), node
    assert {node["gen0"], node["gen1"]} == set(GPU_NODES), node


def test_the_embedded_default_trains_on_ray_and_a_killed_generator_comes_back(
        cluster, run_root: Path, tmp_path: Path) -> None:
    topology = ray_topology(tmp_path / "topology-ray.toml", cluster.address)
    tracking = tmp_path / "mlflow.db"
    launcher = start_launcher([str(topology), str(ROOT / "configs" / "arithmetic-grpo.toml"),
                               f"trainer.run_dir={run_root}",
                               f"tracking.uri=sqlite:///{tracking}"])
    try:
        run_dir = first_run_dir(run_root, timeout_s=300)
        buffer_log = run_dir / "logs" / "buffer.log"
        wait_for(buffer_log, r"generator gen0 attached", 300)
        check_placement(run_dir, cluster.address)
        wait_for(run_dir / "logs" / "gen0.log", r"lease L\d+", 300)
        time.sleep(30)  # mid-run
        generator = pid_of(run_dir, "relay.generators.main", "--name gen0")
        os.kill(parent_of(generator), signal.SIGKILL)  # its actor's worker process
        killed = time.monotonic()
        attached = r"generator gen0 attached(?:.|\n)*generator gen0 attached"
        wait_for(buffer_log, attached, 30)
        reattached_s = time.monotonic() - killed
        output, _ = launcher.communicate(timeout=1800)
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGINT)
            launcher.communicate(timeout=120)
    assert launcher.returncode == 0, output[-5000:]
    assert reattached_s <= 30
    assert re.search(r"generator gen0 died \(killed by SIGKILL\); starting it again", output)
    summary = output[output.rindex("relay launch: run finished"):]
    assert summary.splitlines()[1].split()[:2] == ["steps", "400/400"], summary
    client = MlflowClient(tracking_uri=f"sqlite:///{tracking}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    history = sorted(client.get_metric_history(run.info.run_id, "eval/accuracy"),
                     key=lambda m: m.step)
    lift = statistics.mean(m.value for m in history[-3:]) - history[0].value
    assert lift >= ACCEPTANCE_LIFT, [(m.step, m.value) for m in history]
    accounting = client.get_metric_history(run.info.run_id, "buffer/accounting_problems")
    assert accounting and all(m.value == 0 for m in accounting)
    assert processes_mentioning(str(run_dir)) == []


def test_a_generator_attaches_as_an_actor_and_a_killed_buffer_ends_the_run(
        cluster, random_model_dir: Path, run_root: Path, tmp_path: Path) -> None:
    """``tools/attach-generator.py --ray`` joins a Ray-launched run as an actor of the same
    cluster and detaches on SIGTERM; then the buffer's actor process is killed and the run
    ends, naming the buffer."""
    # CPU-only generators: the attached one, reserving what they do, finds room
    topology = ray_topology(tmp_path / "topology-ray.toml", cluster.address, generator_gpus=0)
    args = [a for a in small_run_overrides(random_model_dir, run_root, steps=100000)
            if not a.startswith("topology.")]
    launcher = start_launcher([str(topology), str(ROOT / "configs" / "arithmetic-grpo.toml"),
                               *args, "trainer.val_before_train=false", "trainer.test_freq=-1",
                               f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    attached = None
    try:
        run_dir = first_run_dir(run_root, timeout_s=300)
        wait_for(run_dir / "logs" / "gen0.log", r"lease L\d+", 300)
        attached = subprocess.Popen([sys.executable, str(ATTACH), str(run_dir), "--ray",
                                     "--name", "extra", "--threads", "1"],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    cwd=ROOT)
        try:
            wait_for(run_dir / "logs" / "extra.log", r"lease L\d+", 180)
        except AssertionError:
            attached.kill()
            raise AssertionError(attached.communicate()[0]) from None
        generator = pid_of(run_dir, "relay.generators.main", "--name extra")
        worker = Path(f"/proc/{parent_of(generator)}/cmdline").read_bytes()
        assert b"ray" in worker.lower(), worker  # a Ray worker runs it
        attached.send_signal(signal.SIGTERM)
        said, _ = attached.communicate(timeout=120)
        assert attached.returncode == 0, said
        assert "its unfinished leases went back to the pool" in said
        os.kill(parent_of(pid_of(run_dir, "relay.buffer.main")), signal.SIGKILL)
        output, _ = launcher.communicate(timeout=300)
    finally:
        for process in (attached, launcher):
            if process is not None and process.poll() is None:
                process.kill()
    assert launcher.returncode == 1, output
    assert "essential process buffer (buffer) died: killed by SIGKILL" in output
    buffer_log = (run_dir / "logs" / "buffer.log").read_text()
    assert "generator extra detached (stopping)" in buffer_log
    assert processes_mentioning(str(run_dir)) == []
