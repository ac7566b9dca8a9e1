"""verl's keys in a Relay run config (``relay.configs.verl_keys``): every key of verl's
``ppo_trainer.yaml`` is in one group, each group does what the table says, in a file and on
the command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from relay.configs import CONFIG_DIR, ConfigError, load_run_config, load_topology
from relay.configs.loader import parse_key
from relay.configs.verl_keys import TABLE, Placement, in_schema, lookup, markdown_table

from .test_loader import GOOD_RUN, error_of, write

KEYS_FILE = Path(__file__).with_name("verl_ppo_trainer_keys.txt")
VERL_KEYS = [line for line in KEYS_FILE.read_text().splitlines()
             if line and not line.startswith("#")]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    rows = "".join('{"prompt": [{"role": "user", "content": "1+1"}], "data_source": "arithmetic", '
                   '"reward_model": {"style": "rule", "ground_truth": "2"}}\n' for _ in range(20))
    (tmp_path / "train.jsonl").write_text(rows)
    (tmp_path / "val.jsonl").write_text(rows)
    return tmp_path


def test_every_key_of_verls_ppo_trainer_yaml_is_in_a_group() -> None:
    assert len(VERL_KEYS) == 306
    unclassified = [key for key in VERL_KEYS if lookup(parse_key(key)) is None]
    assert unclassified == []


def test_at_least_95_percent_of_verls_keys_are_accepted() -> None:
    refused = [key for key in VERL_KEYS if lookup(parse_key(key)).group == "refused"]
    assert 1 - len(refused) / len(VERL_KEYS) >= 0.95, refused


def test_the_table_agrees_with_the_schema() -> None:
    for entry in TABLE:
        if entry.group == "same":
            assert in_schema(entry.short), f"{entry.key} is 'same' but Relay lacks it"
        if entry.group == "mapped":
            assert entry.to and entry.note, entry.key
            for to in entry.to:
                assert to.startswith("topology.") or in_schema(parse_key(to)), entry.key
        if entry.group in ("refused", "differs"):
            assert entry.note, f"{entry.key} needs a note saying why"
        if entry.accept is not None:
            assert not in_schema(entry.short), f"{entry.key}: the schema checks its values"


def test_the_committed_doc_is_the_generated_table() -> None:
    assert (CONFIG_DIR / "verl-keys.md").read_text(encoding="utf-8") == markdown_table()
    check = subprocess.run([sys.executable, str(REPO / "tools/gen-verl-docs.py"), "--check"],
                           capture_output=True, text=True, cwd=REPO)
    assert check.returncode == 0, check.stderr


def test_verls_long_section_names_work_in_a_file_and_on_the_command_line(run_dir: Path) -> None:
    path = write(run_dir, GOOD_RUN + """
