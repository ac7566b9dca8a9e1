"""launcher.resolve: held-out data the evaluator could not use is refused before launch; an
epoch is counted after data.filter_overlong_prompts."""

import importlib.util
import json
from pathlib import Path

import pytest

from configs import DEFAULT_RUN, DEFAULT_TOPOLOGY, ConfigError
from configs.checks import load_run_config
from configs.topology_schema import GeneratorPlacement, Topology
from launcher.resolve import check_local_engines, dry_run_report, resolve_launch


def test_a_held_out_data_source_without_a_reward_is_refused_before_launch(
        tmp_path: Path) -> None:
    val = tmp_path / "val.jsonl"
    val.write_text('{"prompt": [{"role": "user", "content": "1 + 1?"}], '
                   '"data_source": "nobody/knows", '
                   '"reward_model": {"style": "rule", "ground_truth": "2"}}\n')
    with pytest.raises(ConfigError) as error:
        resolve_launch(str(DEFAULT_TOPOLOGY), str(DEFAULT_RUN),
                       run_overrides=[f"data.val_files={val}", f"trainer.run_dir={tmp_path}"])
    assert error.value.key == "data.val_files" and "nobody/knows" in str(error.value)


def test_without_evaluation_the_held_out_rows_are_not_read(tmp_path: Path) -> None:
    val = tmp_path / "val.jsonl"
    val.write_text("not json\n")
    resolved = resolve_launch(str(DEFAULT_TOPOLOGY), str(DEFAULT_RUN), run_overrides=[
        f"data.val_files={val}", "trainer.test_freq=-1", "trainer.val_before_train=false",
        f"trainer.run_dir={tmp_path}"])
    assert [p.role for p in resolved.processes] == ["buffer", "learner", "generator"]


