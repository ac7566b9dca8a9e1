"""``relay.launcher.resources``: each process's demand, placed on nodes or checked on this
machine, and refused naming the process and what is missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.configs import DEFAULT_TOPOLOGY, ConfigError, load_topology
from relay.configs.run_schema import DataConfig, ModelConfig, RunConfig
from relay.configs.topology_schema import (
    EvaluatorPlacement,
    GeneratorPlacement,
    LearnerPlacement,
    SGLangOptions,
    Topology,
    VLLMOptions,
)
from relay.launcher import resources
from relay.launcher.backends import PlacementError
from relay.launcher.resources import (
    Demand,
    NodeCapacity,
    check_local,
    demands,
    meminfo_total_gib,
    place,
)

EVALUATES = RunConfig(data=DataConfig(train_files="t.jsonl", val_files="v.jsonl"),
                      model=ModelConfig(path="m"))
NO_EVALUATION = RunConfig(data=DataConfig(train_files="t.jsonl"), model=ModelConfig(path="m"))
GPU_TOPOLOGY = Topology(
    learner=LearnerPlacement(device="cuda", nnodes=2, nproc_per_node=2, cpus=4, memory_gib=32,
                             resources={"trainer": 1}),
    generators=[GeneratorPlacement(name="tp2", device="cuda", engine="vllm",
                                   vllm=VLLMOptions(tensor_model_parallel_size=2)),
                GeneratorPlacement(name="one", device="cuda:1", cpus=2),
                GeneratorPlacement(name="listed", device="cuda", engine="sglang", gpus=[2, 3],
                                   sglang=SGLangOptions(tensor_model_parallel_size=2))],
    evaluator=EvaluatorPlacement(device="cpu", memory_gib=4))


def test_the_default_topology_asks_one_cpu_per_process_and_no_gpu() -> None:
    found = demands(load_topology(DEFAULT_TOPOLOGY), EVALUATES)
    assert [(d.name, d.role, d.section) for d in found] == [
        ("buffer", "buffer", "buffer"), ("learner-0", "learner", "learner"),
        ("gen0", "generator", "generators[0]"), ("evaluator", "evaluator", "evaluator")]
    assert {(d.cpus, d.gpus, d.memory_gib) for d in found} == {(1.0, 0, 0.0)}
    assert not any(d.devices for d in found) and found[1].learner_node == 0
    assert [d.name for d in demands(load_topology(DEFAULT_TOPOLOGY), NO_EVALUATION)] == [
        "buffer", "learner-0", "gen0"]  # no evaluator without held-out data


def test_gpus_follow_the_device_the_list_and_the_tensor_parallel_size() -> None:
    found = {d.name: d for d in demands(GPU_TOPOLOGY, EVALUATES)}
    ranks = [found[f"learner-{rank}"] for rank in range(4)]  # 2 nodes x 2 ranks
    assert [(r.learner_node, r.gpus, r.cpus, r.memory_gib) for r in ranks] == [
        (0, 1, 4, 32), (0, 1, 4, 32), (1, 1, 4, 32), (1, 1, 4, 32)]
    assert [r.devices for r in ranks] == [[0], [1], [0], [1]]  # cuda:LOCAL_RANK
    assert ranks[0].resources == {"trainer": 1} and ranks[0].what == "learner rank 0"
    assert (found["tp2"].gpus, found["tp2"].devices) == (2, [0, 1])
    assert found["tp2"].devices_key == "generators[0].vllm.tensor_model_parallel_size"
    assert (found["one"].gpus, found["one"].devices, found["one"].devices_key) == (
        1, [1], "generators[1].device")
    assert (found["listed"].gpus, found["listed"].devices, found["listed"].devices_key) == (
        2, [2, 3], "generators[2].gpus")
    assert (found["evaluator"].gpus, found["evaluator"].memory_gib) == (0, 4)
    assert found["listed"].what == "generator listed"


def demand(name: str, gpus: int = 0, cpus: float = 1, memory_gib: float = 0,
           resources: dict[str, float] | None = None, learner_node: int | None = None) -> Demand:
    return Demand(name=name, role="learner" if learner_node is not None else "generator",
                  section="generators[0]", cpus=cpus, gpus=gpus, memory_gib=memory_gib,
                  resources=resources or {}, learner_node=learner_node)


def node(name: str, gpus: float, cpus: float = 16, memory_gib: float = 0,
         **custom: float) -> NodeCapacity:
    return NodeCapacity(name=name, cpus=cpus, gpus=gpus, memory_gib=memory_gib, resources=custom)


def test_place_puts_bigger_demands_first_and_each_learner_node_on_a_node_of_its_own() -> None:
    found = demands(GPU_TOPOLOGY, EVALUATES)
    nodes = [node("a", 2), node("b", 4, trainer=2), node("c", 4, trainer=2)]
    placed = place(found, nodes)
    # the learner nodes (2 GPUs, 8 CPUs each) go first, on the two nodes offering 'trainer'
    assert [placed[f"learner-{r}"] for r in range(4)] == ["b", "b", "c", "c"]
    assert (placed["tp2"], placed["listed"], placed["one"]) == ("a", "b", "c")
    assert placed["buffer"] == "a" and placed["evaluator"] == "a"
    assert list(placed) == [d.name for d in found] and place(found, nodes) == placed


def test_learner_nodes_never_share_a_node() -> None:
    ranks = [demand(f"learner-{r}", gpus=1, learner_node=r) for r in range(2)]
    assert place(ranks, [node("a", 2), node("b", 1)]) == {"learner-0": "a", "learner-1": "b"}
    with pytest.raises(PlacementError) as refused:
        place(ranks, [node("a", 8)])
    assert str(refused.value) == (
        "learner node 1 (rank 1) needs a node of its own with 1 GPU(s), 1 CPU(s) free, but "
        "each node that has them holds another learner node (a: learner node 0)")
    with pytest.raises(PlacementError) as refused:
        place(ranks, [node("a", 1), node("b", 0)])
    assert str(refused.value) == ("learner node 1 (rank 1) needs 1 GPU(s) but no node has "
                                  "them free (a: taken by learner node 0, b: 0 free)")


def test_a_plan_that_cannot_be_placed_names_the_process_and_the_missing_resource() -> None:
    nodes = [node("node-a", 2), node("node-b", 4)]
    assert place([demand("gen0", gpus=2), demand("gen1", gpus=4)], nodes) == {
        "gen0": "node-a", "gen1": "node-b"}  # gen1, the bigger, placed first
    with pytest.raises(PlacementError) as refused:
        place([demand("gen0", gpus=4), demand("gen1", gpus=4)], nodes)
    assert str(refused.value) == ("generator gen1 needs 4 GPU(s) but no node has them free "
                                  "(node-a: 2 free, node-b: 0 free)")
    with pytest.raises(PlacementError) as refused:
        place([demand("gen0", resources={"node_c": 1})], [node("node-a", 1, node_b=1)])
    assert str(refused.value) == ("the cluster has no node with custom resource 'node_c': "
                                  "generator gen0 asks for 1 of it")
    with pytest.raises(PlacementError) as refused:
        place([demand("gen0", memory_gib=64)], [node("a", 1, memory_gib=32)])
    assert str(refused.value) == ("generator gen0 needs 64 GiB of memory but no node has it "
                                  "free (a: 32 free)")


def test_resources_each_free_somewhere_but_not_together_are_refused_as_such() -> None:
    with pytest.raises(PlacementError) as refused:
        place([demand("gen0", gpus=2, cpus=8)], [node("a", 2, cpus=4), node("b", 0, cpus=8)])
    assert str(refused.value) == (
        "generator gen0 needs 2 GPU(s), 8 CPU(s) on one node, but no node has them all free "
        "(a: 2 GPU(s) free, 4 CPU(s) free; b: 0 GPU(s) free, 8 CPU(s) free)")


def test_fractional_cpus_that_add_up_to_a_node_fit_it() -> None:
    tenths = [demand(f"g{i}", cpus=0.1) for i in range(10)]
    assert set(place(tenths, [node("a", 0, cpus=1)]).values()) == {"a"}


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch):
    """This machine as ``check_local`` sees it: ``machine(gpus, memory_gib)``."""
    def set_machine(gpus: int, memory_gib: float | None = 64.0) -> None:
        monkeypatch.setattr(resources, "cuda_device_count", lambda: gpus)
        monkeypatch.setattr(resources, "meminfo_total_gib", lambda: memory_gib)
    return set_machine


def local_gpu_topology(device: str, gpus: list[int] | None = None) -> Topology:
    return Topology(learner=LearnerPlacement(device="cuda", nproc_per_node=2, gpus=[0, 1]),
                    generators=[GeneratorPlacement(name="gen0", device=device, gpus=gpus)])


def test_check_local_refuses_a_gpu_this_machine_lacks_naming_process_and_key(
        machine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    machine(gpus=2)
    check_local(demands(local_gpu_topology(device="cuda:1"), NO_EVALUATION), "t.toml")
    with pytest.raises(ConfigError) as refused:
        check_local(demands(local_gpu_topology(device="cuda", gpus=[2]), NO_EVALUATION),
                    "t.toml")
    assert (refused.value.source, refused.value.key) == ("t.toml", "generators[0].gpus")
    assert refused.value.problem == (
        "generator gen0 runs on GPU 2 of this machine, which has 2 GPU(s) "
        "(torch.cuda.device_count()): list GPUs it has, or run it on 'cpu'")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # the list replaces it: not counted
    check_local(demands(local_gpu_topology(device="cuda", gpus=[2]), NO_EVALUATION), "t.toml")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    machine(gpus=0)
    with pytest.raises(ConfigError) as refused:
        check_local(demands(Topology(learner=LearnerPlacement(device="cuda")), NO_EVALUATION),
                    "t.toml")
    assert refused.value.key == "learner.nproc_per_node"
    assert refused.value.problem.startswith("learner rank 0 runs on GPU 0 of this machine, "
                                            "which has 0 GPU(s)")


def test_check_local_refuses_more_memory_than_the_machine_has_but_never_cpus(machine) -> None:
    machine(gpus=0, memory_gib=15.5)
    greedy = Topology(learner=LearnerPlacement(memory_gib=12, cpus=64),
                      generators=[GeneratorPlacement(name="gen0", memory_gib=4, cpus=64)])
    with pytest.raises(ConfigError) as refused:
        check_local(demands(greedy, NO_EVALUATION), "t.toml")
    assert refused.value.key == "learner.memory_gib"
    assert refused.value.problem == (
        "the processes of this machine ask for 16 GiB of memory together (learner rank 0 12, "
        "generator gen0 4), but it has 15.5 GiB (/proc/meminfo MemTotal); learner rank 0 "
        "asks for the most: lower it")
    machine(gpus=0, memory_gib=16)
    check_local(demands(greedy, NO_EVALUATION), "t.toml")  # 128 CPUs asked: time-shared
    machine(gpus=0, memory_gib=None)
    check_local(demands(greedy, NO_EVALUATION), "t.toml")  # memory unknown: not checked


def test_meminfo_total_is_read_in_gib(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemFree:  1024 kB\nMemTotal:       16777216 kB\n")
    assert meminfo_total_gib(meminfo) == 16.0
    assert meminfo_total_gib(tmp_path / "absent") is None
