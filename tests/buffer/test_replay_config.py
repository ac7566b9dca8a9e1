"""The replay config: the store a run config builds (filters, prioritized replay), and the
bad combinations."""

from __future__ import annotations

import msgspec
import pytest

from relay.buffer.dynamic_sampling import DynamicSampling
from relay.buffer.main import build_store
from relay.buffer.pf_ppo import PolicyFiltration
from relay.buffer.prioritized import PrioritizedStore
from relay.buffer.store import FifoStore, FilteredStore
from relay.configs.checks import check_replay_filters
from relay.configs.loader import ConfigError
from relay.configs.run_schema import (
    BufferConfig,
    DataConfig,
    FilterGroupsConfig,
    ModelConfig,
    PfPpoConfig,
    ReplayConfig,
    RolloutConfig,
    RunConfig,
)


def run_config(n: int = 4, estimator: str = "grpo", **buffer: object) -> RunConfig:
    run = RunConfig(data=DataConfig(train_files=["t.parquet"], train_batch_size=8),
                    model=ModelConfig(path="m"), rollout=RolloutConfig(n=n),
                    buffer=BufferConfig(**buffer))
    return msgspec.structs.replace(
        run, algorithm=msgspec.structs.replace(run.algorithm, adv_estimator=estimator))


def test_filters_are_off_by_default() -> None:
    run = run_config()
    assert isinstance(build_store(run), FifoStore)
    check_replay_filters(run, "run.toml")


def test_config_builds_dynamic_sampling_then_pf_ppo() -> None:
    run = run_config(filter_groups=FilterGroupsConfig(enable=True, metric="acc",
                                                      max_num_gen_batches=3),
                     pf_ppo=PfPpoConfig(enable=True, mode="best_random", seed=5))
    store = build_store(run)
    assert isinstance(store, FilteredStore)
    dynamic, pf = store.filters
    assert isinstance(dynamic, DynamicSampling) and isinstance(pf, PolicyFiltration)
    assert (dynamic.metric, dynamic.batch_size, dynamic.max_num_gen_batches) == ("acc", 8, 3)
    assert (pf.mode, pf.seed) == ("best_random", 5)


def test_config_builds_the_prioritized_store_behind_the_filters() -> None:
    run = run_config(max_staleness=3, pf_ppo=PfPpoConfig(enable=True),
                     replay=ReplayConfig(priority="pass_rate", alpha=0.5, beta=0.7,
                                         max_reuse=2, seed=3))
    store = build_store(run)
    assert isinstance(store, FilteredStore) and isinstance(store.inner, PrioritizedStore)
    inner = store.inner
    assert (inner.priority, inner.alpha, inner.beta, inner.max_reuse, inner.max_age) == (
        "pass_rate", 0.5, 0.7, 2, 3)  # max_age -1: the staleness bound
    alone = build_store(run_config(replay=ReplayConfig(priority="uniform", max_age=0)))
    assert isinstance(alone, PrioritizedStore) and alone.max_age == 0


def test_toml_keys_follow_verl() -> None:
    toml = b"""
[filter_groups]
enable = true
metric = "acc"
max_num_gen_batches = 10
[pf_ppo]
enable = true
mode = "best"
"""
    config = msgspec.toml.decode(toml, type=BufferConfig)
    assert config.filter_groups == FilterGroupsConfig(enable=True, metric="acc",
                                                      max_num_gen_batches=10)
    assert config.pf_ppo.mode == "best" and config.max_staleness == 1
    with pytest.raises(msgspec.ValidationError, match="pf_ppo.mode"):
        msgspec.toml.decode(b'[pf_ppo]\nmode = "top"', type=BufferConfig)


@pytest.mark.parametrize(("run", "key", "words"), [
    (run_config(n=1, filter_groups=FilterGroupsConfig(enable=True)),
     "buffer.filter_groups.enable", "rollout.n = 1"),
    (run_config(n=2, pf_ppo=PfPpoConfig(enable=True, mode="best_worst")),
     "buffer.pf_ppo.mode", "nothing would be filtered"),
    (run_config(n=1, estimator="reinforce_plus_plus", pf_ppo=PfPpoConfig(enable=True,
                                                                          mode="best")),
     "buffer.pf_ppo.mode", "keeps 1 of each prompt's samples and rollout.n = 1"),
    (run_config(n=4, estimator="rloo", pf_ppo=PfPpoConfig(enable=True, mode="best")),
     "buffer.pf_ppo.mode", "every advantage would be 0"),
    (run_config(replay=ReplayConfig(max_reuse=2)), "buffer.replay.max_reuse", "is 'fifo'"),
    (run_config(replay=ReplayConfig(priority="uniform", max_age=2)), "buffer.replay.max_age",
     "above buffer.max_staleness (1)"),
    (run_config(replay=ReplayConfig(priority="td_error")), "buffer.replay.priority",
     "needs the critic's values"),
])
def test_bad_combinations_name_the_key(run: RunConfig, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        check_replay_filters(run, "run.toml")
    assert caught.value.key == key and words in str(caught.value)


def test_best_of_n_is_fine_without_a_group_baseline() -> None:
    check_replay_filters(run_config(n=4, estimator="reinforce_plus_plus",
                                    pf_ppo=PfPpoConfig(enable=True, mode="best")), "run.toml")