[actor_rollout_ref.actor]
clip_ratio_high = 0.28
[actor_rollout_ref.rollout]
n = 4
[actor_rollout_ref.ref]
log_prob_micro_batch_size_per_gpu = 16
[actor_rollout_ref.model]
enable_gradient_checkpointing = true
""")
    run = load_run_config(path, ["actor_rollout_ref.actor.optim.lr=3e-6",
                                 "+actor_rollout_ref.rollout.temperature=0.7"])
    assert run.actor.clip_ratio_high == 0.28 and run.rollout.n == 4
    assert run.ref.log_prob_micro_batch_size_per_gpu == 16
    assert run.model.enable_gradient_checkpointing and run.model.path == "builtin:tiny-arith"
    assert run.actor.optim.lr == 3e-6 and run.rollout.temperature == 0.7


def test_one_key_under_both_names_is_refused(run_dir: Path) -> None:
    path = write(run_dir, GOOD_RUN + "[actor_rollout_ref.actor.optim]\nlr = 1e-6\n")
    err = error_of(load_run_config, path)
    assert err.key == "actor_rollout_ref.actor.optim.lr" and "actor.optim.lr" in err.problem


def test_a_typo_in_a_verl_key_suggests_the_verl_key(run_dir: Path) -> None:
    err = error_of(load_run_config, write(run_dir, GOOD_RUN),
                   ["actor_rollout_ref.actor.use_torch_compil=false"])
    assert "did you mean 'actor.use_torch_compile'" in str(err)
    err = error_of(load_run_config, write(run_dir, GOOD_RUN + "[trainer]\nprojet_name = 'x'\n"))
    assert err.source.endswith("run.toml") and "did you mean 'trainer.project_name'" in str(err)


def test_a_mapped_key_sets_its_relay_key(run_dir: Path) -> None:
    run = load_run_config(write(run_dir, GOOD_RUN), [
        "data.max_response_length=48", "actor_rollout_ref.actor.clip_ratio=0.25",
        "trainer.project_name=gsm8k", "trainer.experiment_name=qwen_grpo",
        "trainer.default_local_dir=ckpts", "trainer.max_actor_ckpt_to_keep=null"])
    assert run.rollout.response_length == 48
    assert run.actor.clip_ratio_low == run.actor.clip_ratio_high == 0.25
    assert (run.tracking.experiment, run.tracking.run_name) == ("gsm8k", "qwen_grpo")
    assert run.checkpoint.dir == str(Path.cwd() / "ckpts")  # a path, resolved as one
    assert run.checkpoint.keep_last == 2  # verl's null: Relay's default


def test_in_a_file_the_explicit_relay_key_wins_over_the_mapped_one(run_dir: Path) -> None:
    run = load_run_config(write(run_dir, GOOD_RUN + """
[rollout]
response_length = 64
[actor]
clip_ratio = 0.3
clip_ratio_high = 0.28
"""), ["data.max_response_length=48"])
    assert run.actor.clip_ratio_low == 0.3 and run.actor.clip_ratio_high == 0.28
    assert run.rollout.response_length == 48  # the command line overrides the file


def test_a_key_without_effect_is_accepted_and_noted(run_dir: Path) -> None:
    notes: list[str] = []
    run = load_run_config(write(run_dir, GOOD_RUN + """
