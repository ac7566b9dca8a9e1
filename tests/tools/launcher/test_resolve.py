"""relay.launcher.resolve: held-out data the evaluator could not use is refused before launch; an
epoch is counted after data.filter_overlong_prompts; a resume that changes the buffer
state's fingerprint is refused naming the keys, unless trainer.resume_allow_changes lists
them; resume_mode=auto skips a damaged newest checkpoint, saying so, and a run that would
save over another run's checkpoint is refused."""

import importlib.util
import json
import logging
import pickle
from pathlib import Path

import msgspec
import pytest
from torch.distributed.checkpoint.metadata import Metadata

from relay.configs import DEFAULT_RUN, DEFAULT_TOPOLOGY, ConfigError
from relay.configs.checks import load_run_config
from relay.buffer.fingerprint import buffer_fingerprint
from relay.buffer.prompt_source import PromptSource, write_buffer_checkpoint
from relay.configs.prompt_data import PromptDataset
from relay.configs.run_schema import RunConfig
from relay.configs.topology_schema import GeneratorPlacement, Topology
from relay.learner.checkpoint_files import listed_files, manifest
from relay.learner.checkpoint_meta import FORMAT, META_FILE, CheckpointMeta, Lineage, LoopState
from relay.learner.tiny_model.build import default_model_dir
from relay.launcher import resources
from relay.launcher.resolve import (
    check_engine_sampling,
    check_rollout_workflow,
    check_fingerprint,
    check_local_engines,
    dry_run_report,
    launch_prompts,
    load_checked,
    resolve_launch,
    resolve_resume_mode,
)
from relay.transport.messages import BufferCheckpoint


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
    assert error.value.key == "generators[0].engine" and error.value.source == "command line"
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
    assert (error.value.source, error.value.key) == ("command line", "generators[0].gpus")
    assert "GPU 1 of this machine is listed by both learner (learner.gpus = [0, 1]) and " \
           "generator gen0 (generators[0].gpus = [1])" in error.value.problem


def test_the_dry_run_shows_each_local_processs_gpus(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resources, "cuda_device_count", lambda: 4)  # GPUs 0-3 exist
    resolved = resolve_launch(str(DEFAULT_TOPOLOGY), str(DEFAULT_RUN),
                              topology_overrides=[*GPU_OVERRIDES, "generators[0].gpus=[2]",
                                                  "evaluator.device=cuda", "evaluator.gpus=[3]"],
                              run_overrides=[f"trainer.run_dir={tmp_path}"])
    lines = dry_run_report(resolved).splitlines()
    learner = next(line for line in lines if line.lstrip().startswith("learner "))
    generator = next(line for line in lines if line.lstrip().startswith("gen0 "))
    assert " CUDA_VISIBLE_DEVICES=0,1 " in learner and "torch.distributed.run" in learner
    assert " CUDA_VISIBLE_DEVICES=2 " in generator and "relay.generators.main" in generator
    assert resolved.topology.learner.gpus == [0, 1]


def test_a_local_launch_this_machine_cannot_hold_is_refused_naming_process_and_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resources, "cuda_device_count", lambda: 3)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # the lists are checked
    run = [f"trainer.run_dir={tmp_path}"]
    with pytest.raises(ConfigError) as error:  # GPUs 0-2 exist; the evaluator lists 3
        resolve_launch(str(DEFAULT_TOPOLOGY), str(DEFAULT_RUN), run_overrides=run,
                       topology_overrides=[*GPU_OVERRIDES, "generators[0].gpus=[2]",
                                           "evaluator.device=cuda", "evaluator.gpus=[3]"])
    assert (error.value.source, error.value.key) == ("command line", "evaluator.gpus")
    assert error.value.problem.startswith("evaluator runs on GPU 3 of this machine, which has "
                                          "3 GPU(s)")
    monkeypatch.setattr(resources, "meminfo_total_gib", lambda: 8.0)
    with pytest.raises(ConfigError) as error:
        resolve_launch(str(DEFAULT_TOPOLOGY), str(DEFAULT_RUN), run_overrides=run,
                       topology_overrides=["buffer.memory_gib=2", "generators[0].memory_gib=7"])
    assert (error.value.source, error.value.key) == ("command line", "generators[0].memory_gib")
    assert "ask for 9 GiB of memory together (buffer 2, generator gen0 7)" in error.value.problem


