"""``[[reward_models]]`` in the launch: reward servers start before the generators and stop
after them, the resolved run directory gives the generators their addresses, Ray and
Slurm reserve them, and a topology or run config that cannot use them is refused naming
the keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.configs import DEFAULT_RUN, DEFAULT_TOPOLOGY, ConfigError
from relay.configs.checks import check_reward_servers, check_topology, load_run_config
from relay.configs.rundir import load_run_dir
from relay.configs.run_schema import (AlgorithmConfig, DataConfig, JudgeConfig, ModelConfig,
                                      PrmModelConfig, RewardModelConfig, RunConfig)
from relay.configs.topology_schema import (GeneratorPlacement, RewardModelPlacement, Security,
                                           Topology, VLLMOptions)
from relay.launcher.child import module_argv
from relay.launcher.plan import build_plan, write_resolved
from relay.launcher.ports import assign_ports
from relay.launcher.resolve import dry_run_report, resolve_launch
from relay.launcher.resources import demands
from relay.launcher.supervisor import stop_all
from relay.transport.endpoints import split_endpoint

from .test_supervisor import start, stopped_at

DATA = DataConfig(train_files="train.jsonl")
WITH_RM = RunConfig(data=DATA, model=ModelConfig(path="m"),
                    reward_model=RewardModelConfig(enable=True, model=PrmModelConfig(path="rm")))
WITH_VLLM_JUDGE = RunConfig(data=DATA, model=ModelConfig(path="m"), reward_model=RewardModelConfig(
    judge=JudgeConfig(enable=True, model="judge", engine="vllm")))
SERVERS = [RewardModelPlacement(name="rm0"), RewardModelPlacement(name="rm1", threads=2)]
TOPOLOGY = Topology(generators=[GeneratorPlacement(name="g0"), GeneratorPlacement(name="g1")],
                    reward_models=SERVERS)


def test_the_plan_starts_the_reward_servers_before_the_generators() -> None:
    plan = build_plan(TOPOLOGY, WITH_RM, Path("/runs/x"), python="py", environ={})
    assert [(p.name, p.role, p.essential) for p in plan] == [
        ("buffer", "buffer", True), ("learner", "learner", True),
        ("rm0", "reward_model", True), ("rm1", "reward_model", True),
        ("g0", "generator", False), ("g1", "generator", False)]
    assert plan[2].argv == module_argv("py", "relay.generators.reward_server",
                                       "--run-dir", "/runs/x", "--name", "rm0")
    assert build_plan(Topology(), WITH_RM, Path("/r"), python="py")[-1].role == "generator"


def test_a_reward_server_on_gpus_sees_only_its_own_and_vllm_keeps_its_allocator() -> None:
    topology = Topology(reward_models=[RewardModelPlacement(name="rm0", device="cuda",
                                                            gpus=[3])])
    (server,) = [p for p in build_plan(topology, WITH_VLLM_JUDGE, Path("/r"), python="py",
                                       environ={}) if p.role == "reward_model"]
    assert server.env == {"CUDA_VISIBLE_DEVICES": "3"}  # vLLM's own pools: no expandable
    (server,) = [p for p in build_plan(topology, WITH_RM, Path("/r"), python="py",
                                       environ={}) if p.role == "reward_model"]
    assert server.env["CUDA_VISIBLE_DEVICES"] == "3" and "PYTORCH_ALLOC_CONF" in server.env


def test_the_resolved_run_gives_every_generator_the_servers_addresses(tmp_path: Path) -> None:
    written = write_resolved(TOPOLOGY, load_run_config(DEFAULT_RUN), tmp_path / "run")
    ctx = load_run_dir(tmp_path / "run")
    sockets = tmp_path / "run" / "sockets"
    assert ctx.reward_endpoints == [f"ipc://{sockets}/rm-rm0", f"ipc://{sockets}/rm-rm1"]
    assert ctx.reward_endpoint("rm1") == ctx.reward_endpoints[1]  # what rm1 binds
    assert written.reward_models == SERVERS
    with pytest.raises(KeyError):
        ctx.reward_endpoint("gen0")


def test_under_curve_the_servers_listen_on_their_ports(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    topology = Topology(reward_models=[RewardModelPlacement(name="rm0", port=0),
                                       RewardModelPlacement(name="rm1", port=7999)],
                        security=Security(curve=True, keys_dir=str(keys)))
    placed = assign_ports(topology)
    assert placed.reward_models[0].port > 0 and placed.reward_models[1].port == 7999
    write_resolved(placed, load_run_config(DEFAULT_RUN), tmp_path / "run")
    ctx = load_run_dir(tmp_path / "run")
    assert [split_endpoint(e)[1] for e in ctx.reward_endpoints] == [
        f"127.0.0.1:{placed.reward_models[0].port}", "127.0.0.1:7999"]


def test_ray_and_slurm_reserve_each_server_by_its_device_and_the_judges_engine() -> None:
    topology = Topology(reward_models=[
        RewardModelPlacement(name="judge", device="cuda", cpus=4, memory_gib=16,
                             resources={"big": 1},
                             vllm=VLLMOptions(tensor_model_parallel_size=2)),
        RewardModelPlacement(name="cpu")])
    found = {d.name: d for d in demands(topology, WITH_VLLM_JUDGE)}
    judge = found["judge"]
    assert (judge.role, judge.section, judge.gpus, judge.cpus, judge.memory_gib) == (
        "reward_model", "reward_models[0]", 2, 4, 16)
    assert judge.resources == {"big": 1} and judge.devices == [0, 1]
    assert judge.what == "reward server judge"
    assert found["cpu"].gpus == 0
    assert demands(topology, WITH_RM)[2].gpus == 1  # a reward model alone: one GPU


def test_reward_servers_and_the_buffer_stop_after_the_generators(tmp_path: Path) -> None:
    generator = start(tmp_path, "gen0", "generator", delay=0.5)  # sends its last groups
    server = start(tmp_path, "rm0", "reward_model")
    buffer = start(tmp_path, "buffer", "buffer")
    stop_all([server, buffer, generator])
    assert stopped_at(tmp_path, "rm0") > stopped_at(tmp_path, "gen0")


def test_servers_without_a_learned_reward_are_refused_naming_both_keys() -> None:
    bare = RunConfig(data=DATA, model=ModelConfig(path="m"))
    with pytest.raises(ConfigError) as error:
        check_reward_servers(TOPOLOGY, bare, "run.toml")
    assert error.value.key == "reward_model.enable, reward_model.judge.enable"
    assert "2 [[reward_models]]" in error.value.problem
    prime = RunConfig(data=DATA, model=ModelConfig(path="m"),
                      reward_model=RewardModelConfig(enable=True),
                      algorithm=AlgorithmConfig(adv_estimator="prime"))
    with pytest.raises(ConfigError, match="PRIME's implicit PRM"):
        check_reward_servers(TOPOLOGY, prime, "run.toml")
    check_reward_servers(TOPOLOGY, WITH_RM, "run.toml")
    check_reward_servers(Topology(), bare, "run.toml")  # no servers: nothing to serve is fine


def test_a_vllm_judge_beside_a_vllm_generator_is_sent_to_reward_models() -> None:
    vllm_generators = Topology(generators=[GeneratorPlacement(name="g", engine="vllm")])
    with pytest.raises(ConfigError) as error:
        check_reward_servers(vllm_generators, WITH_VLLM_JUDGE, "run.toml")
    assert error.value.key == "reward_model.judge.engine"
    assert "[[reward_models]]" in error.value.problem and "'g'" in error.value.problem
    served = Topology(generators=vllm_generators.generators, reward_models=SERVERS[:1])
    check_reward_servers(served, WITH_VLLM_JUDGE, "run.toml")
    check_reward_servers(Topology(), WITH_VLLM_JUDGE, "run.toml")  # beside the lean engine


@pytest.mark.parametrize("name, words", [
    ("g0", "already the name of generators[0]"), ("buffer", "run's own processes"),
    ("learner-0", "run's own processes"), ("a/b", "letters, digits"), ("", "letters")])
def test_a_reward_server_needs_a_name_of_its_own(name: str, words: str) -> None:
    topology = Topology(generators=TOPOLOGY.generators,
                        reward_models=[RewardModelPlacement(name=name)])
    with pytest.raises(ConfigError) as error:
        check_topology(topology, "t.toml")
    assert error.value.key == "reward_models[0].name" and words in error.value.problem
    twice = Topology(reward_models=[RewardModelPlacement(name="r"),
                                    RewardModelPlacement(name="r")])
    with pytest.raises(ConfigError, match="already the name of reward_models"):
        check_topology(twice, "t.toml")


def test_a_launch_with_reward_servers_is_refused_or_planned(tmp_path: Path,
                                                            rm_folder: Path) -> None:
    servers = ["reward_models=[{name = \"rm0\"}]"]
    with pytest.raises(ConfigError) as error:
        resolve_launch(str(DEFAULT_TOPOLOGY), str(DEFAULT_RUN), topology_overrides=servers,
                       run_overrides=[f"trainer.run_dir={tmp_path}"])
    assert "reward_model.judge.enable" in error.value.key
    resolved = resolve_launch(str(DEFAULT_TOPOLOGY), str(DEFAULT_RUN),
                              topology_overrides=servers,
                              run_overrides=[f"trainer.run_dir={tmp_path}",
                                             "reward_model.enable=true",
                                             f"reward_model.model.path={rm_folder}"])
    lines = dry_run_report(resolved).splitlines()
    at = {line.split()[0]: i for i, line in enumerate(lines) if line.startswith("  ")
          and line.split()[0] in ("rm0", "gen0")}
    assert at["rm0"] < at["gen0"]
    assert "reward_model" in lines[at["rm0"]] and "relay.generators.reward_server" in \
        lines[at["rm0"]]


@pytest.fixture
def rm_folder(tmp_path: Path) -> Path:
    from tests.generators.test_reward_model import save_rm

    return save_rm(tmp_path / "rm")


def test_a_judge_engine_missing_here_is_refused_naming_the_run_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as error:  # SGLang cannot be installed on a CPU machine
        resolve_launch(str(DEFAULT_TOPOLOGY), str(DEFAULT_RUN),
                       topology_overrides=["reward_models=[{name = \"rm0\"}]"],
                       run_overrides=[f"trainer.run_dir={tmp_path}",
                                      "reward_model.judge.enable=true",
                                      "reward_model.judge.model=/models/judge",
                                      "reward_model.judge.engine=sglang"])
    assert error.value.key == "reward_model.judge.engine"
    assert "needs the sglang package" in error.value.problem


def test_a_ray_dry_run_lists_what_each_reward_server_reserves(tmp_path: Path,
                                                              rm_folder: Path) -> None:
    resolved = resolve_launch(
        str(DEFAULT_TOPOLOGY), str(DEFAULT_RUN),
        topology_overrides=["launcher.backend=ray",
                            "reward_models=[{name = \"rm0\", cpus = 2, memory_gib = 3}]"],
        run_overrides=[f"trainer.run_dir={tmp_path}", "reward_model.enable=true",
                       f"reward_model.model.path={rm_folder}"])
    assert "#   rm0: 2 CPU(s), 0 GPU(s), 3 GiB" in dry_run_report(resolved).splitlines()