[actor_rollout_ref.rollout]
free_cache_engine = true
"""), ["actor_rollout_ref.actor.fsdp_config.fsdp_size=-1", "trainer.logger=['console','wandb']"],
                          notes=notes)
    assert run.rollout.n == 8
    assert any(n.startswith("rollout.free_cache_engine = True: verl's colocated mode")
               for n in notes)
    assert "trainer.logger = ['console', 'wandb'] -> tracking.loggers" in notes


def test_a_value_that_would_make_a_difference_is_refused_with_the_note(run_dir: Path) -> None:
    err = error_of(load_run_config, write(run_dir, GOOD_RUN),
                   ["actor_rollout_ref.rollout.ignore_eos=true"])
    assert err.key == "rollout.ignore_eos" and "generators stop at EOS" in err.problem
    err = error_of(load_run_config, write(run_dir, GOOD_RUN + "[reward_model]\nenable = true\n"))
    assert err.source.endswith("run.toml") and err.key == "reward_model.model.path"


def test_a_refused_key_says_what_to_use_instead(run_dir: Path) -> None:
    path = write(run_dir, GOOD_RUN + "[critic]\nppo_micro_batch_size = 8\n")
    err = error_of(load_run_config, path)
    assert "critic.ppo_micro_batch_size_per_gpu" in err.problem


def test_verls_critic_lora_keys_set_the_critics_adapters(run_dir: Path) -> None:
    run = load_run_config(write(run_dir, GOOD_RUN), [
        "algorithm.adv_estimator=gae", "critic.model.lora_rank=8", "critic.model.lora_alpha=32",
        "critic.model.target_modules=[q_proj,v_proj]", "critic.model.exclude_modules=[o_proj]"])
    model = run.critic.model
    assert (model.lora_rank, model.lora_alpha) == (8, 32)
    assert (model.target_modules, model.exclude_modules) == (["q_proj", "v_proj"], ["o_proj"])
    assert run.model.lora_rank == 0  # the policy's own keys are apart
    err = error_of(load_run_config, write(run_dir, GOOD_RUN), ["critic.model.lora_rank=-1"])
    assert err.key == "critic.model.lora_rank"


def test_verls_lora_keys_set_the_policys_adapters(run_dir: Path) -> None:
    run = load_run_config(write(run_dir, GOOD_RUN), [
        "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=32",
        "actor_rollout_ref.model.target_modules=[q_proj,v_proj]"])
    assert (run.model.lora_rank, run.model.lora_alpha) == (8, 32)
    assert run.model.target_modules == ["q_proj", "v_proj"]
    err = error_of(load_run_config, write(run_dir, GOOD_RUN),
                   ["actor_rollout_ref.model.lora_adapter_path=adapter"])
    assert err.key == "model.lora_adapter_path" and "needs model.lora_rank > 0" in err.problem


def test_placement_keys_go_to_the_topology(run_dir: Path) -> None:
    placement: list[Placement] = []
    load_run_config(write(run_dir, GOOD_RUN), ["trainer.n_gpus_per_node=4", "trainer.nnodes=1",
                                               "actor_rollout_ref.rollout.name=hf",
                                               "trainer.device=cpu"], placement)
    topology = load_topology(CONFIG_DIR / "topology.toml", placement=placement)
    assert topology.learner.nproc_per_node == 4
    assert {g.engine for g in topology.generators} == {"hf"} and topology.evaluator.engine == "hf"
    two_nodes = [Placement(key="trainer.nnodes", value=2, source="command line")]
    err = error_of(load_topology, CONFIG_DIR / "topology.toml", placement=two_nodes)
    assert err.key == "trainer.nnodes" and "learner.hosts" in err.problem
    err = error_of(load_run_config, write(run_dir, GOOD_RUN), ["trainer.n_gpus_per_node=4"])
    assert "topology" in err.problem  # no topology to apply it to


@pytest.mark.parametrize("backend", ["ray", "slurm"])
def test_trainer_nnodes_sets_the_learners_node_count_where_the_backend_picks_nodes(
        backend: str) -> None:
    two_nodes = [Placement(key="trainer.nnodes", value=2, source="command line")]
    topology = load_topology(CONFIG_DIR / "topology.toml", [f"launcher.backend={backend}"],
                             placement=two_nodes)
    assert topology.learner.nnodes == 2 and topology.learner.hosts == ["127.0.0.1"]
    zero = [Placement(key="trainer.nnodes", value=0, source="command line")]
    err = error_of(load_topology, CONFIG_DIR / "topology.toml", [f"launcher.backend={backend}"],
                   placement=zero)
    assert err.key == "trainer.nnodes" and "integer >= 1" in err.problem


def test_ray_init_num_cpus_sizes_the_ray_instance_the_launcher_starts(run_dir: Path) -> None:
    placement: list[Placement] = []
    load_run_config(write(run_dir, GOOD_RUN), ["ray_init.num_cpus=16",
                                               "ray_init.timeline_json_file=null"], placement)
    topology = load_topology(CONFIG_DIR / "topology-ray.toml", placement=placement)
    assert topology.launcher.ray.num_cpus == 16
    half = [Placement(key="ray_init.num_cpus", value=0.5, source="command line")]
    err = error_of(load_topology, CONFIG_DIR / "topology-ray.toml", placement=half)
    assert err.key == "ray_init.num_cpus" and "integer >= 1" in err.problem


def test_rollout_name_vllm_or_sglang_sets_every_engine(run_dir: Path) -> None:
    for engine in ("vllm", "sglang"):
        placement: list[Placement] = []
        load_run_config(write(run_dir, GOOD_RUN), [f"actor_rollout_ref.rollout.name={engine}"],
                        placement)
        topology = load_topology(CONFIG_DIR / "topology.toml", placement=placement)
        assert [g.engine for g in topology.generators] == [engine] * len(topology.generators)
        assert topology.evaluator.engine == engine


def test_verls_engine_knobs_set_both_engines_sections(run_dir: Path) -> None:
    placement: list[Placement] = []
    load_run_config(write(run_dir, GOOD_RUN + """
