"""``relay.configs.checks``: what the schema alone cannot check, named before a launch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from relay.configs.checks import (
    check_backend_hosts,
    check_cluster_request,
    check_topology,
    dump_dir_problem,
    load_run_config,
)
from relay.configs.loader import ConfigError
from relay.configs.topology_schema import (
    GeneratorPlacement,
    LauncherSettings,
    LearnerPlacement,
    Topology,
)

from .test_loader import GOOD_RUN, error_of, write


def test_a_dump_folder_that_cannot_be_written_is_named(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    assert dump_dir_problem(tmp_path / "new" / "dump") == ""
    assert dump_dir_problem(tmp_path / "a-file") == (
        f"{tmp_path / 'a-file'} exists and is not a folder")
    assert dump_dir_problem(tmp_path / "a-file" / "dump") == (
        f"{tmp_path / 'a-file'} is not a folder, so {tmp_path / 'a-file' / 'dump'} cannot be "
        "created")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_a_dump_folder_without_write_permission_is_named(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    assert dump_dir_problem(locked / "dump") == (
        f"{locked / 'dump'} cannot be created: {locked} is not writable by this user")


SSH = LauncherSettings(backend="ssh")
RAY = LauncherSettings(backend="ray")


def refusal(check, topology: Topology) -> ConfigError:
    with pytest.raises(ConfigError) as refused:
        check(topology, "t.toml")
    assert refused.value.source == "t.toml"
    return refused.value


def test_the_local_backend_refuses_a_host_that_is_not_this_machine() -> None:
    remote = [GeneratorPlacement(name="g", host="gen-host.example")]
    err = refusal(check_topology, Topology(generators=remote))
    assert err.key == "generators[0].host"
    assert err.problem == ("'gen-host.example' is not this machine, and launcher.backend = "
                           "'local' starts every process here: set launcher.backend = 'ssh' "
                           "to start it there over ssh (or 'ray' or 'slurm' under a cluster "
                           "manager)")
    err = refusal(check_topology, Topology(generators=remote, launcher=SSH))
    assert err.key == "generators[0].host" and "CURVE" in err.problem  # ssh: the next check
    err = refusal(check_topology, Topology(learner=LearnerPlacement(hosts=["127.0.0.1", "n2"])))
    assert err.key == "learner.hosts[1]" and "launcher.backend = 'ssh'" in err.problem


def test_learner_nnodes_is_the_learner_hosts_count_under_local_and_ssh() -> None:
    two = LearnerPlacement(hosts=["127.0.0.1", "localhost"], nnodes=2)
    check_backend_hosts(Topology(learner=two), "t.toml")
    err = refusal(check_backend_hosts, Topology(learner=LearnerPlacement(nnodes=2), launcher=SSH))
    assert err.key == "learner.nnodes" and err.problem == (
        "2 nodes, but launcher.backend = 'ssh' runs the learner on the 1 host(s) of "
        "learner.hosts: list the hosts there and leave learner.nnodes at 0 (Ray and Slurm "
        "pick nodes by it)")
    check_backend_hosts(Topology(learner=LearnerPlacement(nnodes=2), launcher=RAY), "t.toml")


def test_ray_custom_resources_are_refused_by_every_other_backend() -> None:
    pinned = [GeneratorPlacement(name="g", resources={"node_a": 1})]
    check_backend_hosts(Topology(generators=pinned, launcher=RAY), "t.toml")
    for backend in ("local", "ssh", "slurm"):
        err = refusal(check_backend_hosts,
                      Topology(generators=pinned, launcher=LauncherSettings(backend=backend)))
        assert err.key == "generators[0].resources" and f"not {backend!r}" in err.problem


@pytest.mark.parametrize("backend", ["ray", "slurm"])
def test_a_cluster_backend_picks_nodes_and_gpus_itself(backend: str) -> None:
    launcher = LauncherSettings(backend=backend)
    check_cluster_request(Topology(learner=LearnerPlacement(device="cuda", nnodes=2),
                                   launcher=launcher), "t.toml")
    err = refusal(check_cluster_request, Topology(
        generators=[GeneratorPlacement(name="g", device="cuda", gpus=[1])], launcher=launcher))
    assert err.key == "generators[0].gpus" and err.problem.startswith(
        f"[1]: launcher.backend = {backend!r} assigns each process its GPUs "
        "(CUDA_VISIBLE_DEVICES); drop the list")
    err = refusal(check_cluster_request, Topology(learner=LearnerPlacement(device="auto"),
                                                  launcher=launcher))
    assert err.key == "learner.device" and "say 'cuda' (one GPU per rank) or 'cpu'" in err.problem
    err = refusal(check_cluster_request, Topology(
        learner=LearnerPlacement(hosts=["n1", "n2"]), launcher=launcher))
    assert err.key == "learner.hosts" and "set learner.nnodes = 2" in err.problem


def test_local_and_ssh_topologies_are_not_cluster_requests() -> None:
    for launcher in (LauncherSettings(), SSH):
        check_cluster_request(Topology(learner=LearnerPlacement(
            hosts=["n1", "n2"], device="auto", gpus=[0]), launcher=launcher), "t.toml")


@pytest.mark.parametrize("overrides, key, problem", [
    (["reward_model.judge.enable=true"], "reward_model.judge.model", "exactly one"),
    (["reward_model.judge.enable=true", "reward_model.judge.url=http://x/v1",
      "reward_model.enable=true"], "reward_model.judge.enable", "not beside"),
    (["reward_model.judge.enable=true", "reward_model.judge.url=http://x/v1",
      "reward_model.judge.prompt_template={answer}"], "reward_model.judge.prompt_template",
     "{ground_truth}"),
    (["reward_model.enable=true"], "reward_model.model.path", "ForSequenceClassification"),
    (["custom_reward_function.reward_manager=batch"], "custom_reward_function.reward_manager",
     "custom_reward_function.path"),
])
def test_learned_rewards_are_checked_naming_the_key(tmp_path: Path, overrides: list[str],
                                                    key: str, problem: str) -> None:
    (tmp_path / "train.jsonl").write_text('{"prompt": [{"role": "user", "content": "1+1"}], '
                                          '"data_source": "arithmetic", "reward_model": '
                                          '{"style": "rule", "ground_truth": "2"}}\n')
    (tmp_path / "val.jsonl").write_text((tmp_path / "train.jsonl").read_text())
    err = error_of(load_run_config, write(tmp_path, GOOD_RUN), overrides)
    assert err.key == key and problem in err.problem


def write_prompts(folder: Path) -> None:
    (folder / "train.jsonl").write_text('{"prompt": [{"role": "user", "content": "1+1"}], '
                                        '"data_source": "arithmetic", "reward_model": '
                                        '{"style": "rule", "ground_truth": "2"}}\n')
    (folder / "val.jsonl").write_text((folder / "train.jsonl").read_text())


@pytest.mark.parametrize("override, key, instead", [
    ("actor.fsdp_config.param_offload=true", "actor.fsdp_config.param_offload",
     "actor.deepspeed.offload_param"),
    ("actor.fsdp_config.optimizer_offload=true", "actor.fsdp_config.optimizer_offload",
     "actor.deepspeed.offload_optimizer"),
    ("actor.ulysses_sequence_parallel_size=2", "actor.ulysses_sequence_parallel_size", "1"),
    ("model.lora_rank=8", "model.lora_rank", "0"),
])
def test_deepspeed_refuses_the_settings_only_fsdp2_takes(tmp_path: Path, override: str,
                                                         key: str, instead: str) -> None:
    write_prompts(tmp_path)
    err = error_of(load_run_config, write(tmp_path, GOOD_RUN),
                   ["actor_rollout_ref.actor.strategy=deepspeed", override])
    assert err.key == key and f"use {instead}" in err.problem


def test_verls_strategy_key_chooses_deepspeed(tmp_path: Path) -> None:
    write_prompts(tmp_path)
    run = load_run_config(write(tmp_path, GOOD_RUN),
                          ["actor_rollout_ref.actor.strategy=deepspeed",
                           "actor.deepspeed.zero_stage=3"])
    assert run.actor.strategy == "deepspeed" and run.actor.deepspeed.zero_stage == 3