def test_a_ray_launch_that_lists_learner_hosts_is_refused_with_the_node_count_to_set(
        tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as error:
        resolve_launch(str(DEFAULT_TOPOLOGY), str(DEFAULT_RUN),
                       topology_overrides=["launcher.backend=ray",
                                           'learner.hosts=["127.0.0.1", "localhost"]'],
                       run_overrides=[f"trainer.run_dir={tmp_path}"])
    assert (error.value.source, error.value.key) == ("command line", "learner.hosts")
    assert "set learner.nnodes = 2" in error.value.problem
    placed = ["launcher.backend=ray", 'learner.hosts=["127.0.0.1", "localhost"]']
    topology, _, _ = load_checked(str(DEFAULT_TOPOLOGY), str(DEFAULT_RUN), placed,
                                  [f"trainer.run_dir={tmp_path}"], placed=True)
    assert len(topology.learner.hosts) == 2  # a run directory's, as its backend placed it


def fingerprinted_checkpoint(folder: Path, run: RunConfig, step: int) -> Path:
    """A checkpoint folder holding the buffer state ``run`` writes after ``step``: the
    buffer's config names the built-in model by the folder the launcher built it in."""
    folder.mkdir(parents=True)
    state = PromptSource(launch_prompts(run), seed=run.data.seed).state()
    served = msgspec.structs.replace(run, model=msgspec.structs.replace(
        run.model, path=str(default_model_dir())))
    write_buffer_checkpoint(folder, BufferCheckpoint(
        step=step, source=state, accepted=step * run.data.train_batch_size,
        fingerprint=buffer_fingerprint(served, launch_prompts(run))))
    return folder


def test_a_resume_that_changes_the_buffers_fingerprint_is_refused_naming_the_keys(
        tmp_path: Path) -> None:
    """The issue's two cases: data.train_batch_size 32 -> 16 after 100 steps, and other
    training rows. Each is refused naming the key and the override that allows it; the
    override allows that key only."""
    other_rows = tmp_path / "other.jsonl"
    other_rows.write_text("".join(DEFAULT_RUN.parent.joinpath(
        "data/arithmetic-train.jsonl").read_text().splitlines(keepends=True)[:5]))

    def run(*extra: str) -> RunConfig:
        return load_run_config(DEFAULT_RUN, ["data.train_batch_size=32", *extra])

    checkpoint = fingerprinted_checkpoint(tmp_path / "step-100", run(), step=100)
    assert run().model.path == "builtin:tiny-arith"
    check_fingerprint(run(), checkpoint, "run.toml")  # the same config: no change
    check_fingerprint(run("trainer.total_training_steps=500", "actor.optim.lr=1e-5"),
                      checkpoint, "run.toml")  # not in the fingerprint: free to change

    with pytest.raises(ConfigError) as error:
        check_fingerprint(run("data.train_batch_size=16"), checkpoint, "run.toml")
    assert error.value.key == "data.train_batch_size"
    assert "data.train_batch_size: 32 in the checkpoint, 16 now" in error.value.problem
    assert "trainer.resume_allow_changes=data.train_batch_size " in error.value.problem
    check_fingerprint(run("data.train_batch_size=16",
                          "trainer.resume_allow_changes=data.train_batch_size"),
                      checkpoint, "run.toml")

    with pytest.raises(ConfigError) as error:
        check_fingerprint(run(f"data.train_files={other_rows}", "data.train_batch_size=16",
                              "trainer.resume_allow_changes=data.train_batch_size"),
                          checkpoint, "run.toml")
    assert error.value.key == "data.train_files"
    assert ", 5 rows, sha256 " in error.value.problem and " now " in error.value.problem
    with pytest.raises(ConfigError) as error:
        check_fingerprint(run(f"data.train_files={other_rows}", "data.seed=7", "rollout.n=4"),
                          checkpoint, "run.toml")
    assert error.value.key == "data.train_files, data.seed, rollout.n"
    assert ('trainer.resume_allow_changes=\'["data.train_files", "data.seed", "rollout.n"]\''
            in error.value.problem)
    check_fingerprint(run(f"data.train_files={other_rows}", "data.seed=7", "rollout.n=4",
                          'trainer.resume_allow_changes=["data.train_files", "data.seed", '
                          '"rollout.n"]'), checkpoint, "run.toml")
    other_model = tmp_path / "other-model"
    other_model.mkdir()
    (other_model / "config.json").write_text('{"model_type": "qwen2", "vocab_size": 64}')
    with pytest.raises(ConfigError) as error:
        check_fingerprint(run(f"model.path={other_model}"), checkpoint, "run.toml")
    assert error.value.key == "model.path"
    assert f"model.path: {default_model_dir()} in the checkpoint, {other_model} now" in str(
        error.value)


def test_a_checkpoint_without_a_fingerprint_is_not_refused(tmp_path: Path) -> None:
    """Written before fingerprints: nothing to compare (the buffer names what it cannot
    resume, tests/buffer/test_resume.py)."""
    run = load_run_config(DEFAULT_RUN, [])
    folder = tmp_path / "step-3"
    folder.mkdir()
    write_buffer_checkpoint(folder, BufferCheckpoint(
        step=3, source=PromptSource(launch_prompts(run)).state()))
    check_fingerprint(load_run_config(DEFAULT_RUN, ["data.train_batch_size=2"]), folder, "x")


def test_only_fingerprint_keys_may_be_allowed_to_change() -> None:
    with pytest.raises(ConfigError) as error:
        load_run_config(DEFAULT_RUN, ["trainer.resume_allow_changes=actor.optim.lr"])
    assert error.value.key == "trainer.resume_allow_changes"


def lineage_checkpoint(folder: Path, step: int, lineage: str) -> Path:
    """A checkpoint of ``lineage`` as far as the launcher reads one: ``meta.json`` with its
    manifest, the buffer's state and the DCP metadata (of no tensors here)."""
    folder.mkdir(parents=True)
    write_buffer_checkpoint(folder, BufferCheckpoint(
        step=step, source=PromptSource(PromptDataset([]), shuffle=False).state()))
    (folder / "dcp").mkdir()
    (folder / "dcp" / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={})))
    meta = CheckpointMeta(format=FORMAT, loop=LoopState(step=step, version=step),
                          steps_done=step, world_size=1, parts=["policy"],
                          schedulers={"policy": {}}, lineage=Lineage(id=lineage),
                          saved_at=1e9 + step, files=manifest(folder, listed_files(folder)))
    (folder / META_FILE).write_bytes(msgspec.json.encode(meta))
    return folder