def test_a_sequence_parallel_size_that_does_not_divide_the_ranks_is_refused(
        tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as error:
        resolve_launch(str(DEFAULT_TOPOLOGY), str(DEFAULT_RUN),
                       topology_overrides=["learner.nproc_per_node=3"],
                       run_overrides=["actor.ulysses_sequence_parallel_size=2",
                                      f"trainer.run_dir={tmp_path}"])
    assert error.value.key == "actor.ulysses_sequence_parallel_size"
    assert "does not divide the learner's 3 ranks" in str(error.value)


@pytest.mark.parametrize("key", ["actor.fsdp_config.fsdp_size", "ref.fsdp_config.fsdp_size"])
def test_an_fsdp_size_that_does_not_divide_the_ranks_is_refused_at_launch(
        tmp_path: Path, key: str) -> None:
    with pytest.raises(ConfigError) as error:
        resolve_launch(str(DEFAULT_TOPOLOGY), str(DEFAULT_RUN),
                       topology_overrides=["learner.nproc_per_node=4"],
                       run_overrides=[f"{key}=3", f"trainer.run_dir={tmp_path}"])
    assert error.value.key == key
    assert "3 must be -1 (shard over every rank) or divide the learner's 4 ranks" \
        in str(error.value)
    resolve_launch(str(DEFAULT_TOPOLOGY), str(DEFAULT_RUN),  # 2 x 2 is HSDP
                   topology_overrides=["learner.nproc_per_node=4"],
                   run_overrides=[f"{key}=2", f"trainer.run_dir={tmp_path}"])


def test_a_sequence_parallel_size_the_heads_do_not_fit_is_refused(
        tmp_path: Path, random_model_dir: Path) -> None:  # 4 attention heads
    with pytest.raises(ConfigError) as error:
        resolve_launch(str(DEFAULT_TOPOLOGY), str(DEFAULT_RUN),
                       topology_overrides=["learner.nproc_per_node=3"],
                       run_overrides=["actor.ulysses_sequence_parallel_size=3",
                                      f"model.path={random_model_dir}",
                                      f"trainer.run_dir={tmp_path}"])
    assert error.value.key == "actor.ulysses_sequence_parallel_size"
    assert "must divide the model's 4 attention heads" in str(error.value)
    assert str(random_model_dir) in str(error.value)


def test_an_epoch_counts_the_rows_filter_overlong_prompts_keeps(tmp_path: Path) -> None:
    train = tmp_path / "train.jsonl"
    rows = [json.dumps({"prompt": [{"role": "user", "content": "1 + 1 = ?" * repeat}],
                        "data_source": "relay/arithmetic",
                        "reward_model": {"style": "rule", "ground_truth": "2"}})
            for repeat in (1, 1, 1, 1, 40, 40)]  # 40 repeats: far over 64 tokens
    train.write_text("\n".join(rows) + "\n")
    overrides = [f"data.train_files={train}", "data.train_batch_size=2",
                 "data.max_prompt_length=64", "trainer.total_epochs=5",
                 f"trainer.run_dir={tmp_path}"]
    kept = resolve_launch(str(DEFAULT_TOPOLOGY), str(DEFAULT_RUN), run_overrides=[
        *overrides, "data.filter_overlong_prompts=true"])  # the built-in model's tokenizer
    assert kept.run.trainer.total_training_steps == 5 * (4 // 2)  # verl's count
    every = resolve_launch(str(DEFAULT_TOPOLOGY), str(DEFAULT_RUN), run_overrides=overrides)
    assert every.run.trainer.total_training_steps == 5 * (6 // 2)


def test_a_local_engine_whose_package_is_missing_is_refused_before_launch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    with pytest.raises(ConfigError) as error:
        resolve_launch(str(DEFAULT_TOPOLOGY), str(DEFAULT_RUN),
                       topology_overrides=["generators[0].engine=vllm"],
                       run_overrides=[f"trainer.run_dir={tmp_path}"])
    assert error.value.key == "generators[0].engine" and error.value.source == str(
        DEFAULT_TOPOLOGY)
    assert "needs the vllm package, which is not installed here" in str(error.value)
    remote = Topology(generators=[GeneratorPlacement(name="far", host="10.0.0.7",
                                                     engine="vllm")])
    check_local_engines(remote, load_run_config(str(DEFAULT_RUN)), "t.toml")  # not checked here


def test_sglang_on_this_machine_is_refused_at_launch(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as error:  # SGLang cannot be installed on a CPU machine
        resolve_launch(str(DEFAULT_TOPOLOGY), str(DEFAULT_RUN),
                       topology_overrides=["evaluator.engine=sglang"],
                       run_overrides=[f"trainer.run_dir={tmp_path}"])
    assert error.value.key == "evaluator.engine"
    assert "CUDA GPUs only" in str(error.value) and "\"vllm\"" in str(error.value)


def test_an_engine_verls_rollout_name_chose_is_refused_naming_that_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as error:  # a topology edit would not help: the key wins
        resolve_launch(str(DEFAULT_TOPOLOGY), str(DEFAULT_RUN),
                       run_overrides=[f"trainer.run_dir={tmp_path}",
                                      "actor_rollout_ref.rollout.name=sglang"])
    assert error.value.key == "actor_rollout_ref.rollout.name"
    assert error.value.source == "command line" and "=lean" in error.value.problem


GPU_OVERRIDES = ["learner.device=cuda", "learner.nproc_per_node=2", "learner.gpus=[0, 1]",
                 "generators[0].device=cuda"]


def test_a_gpu_two_processes_list_is_refused_at_launch_naming_both(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as error:
        resolve_launch(str(DEFAULT_TOPOLOGY), str(DEFAULT_RUN),
                       topology_overrides=[*GPU_OVERRIDES, "generators[0].gpus=[1]"],
                       run_overrides=[f"trainer.run_dir={tmp_path}"])
    assert (error.value.source, error.value.key) == (str(DEFAULT_TOPOLOGY),
                                                     "generators[0].gpus")
    assert "GPU 1 of this machine is listed by both learner (learner.gpus = [0, 1]) and " \
           "generator gen0 (generators[0].gpus = [1])" in error.value.problem


def test_the_dry_run_shows_each_local_processs_gpus(tmp_path: Path) -> None:
    resolved = resolve_launch(str(DEFAULT_TOPOLOGY), str(DEFAULT_RUN),
                              topology_overrides=[*GPU_OVERRIDES, "generators[0].gpus=[2]",
                                                  "evaluator.device=cuda", "evaluator.gpus=[3]"],
                              run_overrides=[f"trainer.run_dir={tmp_path}"])
    lines = dry_run_report(resolved).splitlines()
    learner = next(line for line in lines if line.lstrip().startswith("learner "))
    generator = next(line for line in lines if line.lstrip().startswith("gen0 "))
    assert " CUDA_VISIBLE_DEVICES=0,1 " in learner and "torch.distributed.run" in learner
    assert " CUDA_VISIBLE_DEVICES=2 " in generator and "generators.main" in generator
    assert resolved.topology.learner.gpus == [0, 1]