[actor_rollout_ref.rollout]
gpu_memory_utilization = 0.7
[actor_rollout_ref.rollout.engine_kwargs.vllm]
swap_space = 4
disable_mm_preprocessor_cache = false
[actor_rollout_ref.rollout.engine_kwargs.sglang]
attention_backend = "triton"
"""), ["actor_rollout_ref.rollout.enforce_eager=False", "rollout.max_num_batched_tokens=4096",
       "actor_rollout_ref.rollout.max_model_len=null", "rollout.enable_chunked_prefill=false",
       "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
       "actor_rollout_ref.rollout.engine_kwargs.vllm.seed=null"], placement)
    topology = load_topology(CONFIG_DIR / "topology.toml", placement=placement)
    for at in (*topology.generators, topology.evaluator):
        for options in (at.vllm, at.sglang):
            assert options.gpu_memory_utilization == 0.7 and options.enforce_eager is False
            assert options.max_num_batched_tokens == 4096 and not options.enable_chunked_prefill
            assert options.tensor_model_parallel_size == 2
            assert options.max_model_len == 0  # verl's null: Relay's default
        # the lean engine takes the two knobs it has (relay.configs.topology_schema.LeanOptions)
        assert at.lean.gpu_memory_utilization == 0.7 and at.lean.max_num_batched_tokens == 4096
        # seed=null is dropped, as verl drops an engine argument given null
        assert at.vllm.engine_kwargs == {"swap_space": 4, "disable_mm_preprocessor_cache": False}
        assert at.sglang.engine_kwargs == {"attention_backend": "triton"}


def test_a_bad_engine_knob_is_an_error_naming_the_verl_key(run_dir: Path) -> None:
    for bad, key, problem in [
            ("actor_rollout_ref.rollout.gpu_memory_utilization=2",
             "actor_rollout_ref.rollout.gpu_memory_utilization", "<= 1.0"),
            ("rollout.enforce_eager=sometimes", "actor_rollout_ref.rollout.enforce_eager",
             "Expected `bool`"),
            ("actor_rollout_ref.rollout.engine_kwargs.vllm=3",
             "actor_rollout_ref.rollout.engine_kwargs.vllm", "Expected `object`")]:
        placement: list[Placement] = []
        load_run_config(write(run_dir, GOOD_RUN), [bad], placement)
        err = error_of(load_topology, CONFIG_DIR / "topology.toml", placement=placement)
        assert err.source == "command line" and err.key == key and problem in err.problem


def test_epochs_set_the_length_unless_steps_are_given(run_dir: Path) -> None:
    path = write(run_dir, GOOD_RUN)  # 20 rows, batches of 8: 2 steps an epoch
    assert load_run_config(path, ["trainer.total_epochs=3"]).trainer.total_training_steps == 6
    both = load_run_config(path, ["trainer.total_epochs=3", "trainer.total_training_steps=5"])
    assert both.trainer.total_training_steps == 5
    assert load_run_config(path).trainer.total_training_steps == 100  # neither: the default
    in_file = write(run_dir, GOOD_RUN + "[trainer]\ntotal_training_steps = 7\n")
    assert load_run_config(in_file).trainer.total_training_steps == 7
    epochs = load_run_config(in_file, ["trainer.total_epochs=3"])  # the command line wins
    assert epochs.trainer.total_training_steps == 6
    err = error_of(load_run_config, path, ["trainer.total_epochs=1", "data.train_batch_size=32"])
    assert err.key == "trainer.total_epochs"


def test_an_epoch_is_the_rows_filter_overlong_prompts_keeps(run_dir: Path) -> None:
    path = write(run_dir, GOOD_RUN)  # 20 rows in the files, batches of 8
    filtered = ["trainer.total_epochs=3", "data.filter_overlong_prompts=true"]
    seen = []

    def kept(run) -> int:  # stands in for the launcher's count with the model's tokenizer
        seen.append(run.data.train_files)
        return 9

    # verl's count: 9 rows kept make 1 step an epoch, where the 20 in the files make 2
    assert load_run_config(path, filtered, epoch_rows=lambda run: 9) \
        .trainer.total_training_steps == 3
    assert load_run_config(path, filtered[:1]).trainer.total_training_steps == 6  # no filter
    load_run_config(path, filtered, epoch_rows=kept)
    assert seen == [[str(run_dir / "train.jsonl")]]  # the file list, resolved and normalized
    err = error_of(load_run_config, path, filtered)  # no tokenizer: refused, not miscounted
    assert err.key == "trainer.total_epochs" and "tools/launch-cluster.py" in err.problem

    def refused(run) -> int:
        raise ValueError("data.train_files: every prompt is longer than 8 tokens")

    err = error_of(load_run_config, path, filtered, epoch_rows=refused)
    assert err.key == "data.train_files" and "every prompt" in err.problem
    err = error_of(load_run_config, path, filtered, epoch_rows=lambda run: 7)
    assert err.key == "trainer.total_epochs" and "7 training rows left by" in err.problem


def test_validation_data_dir_is_a_path_and_null_is_none(run_dir: Path) -> None:
    in_file = write(run_dir, GOOD_RUN + "[trainer]\nvalidation_data_dir = 'val_dump'\n")
    assert load_run_config(in_file).trainer.validation_data_dir == str(run_dir / "val_dump")
    unset = load_run_config(in_file, ["trainer.validation_data_dir=null"])
    assert unset.trainer.validation_data_dir == ""


def test_rollout_data_dir_resolves_as_verls_and_null_is_none(run_dir: Path, tmp_path_factory,
                                                             monkeypatch) -> None:
    """In a file: against its folder; on the command line: against the launch directory, as
    verl's does."""
    in_file = write(run_dir, GOOD_RUN + "[trainer]\nrollout_data_dir = 'dumps'\n")
    assert load_run_config(in_file).trainer.rollout_data_dir == str(run_dir / "dumps")
    launched_from = tmp_path_factory.mktemp("launch")
    monkeypatch.chdir(launched_from)
    given = load_run_config(in_file, ["trainer.rollout_data_dir=out/dumps"])
    assert given.trainer.rollout_data_dir == str(launched_from / "out" / "dumps")
    assert not (launched_from / "out").exists()  # checked, not created, at load
    unset = load_run_config(in_file, ["trainer.rollout_data_dir=null"])
    assert unset.trainer.rollout_data_dir == ""