def test_auto_resume_skips_a_damaged_newest_checkpoint_and_no_run_saves_over_anothers(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "checkpoints"
    for step in (2, 4):
        lineage_checkpoint(folder / f"step-{step}", step, "a")

    def trainer(*extra: str) -> tuple[str, str]:
        run = load_run_config(DEFAULT_RUN, [f"checkpoint.dir={folder}", "trainer.save_freq=2",
                                            "trainer.total_training_steps=6", *extra])
        decided = resolve_resume_mode(run, tmp_path, "run.toml").trainer
        return decided.resume_mode, decided.resume_from_path

    assert trainer() == ("resume_path", str(folder / "step-4"))
    # a branch from step-2 would save at step 4, a fresh run at steps 2 and 4: both refused
    for extra, clashes in [(["trainer.resume_mode=resume_path",
                             f"trainer.resume_from_path={folder / 'step-2'}"],
                            "steps 3 to 6): step-4 (lineage a)."),
                           (["trainer.resume_mode=disable"],
                            "steps 1 to 6): step-2 (lineage a); step-4 (lineage a).")]:
        with pytest.raises(ConfigError) as error:
            trainer(*extra)
        assert error.value.key == "checkpoint.dir"
        assert f"{folder} holds checkpoints of other runs where this run would save one " \
               f"(trainer.save_freq=2, {clashes} Relay never removes" in error.value.problem

    record = folder / "step-4" / "buffer.rec"
    damaged = bytearray(record.read_bytes())
    damaged[len(damaged) // 2] ^= 0x01
    record.write_bytes(bytes(damaged))
    with caplog.at_level(logging.WARNING, logger="relay.learner.checkpoint"):
        # its lineage goes on from step-2, and its save at step 4 replaces the damaged one
        assert trainer() == ("resume_path", str(folder / "step-2"))
    assert (f"skipping {folder / 'step-4'}: {record}: its SHA-256 differs from the one "
            f"{folder / 'step-4'}'s meta.json recorded") in caplog.text
    assert (f"resuming from {folder / 'step-2'}, the newest valid checkpoint: the newer "
            "step-4 cannot be resumed") in caplog.text


def test_a_verl_checkpoint_to_resume_from_is_pointed_to_the_import(tmp_path: Path) -> None:
    verl = tmp_path / "global_step_40"
    (verl / "actor").mkdir(parents=True)
    (verl / "actor" / "model_world_size_2_rank_0.pt").touch()
    run = load_run_config(DEFAULT_RUN, ["trainer.resume_mode=resume_path",
                                        f"trainer.resume_from_path={verl}"])
    with pytest.raises(ConfigError) as error:
        resolve_resume_mode(run, tmp_path, "run.toml")
    assert error.value.key == "trainer.resume_from_path"
    assert f"{verl} is a verl checkpoint" in error.value.problem
    assert f"relay import-verl --optimizer {verl} OUT" in error.value.problem
    assert "actor.optim.state_path=OUT/optimizer" in error.value.problem


@pytest.mark.parametrize("overrides, key", [
    (["rollout.top_p=0.9"], "rollout.top_p"),
    (["rollout.top_k=50"], "rollout.top_k"),
    (["rollout.val_kwargs.top_p=0.9", "rollout.val_kwargs.temperature=0.6"],
     "rollout.val_kwargs.top_p"),
])
def test_vllm_asked_for_top_p_or_top_k_is_refused_at_launch_naming_the_key(
        overrides: list[str], key: str) -> None:
    """Issue 30, item 20: vLLM cannot report the temperature-only behavior log-prob under
    top-p / top-k, so the launch stops before anything starts; Relay's engines take them."""
    run = load_run_config(str(DEFAULT_RUN), overrides)
    vllm_everywhere = Topology(generators=[GeneratorPlacement(name="g", engine="vllm")])
    vllm_everywhere.evaluator.engine = "vllm"
    with pytest.raises(ConfigError) as error:
        check_engine_sampling(vllm_everywhere, run, "run.toml")
    assert error.value.key == key and error.value.source == "run.toml"
    section = key.rsplit(".", 1)[0]
    assert f"Set {section}.top_p = 1.0 and {section}.top_k = -1" in str(error.value)
    check_engine_sampling(Topology(), run, "run.toml")  # the lean engine records it


def test_vllm_with_filters_for_greedy_evaluation_only_is_not_refused() -> None:
    run = load_run_config(str(DEFAULT_RUN), ["rollout.val_kwargs.top_p=0.9"])  # temperature 0
    topology = Topology(generators=[GeneratorPlacement(name="g", engine="vllm")])
    topology.evaluator.engine = "vllm"
    check_engine_sampling(topology, run, "run.toml")


def test_a_tool_config_or_workflow_that_cannot_load_is_refused_before_launch(
        tmp_path: Path) -> None:
    bad_yaml = tmp_path / "tools.yaml"
    bad_yaml.write_text("tools:\n  - class_name: no_such_module.Tool\n")
    run = load_run_config(str(DEFAULT_RUN), ["rollout.multi_turn.enable=true",
                                             f"rollout.multi_turn.tool_config_path={bad_yaml}"])
    with pytest.raises(ConfigError) as error:
        check_rollout_workflow(run, "run.toml")
    assert error.value.key == "rollout.multi_turn.tool_config_path"
    assert "tools[0]" in str(error.value) and "no_such_module" in str(error.value)
    agent = tmp_path / "agent.py"
    agent.write_text("def run_episode(engine, row):\n    return None\n")
    run = load_run_config(str(DEFAULT_RUN), [f"rollout.workflow={agent}:run_episode"])
    with pytest.raises(ConfigError, match="not an async function") as error:
        check_rollout_workflow(run, "run.toml")
    assert error.value.key == "rollout.workflow"
    check_rollout_workflow(load_run_config(str(DEFAULT_RUN)), "run.toml")  # single-turn


def test_verls_tool_class_is_noted_at_launch(caplog: pytest.LogCaptureFixture) -> None:
    from relay.configs import CONFIG_DIR

    run = load_run_config(str(DEFAULT_RUN), [
        "rollout.multi_turn.enable=true",
        f"rollout.multi_turn.tool_config_path={CONFIG_DIR / 'tools' / 'gsm8k.yaml'}"])
    with caplog.at_level("WARNING"):
        check_rollout_workflow(run, "run.toml")
    assert "verl's verl.tools.gsm8k_tool.Gsm8kTool runs as Relay's " \
           "relay.generators.tools.gsm8k.Gsm8kTool" in caplog.text
