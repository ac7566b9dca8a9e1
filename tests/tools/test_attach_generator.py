"""tools/attach-generator.py's placement: an attached generator's GPUs are set as the
topology's are (``CUDA_VISIBLE_DEVICES``) and never one a process of the run lists on its
host. (Attaching to a live run end to end: tests/e2e/test_attach.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from relay import attach
from relay.configs import ConfigError
from relay.configs.rundir import RunContext
from relay.configs.run_schema import DataConfig, ModelConfig, RunConfig
from relay.configs.topology_schema import GeneratorPlacement, LearnerPlacement, Topology


CONTEXT = RunContext(
    run_dir=Path("/runs/x"),
    topology=Topology(learner=LearnerPlacement(device="cuda", gpus=[0]),
                      generators=[GeneratorPlacement(name="gen0", device="cuda", gpus=[1])]),
    run=RunConfig(data=DataConfig(train_files="train.jsonl"), model=ModelConfig(path="m")))


def placed(*argv: str) -> tuple[GeneratorPlacement, dict[str, str]]:
    args = attach.parse_args(["/runs/x", *argv])
    placement = attach.attached_placement(CONTEXT, args, "extra")
    return placement, attach.generator_spec(CONTEXT, args, "extra", placement).env


def test_gpus_given_are_the_attached_generators_visible_devices() -> None:
    placement, env = placed("--gpus", "2")
    assert placement.gpus == [2] and placement.device == "cuda"
    assert env["CUDA_VISIBLE_DEVICES"] == "2"
    placement, env = placed("--host", "10.0.0.8")  # the first generator's, on another host
    assert env["CUDA_VISIBLE_DEVICES"] == "1"


def test_a_gpu_a_process_of_the_run_lists_here_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError) as caught:  # the first generator's GPU, on its host
        placed()
    assert caught.value.key == "--gpus"
    assert caught.value.problem.startswith("GPU 1 of this machine is listed by both generator "
                                           "gen0 (generators[0].gpus = [1]) and generator "
                                           "extra (--gpus = [1])")
    with pytest.raises(ConfigError) as caught:
        placed("--gpus", "0")
    assert "listed by both learner (learner.gpus = [0])" in caught.value.problem


def test_on_the_cpu_it_takes_no_gpu() -> None:
    placement, env = placed("--device", "cpu")
    assert placement.gpus is None and env == {}
    with pytest.raises(ConfigError) as caught:
        placed("--device", "cpu", "--gpus", "3")
    assert caught.value.key == "--gpus" and "--device is 'cpu'" in caught.value.problem


def test_gpus_are_comma_separated_indices() -> None:
    assert attach.parse_args(["/runs/x", "--gpus", "2,3"]).gpus == [2, 3]
    with pytest.raises(SystemExit):
        attach.parse_args(["/runs/x", "--gpus", "two"])