def test_a_rollout_data_dir_that_cannot_be_written_is_a_config_error(run_dir: Path) -> None:
    (run_dir / "a-file").write_text("")
    err = error_of(load_run_config, write(run_dir, GOOD_RUN),
                   [f"trainer.rollout_data_dir={run_dir / 'a-file' / 'dumps'}"])
    assert err.key == "trainer.rollout_data_dir"
    assert f"{run_dir / 'a-file'} is not a folder" in err.problem


def test_the_reference_shares_the_actors_sequence_parallel_mesh(run_dir: Path) -> None:
    err = error_of(load_run_config, write(run_dir, GOOD_RUN),
                   ["actor_rollout_ref.ref.ulysses_sequence_parallel_size=2"])
    assert err.key == "ref.ulysses_sequence_parallel_size" and "one sequence-parallel" in str(err)
    same = load_run_config(write(run_dir, GOOD_RUN), ["actor.ulysses_sequence_parallel_size=2",
                                                      "ref.ulysses_sequence_parallel_size=2"])
    assert same.ref.ulysses_sequence_parallel_size == 2


def test_greedy_evaluation_when_do_sample_is_false(run_dir: Path) -> None:
    run = load_run_config(write(run_dir, GOOD_RUN), [
        "actor_rollout_ref.rollout.val_kwargs.temperature=0.6",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=False"])
    assert run.rollout.val_kwargs.sampling_temperature == 0.0
    sampled = load_run_config(write(run_dir, GOOD_RUN),
                              ["actor_rollout_ref.rollout.val_kwargs.temperature=0.6"])
    assert sampled.rollout.val_kwargs.sampling_temperature == 0.6


def test_refused_or_unknown_keys_raise_config_errors_not_others(run_dir: Path) -> None:
    for bad in ("trainer.logger=3", "actor_rollout_ref.rollout.name=triton"):
        with pytest.raises(ConfigError):
            placement: list[Placement] = []
            load_run_config(write(run_dir, GOOD_RUN), [bad], placement)
            load_topology(CONFIG_DIR / "topology.toml", placement=placement)


def test_dapos_reward_kwargs_set_the_overlong_buffer(run_dir: Path) -> None:
    run = load_run_config(write(run_dir, GOOD_RUN), [
        "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.len=256",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False",
        "data.max_response_length=512", "reward_model.reward_manager=dapo"])
    overlong = run.reward_model.overlong_buffer
    assert overlong.enable and overlong.len == 256 and overlong.penalty_factor == 1.0


def test_overriding_the_models_config_is_refused_with_the_way_to_do_it(run_dir: Path) -> None:
    err = error_of(load_run_config, write(run_dir, GOOD_RUN),
                   ["+actor_rollout_ref.model.override_config.max_position_embeddings=32768"])
    assert "edit config.json" in err.problem
    assert load_run_config(write(run_dir, GOOD_RUN + "[model.override_config]\n")).model


def test_trainer_logger_chooses_the_trackers(run_dir: Path, monkeypatch) -> None:
    run = load_run_config(write(run_dir, GOOD_RUN), ["trainer.logger=['console','mlflow']"])
    assert run.tracking.loggers == ["console", "mlflow"]
    err = error_of(load_run_config, write(run_dir, GOOD_RUN), ["trainer.logger=['clearml']"])
    assert err.key == "tracking.loggers[0]" and "'swanlab'" in err.problem
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)  # not installed
    err = error_of(load_run_config, write(run_dir, GOOD_RUN), ["trainer.logger=['wandb']"])
    assert err.key == "tracking.loggers" and "pip install wandb" in err.problem


def test_null_for_a_verl_key_relay_has_means_relays_default(run_dir: Path) -> None:
    path = write(run_dir, GOOD_RUN + "[custom_reward_function]\nname = 'f'\n")
    run = load_run_config(path, ["trainer.resume_from_path=null",
                                 "custom_reward_function.name=null", "data.val_files=null"])
    assert run.trainer.resume_from_path == "" and run.custom_reward_function.name == \
        "compute_score" and run.data.val_files == []
    named = load_run_config(write(run_dir, GOOD_RUN), ["tracking.experiment=null"])
    assert named.tracking.experiment == "null"  # not a verl key: the text is the name


def test_placement_keys_in_a_file_go_to_the_topology_too(run_dir: Path) -> None:
    placement: list[Placement] = []
    load_run_config(write(run_dir, GOOD_RUN + "[trainer]\nn_gpus_per_node = 2\n"), (), placement)
    assert placement == [Placement(key="trainer.n_gpus_per_node", value=2,
                                   source=str(run_dir / "run.toml"))]
    assert load_topology(CONFIG_DIR / "topology.toml",
                         placement=placement).learner.nproc_per_node == 2


def test_fsdp_size_is_a_relay_key_of_the_actor_the_ref_and_the_critic(run_dir: Path) -> None:
    """verl's fsdp_size (HSDP: relay.learner.model.sharding_mesh) is Relay's own key: the ref takes
    the actor's unless set, the critic has its own; below -1 is refused naming the key."""
    path = write(run_dir, GOOD_RUN + "[critic.model.fsdp_config]\nfsdp_size = 4\n")
    run = load_run_config(path, ["actor_rollout_ref.actor.fsdp_config.fsdp_size=32"])
    assert run.actor.fsdp_config.fsdp_size == 32
    assert run.ref.resolve(run.actor).fsdp_config.fsdp_size == 32
    assert run.critic.model.fsdp_config.fsdp_size == 4
    run = load_run_config(path, ["actor_rollout_ref.ref.fsdp_config.fsdp_size=8"])
    assert (run.actor.fsdp_config.fsdp_size, run.ref.resolve(run.actor).fsdp_config.fsdp_size,
            run.critic.model.fsdp_config.fsdp_size) == (-1, 8, 4)
    err = error_of(load_run_config, path, ["critic.model.fsdp_config.fsdp_size=-2"])
    assert err.key == "critic.model.fsdp_config.fsdp_size" and ">= -1" in err.problem


def test_reward_models_keys_and_verls_newer_reward_section(run_dir: Path) -> None:
    (run_dir / "fns.py").write_text("def batch(data_sources, solution_strs, ground_truths, "
                                    "extra_infos, **kw):\n    return [0.0] * len(data_sources)\n")
    (run_dir / "rm").mkdir()  # only looked up here: a folder with a config
    (run_dir / "rm" / "config.json").write_text(
        '{"architectures": ["LlamaForSequenceClassification"]}')
    run = load_run_config(write(run_dir, GOOD_RUN), [
        f"+reward.custom_reward_function.path={run_dir / 'fns.py'}",
        "+reward.custom_reward_function.name=batch", "+reward.reward_manager.name=batch",
        "+reward.reward_model.enable=True", f"+reward.reward_model.model_path={run_dir / 'rm'}",
        "reward_model.model.input_tokenizer=policy", "reward_model.micro_batch_size_per_gpu=4",
        "reward_model.max_length=256", "+reward.num_workers=8"])
    assert run.custom_reward_function.reward_manager == "batch"
    assert run.custom_reward_function.name == "batch"
    assert run.reward_model.enable and run.reward_model.model.path == str(run_dir / "rm")
    assert run.reward_model.micro_batch_size_per_gpu == 4 and run.reward_model.max_length == 256
    run = load_run_config(write(run_dir, GOOD_RUN), ["reward_model.reward_manager=prime"])
    assert run.custom_reward_function.reward_manager == "prime"
    err = error_of(load_run_config, write(run_dir, GOOD_RUN), ["reward_model.reward_manager=batch"])
    assert "custom_reward_function.path" in str(err)


def test_reward_kwargs_reach_the_custom_function_in_either_section(run_dir: Path) -> None:
    fns = run_dir / "fns.py"
    fns.write_text("def f(data_source, solution_str, ground_truth, extra_info=None, *, "
                   "scale=1.0, bonus=0.0):\n    return scale * float(solution_str == "
                   "ground_truth) + bonus\n")
    for prefix in ("", "+reward."):
        run = load_run_config(write(run_dir, GOOD_RUN), [
            f"{prefix}custom_reward_function.path={fns}", f"{prefix}custom_reward_function.name=f",
            f"+{prefix.lstrip('+')}custom_reward_function.reward_kwargs.scale=2.0",
            f"+{prefix.lstrip('+')}custom_reward_function.reward_kwargs.bonus=0.5"])
        assert run.custom_reward_function.reward_kwargs == {"scale": 2.0, "bonus": 0.5}
    from relay.algorithms.rewards.config import build_score_fn
    assert build_score_fn(run.custom_reward_function)("s", "4", "4") == 2.5
    # a file's table, an inline table on the command line, a bare word as a string
    table = GOOD_RUN + (f"[custom_reward_function]\npath = '{fns}'\nname = 'f'\n"
                        "[custom_reward_function.reward_kwargs]\nscale = 3.0\n")
    run = load_run_config(write(run_dir, table), ["custom_reward_function.reward_kwargs.tag=x"])
    assert run.custom_reward_function.reward_kwargs == {"scale": 3.0, "tag": "x"}
    run = load_run_config(write(run_dir, table),
                          ["custom_reward_function.reward_kwargs={bonus = 1.0}"])
    assert run.custom_reward_function.reward_kwargs == {"bonus": 1.0}
    err = error_of(load_run_config, write(run_dir, table),
                   ["custom_reward_function.reward_kwargs={bonus: 1.0}"])
    assert "inline table" in str(err)
    err = error_of(load_run_config, write(run_dir, GOOD_RUN),
                   ["+custom_reward_function.reward_kwargs.scale=2.0"])
    assert "custom_reward_function.path" in str(err)
    err = error_of(load_run_config, write(run_dir, GOOD_RUN), [
        f"custom_reward_function.path={fns}", "custom_reward_function.name=f",
        "+custom_reward_function.reward_kwargs.ground_truth=1"])
    assert "ground_truth" in str(err)
