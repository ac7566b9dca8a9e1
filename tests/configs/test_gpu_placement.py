"""GPU accounting in the topology: each process's ``gpus`` fit its device and its ranks or
engine, and no GPU of a host is listed by two processes (``relay.configs.gpu_placement``)."""

from __future__ import annotations

import pytest

from relay.configs import DEFAULT_TOPOLOGY, ConfigError
from relay.configs.checks import load_topology
from relay.configs.gpu_placement import check_gpu_placement, topology_claims
from relay.configs.topology_schema import (
    EvaluatorPlacement,
    GeneratorPlacement,
    LearnerPlacement,
    Topology,
)
from relay.configs.verl_keys import Placement


def load(*overrides: str, placement: list[Placement] | None = None) -> Topology:
    return load_topology(DEFAULT_TOPOLOGY, overrides, placement or [])


def refusal(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        load(*overrides)
    return caught.value


def test_the_default_topology_lists_no_gpus_and_passes() -> None:
    topology = load()
    assert topology.learner.gpus is None and topology.evaluator.gpus is None
    assert all(g.gpus is None for g in topology.generators)
    check_gpu_placement(topology_claims(topology, evaluates=True), "t.toml")


def test_gpus_with_a_cpu_device_are_refused_naming_both_keys() -> None:
    error = refusal("learner.gpus=[0]")
    assert error.key == "learner.gpus"
    assert "learner.device is 'cpu'" in error.problem and "'cuda'" in error.problem


def test_a_numbered_cuda_device_with_gpus_points_at_gpus() -> None:
    error = refusal("generators[0].gpus=[3]", "generators[0].device=cuda:3")
    assert error.key == "generators[0].device"
    assert "sees only its GPUs, as cuda:0 to cuda:0" in error.problem
    assert "set generators[0].device to 'cuda' (it runs on GPU 3)" in error.problem


def test_a_numbered_cuda_device_without_gpus_keeps_working() -> None:
    assert load("generators[0].device=cuda:1").generators[0].device == "cuda:1"


def test_the_learner_lists_one_gpu_per_local_rank() -> None:
    topology = load("learner.device=cuda", "learner.nproc_per_node=2", "learner.gpus=[2, 3]")
    assert topology.learner.gpus == [2, 3]
    error = refusal("learner.device=cuda", "learner.nproc_per_node=2", "learner.gpus=[2]")
    assert error.key == "learner.gpus"
    assert "1 GPU(s) for learner.nproc_per_node = 2" in error.problem


def test_a_gpu_listed_twice_or_an_empty_list_is_refused() -> None:
    assert "GPU 1 more than once" in refusal(
        "learner.device=cuda", "learner.nproc_per_node=2", "learner.gpus=[1, 1]").problem
    assert "is empty" in refusal("generators[0].device=cuda", "generators[0].gpus=[]").problem


def test_relays_engines_take_one_gpu_and_vllm_one_per_tensor_parallel_shard() -> None:
    error = refusal("generators[0].device=cuda", "generators[0].gpus=[0, 1]")
    assert error.key == "generators[0].gpus" and "'lean' engine runs on one" in error.problem
    error = refusal("evaluator.engine=vllm", "evaluator.device=cuda", "evaluator.gpus=[4]",
                    "evaluator.vllm.tensor_model_parallel_size=2")
    assert error.key == "evaluator.gpus" and "tensor_model_parallel_size = 2" in error.problem
    assert load("evaluator.engine=vllm", "evaluator.device=cuda", "evaluator.gpus=[4, 5]",
                "evaluator.vllm.tensor_model_parallel_size=2").evaluator.gpus == [4, 5]


def test_verls_gpus_per_node_must_agree_with_the_learners_gpus() -> None:
    verl = [Placement(key="trainer.n_gpus_per_node", value=4, source="run.toml")]
    with pytest.raises(ConfigError) as caught:
        load("learner.device=cuda", "learner.nproc_per_node=2", "learner.gpus=[0, 1]",
             placement=verl)
    assert (caught.value.source, caught.value.key) == ("run.toml", "trainer.n_gpus_per_node")
    assert "learner.gpus lists 2 GPU(s)" in caught.value.problem
    agreeing = [Placement(key="trainer.n_gpus_per_node", value=2, source="run.toml")]
    assert load("learner.device=cuda", "learner.gpus=[0, 1]",
                placement=agreeing).learner.nproc_per_node == 2
    # without learner.gpus, verl's key sets the ranks per host as before
    assert load(placement=verl).learner.nproc_per_node == 4


def gpu_topology(*generators: GeneratorPlacement,
                 learner_hosts: tuple[str, ...] = ("127.0.0.1",),
                 evaluator: EvaluatorPlacement | None = None) -> Topology:
    """A learner of two ranks on GPUs 0 and 1 of each of ``learner_hosts``."""
    return Topology(learner=LearnerPlacement(hosts=list(learner_hosts), nproc_per_node=2,
                                             device="cuda", gpus=[0, 1]),
                    generators=list(generators),
                    evaluator=evaluator or EvaluatorPlacement())


def placement_refusal(topology: Topology, evaluates: bool = True) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        check_gpu_placement(topology_claims(topology, evaluates), "t.toml")
    return caught.value


def test_a_gpu_two_processes_list_on_one_host_is_refused_naming_both() -> None:
    topology = gpu_topology(GeneratorPlacement(name="g0", device="cuda", gpus=[2]),
                            GeneratorPlacement(name="g1", host="localhost", device="cuda",
                                               gpus=[1]))
    error = placement_refusal(topology)
    assert (error.source, error.key) == ("t.toml", "generators[1].gpus")
    assert error.problem.startswith("GPU 1 of this machine is listed by both learner "
                                    "(learner.gpus = [0, 1]) and generator g1 "
                                    "(generators[1].gpus = [1])")


def test_the_same_gpu_on_two_hosts_is_two_gpus() -> None:
    topology = gpu_topology(GeneratorPlacement(name="g0", host="10.0.0.7", device="cuda",
                                               gpus=[0]),
                            learner_hosts=("10.0.0.5", "10.0.0.6"))
    check_gpu_placement(topology_claims(topology, evaluates=False), "t.toml")
    crowded = gpu_topology(GeneratorPlacement(name="g0", host="10.0.0.6", device="cuda",
                                              gpus=[1]),
                           learner_hosts=("10.0.0.5", "10.0.0.6"))
    assert "GPU 1 of 10.0.0.6 is listed by both learner@10.0.0.6" in placement_refusal(
        crowded).problem


def test_the_evaluator_counts_only_when_the_run_evaluates() -> None:
    topology = gpu_topology(GeneratorPlacement(name="g0", device="cuda", gpus=[2]),
                            evaluator=EvaluatorPlacement(device="cuda", gpus=[2]))
    check_gpu_placement(topology_claims(topology, evaluates=False), "t.toml")
    error = placement_refusal(topology, evaluates=True)
    assert error.key == "evaluator.gpus"
    assert "GPU 2 of this machine is listed by both generator g0" in error.problem


def test_a_cuda_process_without_gpus_beside_one_that_lists_them_is_refused() -> None:
    topology = gpu_topology(GeneratorPlacement(name="g0", device="cuda:0"))
    error = placement_refusal(topology)
    assert error.key == "generators[0].gpus"
    assert "generator g0 runs on 'cuda:0' on this machine without a gpus list" in error.problem
    # on the CPU it takes no GPU, and on another host it is not counted here
    check_gpu_placement(topology_claims(gpu_topology(GeneratorPlacement(name="g0")), True), "t")
    elsewhere = gpu_topology(GeneratorPlacement(name="g0", host="10.0.0.9", device="cuda"))
    check_gpu_placement(topology_claims(elsewhere, True), "t")


def test_a_topology_that_lists_no_gpus_is_not_accounted() -> None:
    """Today's topologies: several processes may name cuda:0; nothing is checked or set."""
    topology = Topology(learner=LearnerPlacement(device="cuda"),
                        generators=[GeneratorPlacement(name="g0", device="cuda:0")],
                        evaluator=EvaluatorPlacement(device="cuda:0"))
    check_gpu_placement(topology_claims(topology, evaluates=True), "t.toml")
