"""relay.launcher.memory: the launch warns about a process on this machine's GPUs whose memory plan
does not fit its GPU (Qwen2.5-7B's config alone, no weights), never about a CPU run."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import relay.launcher.memory as memory
import relay.launcher.resources as resources
from relay.configs import DEFAULT_RUN
from relay.configs.checks import load_run_config
from relay.configs.run_schema import RunConfig
from relay.configs.topology_schema import (
    GeneratorPlacement,
    LeanOptions,
    LearnerPlacement,
    Topology,
)
from relay import launch
from relay.launcher.memory import local_gpu_bytes, memory_warnings

from ...qwen25_configs import QWEN25_7B, write_config

GIB = 1 << 30
FITTING = ["model.enable_gradient_checkpointing=true", "actor.use_dynamic_bsz=true",
           "actor.ppo_max_token_len_per_gpu=16384"]


@pytest.fixture(scope="module")
def qwen7b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_config(tmp_path_factory.mktemp("qwen2.5-7b"), QWEN25_7B)


def warnings(run: RunConfig, topology: Topology, memory: list[int]) -> list[str]:
    """``memory_warnings`` of the default run file's ``run`` on GPUs of ``memory`` bytes."""
    return memory_warnings(run, topology, str(DEFAULT_RUN), memory=memory)


def launch_dry_run(*args: str) -> int:
    return launch.main([*args, "--dry-run"])


def test_a_learner_whose_plan_does_not_fit_its_gpus_is_warned_about_at_launch(
        qwen7b: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(memory, "local_gpu_memory", lambda: [80 * GIB] * 8)
    monkeypatch.setattr(resources, "cuda_device_count", lambda: 8)  # the launch's GPU check
    common = [f"model.path={qwen7b}", "model.dtype=bfloat16", f"trainer.run_dir={tmp_path}",
              "data.max_prompt_length=1024", "rollout.response_length=4096",
              "topology.learner.device=cuda", "topology.learner.nproc_per_node=8"]
    with caplog.at_level(logging.WARNING):  # 64 rows of 5k tokens a pass, not checkpointed
        assert launch_dry_run(*common) == 0  # a warning, not a refusal
    [warning] = [r.getMessage() for r in caplog.records if "may not fit" in r.getMessage()]
    assert warning.startswith("learner (each of 8 ranks) may not fit its 80.0 GiB GPU")
    assert "model.enable_gradient_checkpointing" in warning  # what lowers it
    assert f"tools/plan-memory.py {qwen7b} --run {DEFAULT_RUN} --ranks 8" in warning
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # 16k tokens a pass, checkpointed: ~32 GiB
        assert launch_dry_run(*common, *FITTING) == 0
    assert not [r for r in caplog.records if "may not fit" in r.getMessage()]


def test_a_run_on_the_cpu_is_never_warned_about(qwen7b: Path) -> None:
    run = load_run_config(DEFAULT_RUN, [f"model.path={qwen7b}"])
    on_cpu = Topology(learner=LearnerPlacement(nproc_per_node=8, device="cpu"))
    assert warnings(run, on_cpu, [80 * GIB] * 8) == []
    on_gpu = Topology(learner=LearnerPlacement(nproc_per_node=8, device="cuda"))
    assert warnings(run, on_gpu, [80 * GIB] * 8)  # the same run on GPUs
    assert warnings(run, on_gpu, []) == []  # no GPU here: nothing to judge


def test_a_generator_whose_gpu_cannot_hold_one_sequence_is_warned_naming_the_key(
        qwen7b: Path) -> None:
    run = load_run_config(DEFAULT_RUN, [f"model.path={qwen7b}", "model.dtype=bfloat16"])

    def on_gpu_1(share: float) -> Topology:
        return Topology(learner=LearnerPlacement(device="cpu"), generators=[GeneratorPlacement(
            name="small", device="cuda:1", lean=LeanOptions(gpu_memory_utilization=share))])

    [warning] = warnings(run, on_gpu_1(0.3), [80 * GIB, 40 * GIB])  # 12 GiB: < the weights
    assert warning.startswith("generator small (lean) may not fit its 40.0 GiB GPU")
    assert "gpu_memory_utilization" in warning
    assert warnings(run, on_gpu_1(0.3), [40 * GIB, 80 * GIB]) == []  # GPU 1 is the large one
    assert warnings(run, on_gpu_1(0.5), [80 * GIB, 40 * GIB]) == []  # its lean section


def test_a_lean_generator_whose_share_leaves_no_room_for_its_next_version_is_warned(
        qwen7b: Path) -> None:
    run = load_run_config(DEFAULT_RUN, [f"model.path={qwen7b}", "model.dtype=bfloat16",
                                        "data.max_prompt_length=1024",
                                        "rollout.response_length=4096"])
    topology = Topology(learner=LearnerPlacement(device="cpu"), generators=[GeneratorPlacement(
        name="greedy", device="cuda", lean=LeanOptions(gpu_memory_utilization=0.9))])
    [warning] = warnings(run, topology, [80 * GIB])  # 90% paged + a second 14.2 GiB
    assert warning.startswith("generator greedy (lean) may not fit its 80.0 GiB GPU")


def test_each_process_is_judged_on_the_smallest_of_its_own_gpus() -> None:
    size = local_gpu_bytes([80 * GIB, 40 * GIB, 80 * GIB])
    assert size("127.0.0.1", "cuda", [0, 2]) == 80 * GIB  # its gpus list
    assert size("127.0.0.1", "cuda:1", None) == 40 * GIB  # the GPU its device names
    assert size("127.0.0.1", "auto", None) == 40 * GIB  # any of this machine's
    assert size("127.0.0.1", "cpu", None) is None
    assert size("node7", "cuda", [0]) is None  # another host's GPUs are not known here
