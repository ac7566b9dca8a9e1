"""Where a generator's learned rewards come from: the reward servers' clients when the
topology has ``[[reward_models]]``, else models built beside its engine; a vLLM judge never
joins a vLLM engine in one process."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.configs.run_schema import (DataConfig, JudgeConfig, ModelConfig, PrmModelConfig,
                                      RewardModelConfig, RunConfig)
from relay.configs.rundir import RunContext
from relay.configs.topology_schema import GeneratorPlacement, RewardModelPlacement, Topology
from relay.generators.learned_rewards import (configured_judge, generator_scorers,
                                              remote_scorers, vllm_clash)
from relay.generators.reward_client import RemoteJudge, RemoteRewardModel

RM = RewardModelConfig(enable=True, model=PrmModelConfig(path="/nowhere/rm"), combine="add")
JUDGE = RewardModelConfig(judge=JudgeConfig(enable=True, model="/nowhere/judge",
                                            engine="vllm"))
SERVERS = Topology(reward_models=[RewardModelPlacement(name="rm0", timeout_s=7),
                                  RewardModelPlacement(name="rm1")])


def context(tmp_path: Path, topology: Topology, reward_model: RewardModelConfig) -> RunContext:
    run = RunConfig(data=DataConfig(train_files="t.jsonl"), model=ModelConfig(path="m"),
                    reward_model=reward_model)
    return RunContext(run_dir=tmp_path, topology=topology, run=run)


def test_with_reward_servers_a_generator_loads_no_model_and_calls_them(tmp_path: Path) -> None:
    learned = generator_scorers(context(tmp_path, SERVERS, RM), GeneratorPlacement(name="g"), 0)
    try:
        assert isinstance(learned.reward_model, RemoteRewardModel) and learned.judge is None
        assert learned.reward_model.config.combine == "add"
        assert learned.clients is not None
        assert learned.clients.endpoints == [f"ipc://{tmp_path}/sockets/rm-rm0",
                                             f"ipc://{tmp_path}/sockets/rm-rm1"]
        assert learned.clients.timeouts_s == [7, 120]
    finally:
        learned.close()
    judged = remote_scorers(context(tmp_path, SERVERS, JUDGE))
    assert isinstance(judged.judge, RemoteJudge) and judged.reward_model is None
    judged.close()


def test_without_reward_servers_and_without_learned_rewards_nothing_is_built(
        tmp_path: Path) -> None:
    learned = generator_scorers(context(tmp_path, Topology(), RewardModelConfig()),
                                GeneratorPlacement(name="g"), 0)
    assert (learned.reward_model, learned.judge, learned.clients) == (None, None, None)


def test_a_vllm_judge_is_refused_inside_a_vllm_generator(tmp_path: Path) -> None:
    run = context(tmp_path, Topology(), JUDGE).run
    with pytest.raises(ValueError, match=r"\[\[reward_models\]\]"):
        configured_judge(run, GeneratorPlacement(name="g", engine="vllm"), 0, beside="vllm")
    assert vllm_clash("vllm", "lean", "g") == "" and vllm_clash("lean", "vllm", "g") == ""
