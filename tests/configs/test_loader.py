"""Every class of config error names the source, the key and what was expected."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.configs import DEFAULT_RUN, DEFAULT_TOPOLOGY, ConfigError, load_run_config, load_topology

GOOD_RUN = """
[data]
train_files = "train.jsonl"
val_files = ["val.jsonl"]
train_batch_size = 8

[model]
path = "builtin:tiny-arith"

[actor.optim]
lr = 1e-5
"""


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    (tmp_path / "train.jsonl").write_text("{}\n")
    (tmp_path / "val.jsonl").write_text("{}\n")
    return tmp_path


def write(folder: Path, text: str, name: str = "run.toml") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def error_of(fn, *args, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    return info.value


def test_good_run_config_resolves_paths_against_its_folder(run_dir: Path) -> None:
    run = load_run_config(write(run_dir, GOOD_RUN))
    assert run.data.train_files == [str(run_dir / "train.jsonl")]
    assert run.data.val_files == [str(run_dir / "val.jsonl")]
    assert run.data.train_batch_size == 8
    assert run.actor.optim.lr == 1e-5
    assert run.rollout.n == 8  # schema default


def test_missing_file_is_named(tmp_path: Path) -> None:
    err = error_of(load_run_config, tmp_path / "nope.toml")
    assert err.source.endswith("nope.toml") and "file not found" in str(err)


def test_invalid_toml_names_file_and_line(run_dir: Path) -> None:
    path = write(run_dir, "[data]\ntrain_files = \n")
    err = error_of(load_run_config, path)
    assert str(path) in str(err) and "not valid TOML" in str(err) and "line 2" in str(err)


def test_unknown_key_suggests_the_closest_valid_one(run_dir: Path) -> None:
    path = write(run_dir, GOOD_RUN.replace("train_batch_size", "trian_batch_size"))
    err = error_of(load_run_config, path)
    assert err.source == str(path)
    assert err.key == "data.trian_batch_size"
    assert "did you mean 'data.train_batch_size'" in str(err)


def test_unknown_key_in_wrong_section_points_to_where_it_lives(run_dir: Path) -> None:
    path = write(run_dir, GOOD_RUN + "\n[rollout]\nclip_ratio_high = 0.3\n")
    err = error_of(load_run_config, path)
    assert err.key == "rollout.clip_ratio_high"
    assert "did you mean 'actor.clip_ratio_high'" in str(err)


def test_unknown_section_is_reported(run_dir: Path) -> None:
    err = error_of(load_run_config, write(run_dir, GOOD_RUN + "\n[trainr]\nseed = 1\n"))
    assert err.key == "trainr" and "did you mean 'trainer'" in str(err)


def test_wrong_type_names_key_expected_and_value(run_dir: Path) -> None:
    err = error_of(load_run_config,
                   write(run_dir, GOOD_RUN.replace("train_batch_size = 8",
                                                   'train_batch_size = "eight"')))
    assert err.key == "data.train_batch_size"
    assert "expected an integer > 0, got 'eight'" in str(err)


def test_out_of_range_value_is_refused(run_dir: Path) -> None:
    err = error_of(load_run_config,
                   write(run_dir, GOOD_RUN.replace("train_batch_size = 8", "train_batch_size = 0")))
    assert err.key == "data.train_batch_size" and "got 0" in str(err)


def test_bad_choice_lists_the_valid_choices(run_dir: Path) -> None:
    err = error_of(load_run_config,
                   write(run_dir, GOOD_RUN + '\n[actor]\nloss_agg_mode = "mean"\n'))
    assert err.key == "actor.loss_agg_mode"
    assert "'token-mean'" in str(err) and "got 'mean'" in str(err)


def test_missing_required_key(run_dir: Path) -> None:
    err = error_of(load_run_config, write(run_dir, GOOD_RUN.replace('path = "builtin:tiny-arith"',
                                                                    "")))
    assert err.key == "model.path" and "missing required key (expected a string)" in str(err)


def test_overrides_are_coerced_by_the_schema(run_dir: Path) -> None:
    run = load_run_config(write(run_dir, GOOD_RUN), [
        "data.train_batch_size=4", "actor.optim.lr=3e-4", "actor.use_kl_loss=true",
        "trainer.run_dir=123", 'actor.optim.betas=[0.8, 0.9]', "rollout.top_p=1",
    ])
    assert run.data.train_batch_size == 4
    assert run.actor.optim.lr == 3e-4
    assert run.actor.use_kl_loss is True
    assert run.trainer.run_dir == "123"  # a string key keeps the text as is
    assert run.actor.optim.betas == [0.8, 0.9]
    assert run.rollout.top_p == 1.0


def test_override_paths_resolve_against_the_working_directory(run_dir: Path,
                                                              monkeypatch) -> None:
    monkeypatch.chdir(run_dir)
    other = run_dir / "sub"
    other.mkdir()
    (other / "t.jsonl").write_text("{}\n")
    config = write(other, GOOD_RUN.replace('"train.jsonl"', '"t.jsonl"')
                   .replace('["val.jsonl"]', "[]"))
    run = load_run_config(config, ["data.val_files=val.jsonl"])
    assert run.data.train_files == [str(other / "t.jsonl")]
    assert run.data.val_files == [str(run_dir / "val.jsonl")]


def test_override_with_bad_value_blames_the_command_line(run_dir: Path) -> None:
    err = error_of(load_run_config, write(run_dir, GOOD_RUN), ["data.train_batch_size=abc"])
    assert err.source == "command line" and err.key == "data.train_batch_size"
    assert "expected an integer > 0, got 'abc'" in str(err)


def test_override_out_of_range_blames_the_command_line(run_dir: Path) -> None:
    err = error_of(load_run_config, write(run_dir, GOOD_RUN), ["rollout.n=0"])
    assert err.source == "command line" and err.key == "rollout.n"


def test_override_unknown_key_suggests(run_dir: Path) -> None:
    err = error_of(load_run_config, write(run_dir, GOOD_RUN), ["actor.optim.learning_rate=1"])
    assert err.source == "command line" and "valid keys in [actor.optim]" in str(err)
    err = error_of(load_run_config, write(run_dir, GOOD_RUN), ["actor.optim.lrr=1"])
    assert "did you mean 'actor.optim.lr'" in str(err)


def test_override_without_equals_sign(run_dir: Path) -> None:
    err = error_of(load_run_config, write(run_dir, GOOD_RUN), ["data.train_batch_size"])
    assert "section.key=value" in str(err)


def test_missing_data_file(run_dir: Path) -> None:
    err = error_of(load_run_config, write(run_dir, GOOD_RUN.replace("val.jsonl", "gone.jsonl")))
    assert err.key == "data.val_files[0]" and "gone.jsonl" in str(err)


def test_model_path_without_checkpoint(run_dir: Path) -> None:
    err = error_of(load_run_config, write(run_dir, GOOD_RUN), [f"model.path={run_dir}"])
    assert err.key == "model.path" and "config.json missing" in str(err)
    err = error_of(load_run_config, write(run_dir, GOOD_RUN), ["model.path=builtin:huge"])
    assert "unknown built-in model 'huge'" in str(err)


def test_critic_with_another_vocabulary_is_refused(run_dir: Path) -> None:
    for name, vocab in (("policy", 100), ("critic", 200)):
        (run_dir / name).mkdir()
        (run_dir / name / "config.json").write_text(f'{{"vocab_size": {vocab}}}')
    err = error_of(load_run_config, write(run_dir, GOOD_RUN),
                   [f"model.path={run_dir / 'policy'}", f"critic.model.path={run_dir / 'critic'}"])
    assert err.key == "critic.model.path" and "vocab_size 200 differs" in str(err)


def test_verls_filter_groups_section_is_accepted_under_its_verl_name(run_dir: Path) -> None:
    in_file = load_run_config(write(run_dir, GOOD_RUN + """
[algorithm.filter_groups]
enable = true
metric = "acc"
"""))
    assert in_file.buffer.filter_groups.enable and in_file.buffer.filter_groups.metric == "acc"
    overridden = load_run_config(write(run_dir, GOOD_RUN),
                                 ["algorithm.filter_groups.max_num_gen_batches=3"])
    assert overridden.buffer.filter_groups.max_num_gen_batches == 3
    err = error_of(load_run_config, write(run_dir, GOOD_RUN + """
[algorithm.filter_groups]
enable = true
[buffer.filter_groups]
enable = false
"""))
    assert err.key == "algorithm.filter_groups.enable"
    assert "buffer.filter_groups.enable, which is also set" in str(err)
    merged = load_run_config(write(run_dir, GOOD_RUN + """
[algorithm.filter_groups]
enable = true
[buffer.filter_groups]
metric = "acc"
"""))  # the two names of one section merge, key by key
    assert merged.buffer.filter_groups.enable and merged.buffer.filter_groups.metric == "acc"


def test_a_section_in_the_wrong_place_points_to_where_it_lives(run_dir: Path) -> None:
    err = error_of(load_run_config, write(run_dir, GOOD_RUN), ["algorithm.pf_ppo.mode=best"])
    # verl has an algorithm.pf_ppo section of its own, without mode (relay.configs.verl_keys)
    assert err.key == "algorithm.pf_ppo.mode" and "did you mean 'buffer.pf_ppo.mode'" in str(err)


def test_overlong_buffer_must_fit_the_response(run_dir: Path) -> None:
    err = error_of(load_run_config, write(run_dir, GOOD_RUN),
                   ["reward_model.overlong_buffer.enable=true", "rollout.response_length=64",
                    "reward_model.overlong_buffer.len=65"])
    assert err.key == "reward_model.overlong_buffer.len" and "(0, rollout" in str(err)
    err = error_of(load_run_config, write(run_dir, GOOD_RUN),
                   ["reward_model.overlong_buffer.enable=true", "rollout.response_length=64",
                    "reward_model.overlong_buffer.len=16", "algorithm.adv_estimator=prime"])
    assert err.key == "reward_model.overlong_buffer.enable" and "[0, 1]" in str(err)


def test_grpo_needs_two_samples_per_prompt(run_dir: Path) -> None:
    err = error_of(load_run_config, write(run_dir, GOOD_RUN), ["rollout.n=1"])
    assert err.key == "rollout.n" and "at least 2" in str(err)


def test_a_generator_must_hold_one_prompts_samples(run_dir: Path) -> None:
    err = error_of(load_run_config, write(run_dir, GOOD_RUN),
                   ["rollout.n=8", "rollout.max_num_seqs=8", "algorithm.adv_estimator=remax"])
    assert err.key == "rollout.max_num_seqs" and "9 sequences" in str(err)


def test_mini_batch_must_divide_the_batch(run_dir: Path) -> None:
    err = error_of(load_run_config, write(run_dir, GOOD_RUN), ["actor.ppo_mini_batch_size=3"])
    assert err.key == "actor.ppo_mini_batch_size" and "does not divide" in str(err)


def test_a3po_needs_one_version_per_step(run_dir: Path) -> None:
    err = error_of(load_run_config, write(run_dir, GOOD_RUN),
                   ["actor.proximal_logprobs=a3po", "trainer.publish_every=2"])
    assert err.key == "actor.proximal_logprobs" and "publish_every" in str(err)


def test_prime_refuses_kl_in_the_reward(run_dir: Path) -> None:
    err = error_of(load_run_config, write(run_dir, GOOD_RUN),
                   ["algorithm.adv_estimator=prime", "algorithm.use_kl_in_reward=true"])
    assert err.key == "algorithm.use_kl_in_reward" and "use_kl_loss" in str(err)


def test_sections_defined_in_algorithms_keep_verls_keys_and_name_bad_ones(run_dir: Path) -> None:
    run = load_run_config(write(run_dir, GOOD_RUN + """
[custom_reward_function]
path = "reward.py"
name = "score"
timeout_s = 2.5

[actor.policy_loss]
loss_mode = "gspo"

[algorithm.kl_ctrl]
type = "adaptive"

[algorithm.rollout_correction]
rollout_rs = "token"
"""))
    assert run.custom_reward_function.custom_function == f"{run_dir / 'reward.py'}:score"
    assert run.custom_reward_function.timeout_s == 2.5
    assert run.actor.policy_loss.loss_mode == "gspo" and run.algorithm.kl_ctrl.type == "adaptive"
    assert run.algorithm.rollout_correction.rs_bounds == (0.5, 2.0)  # lower: 1 / upper
    for override, key, expected in [
        ("actor.policy_loss.tau_pos=0", "actor.policy_loss.tau_pos", "a number > 0"),
        ("algorithm.kl_ctrl.horizon=0", "algorithm.kl_ctrl.horizon", "an integer > 0"),
        ("custom_reward_function.timeout_s=-1", "custom_reward_function.timeout_s",
         "a number > 0"),
        ("algorithm.rollout_correction.rollout_is=seq",
         "algorithm.rollout_correction.rollout_is", "'sequence'"),
    ]:
        err = error_of(load_run_config, write(run_dir, GOOD_RUN), [override])
        assert err.key == key and expected in str(err)
    err = error_of(load_run_config, write(run_dir, GOOD_RUN),
                   ["custom_reward_function.nmae=f"])
    assert "did you mean 'custom_reward_function.name'" in str(err)


def test_rejection_bounds_must_leave_an_interval(run_dir: Path) -> None:
    rejecting = "algorithm.rollout_correction.rollout_rs=token"
    err = error_of(load_run_config, write(run_dir, GOOD_RUN),
                   [rejecting, "algorithm.rollout_correction.rollout_rs_threshold=1.5",
                    "algorithm.rollout_correction.rollout_rs_threshold_lower=2"])
    assert err.key == "algorithm.rollout_correction.rollout_rs_threshold_lower"
    assert "no ratio would be accepted" in str(err)
    # an upper bound below 1 with the default lower bound 1 / upper
    err = error_of(load_run_config, write(run_dir, GOOD_RUN),
                   [rejecting, "algorithm.rollout_correction.rollout_rs_threshold=0.8"])
    assert err.key == "algorithm.rollout_correction.rollout_rs_threshold"
    assert "set rollout_rs_threshold_lower" in str(err)
    # without rejection the band is unused and not checked
    load_run_config(write(run_dir, GOOD_RUN),
                    ["algorithm.rollout_correction.rollout_rs_threshold=0.8"])


def test_clip_cov_bounds_must_leave_an_interval(run_dir: Path) -> None:
    err = error_of(load_run_config, write(run_dir, GOOD_RUN),
                   ["actor.policy_loss.clip_cov_lb=5", "actor.policy_loss.clip_cov_ub=5"])
    assert err.key == "actor.policy_loss.clip_cov_lb" and "clip_cov_ub (5.0)" in str(err)


def test_default_configs_load() -> None:
    topology = load_topology(DEFAULT_TOPOLOGY)
    assert [g.name for g in topology.generators] == ["gen0"]
    assert topology.learner.nproc_per_node == 1
    run = load_run_config(DEFAULT_RUN)
    assert run.model.path == "builtin:tiny-arith"
    assert all(Path(f).is_file() for f in run.data.train_files + run.data.val_files)


# ---- topology ---------------------------------------------------------------------------

TOPOLOGY = """
[buffer]
port = 7000

[[generators]]
name = "a"

[[generators]]
name = "b"
engine = "hf"
"""


def test_topology_generator_list_and_index_overrides(tmp_path: Path) -> None:
    topology = load_topology(write(tmp_path, TOPOLOGY, "t.toml"),
                             ["generators[1].engine=torch", "generators.0.device=cuda:1"])
    assert [(g.name, g.engine, g.device) for g in topology.generators] == [
        ("a", "lean", "cuda:1"), ("b", "torch", "cpu")]


def test_topology_unknown_key_in_list_item(tmp_path: Path) -> None:
    err = error_of(load_topology, write(tmp_path, TOPOLOGY.replace('engine = "hf"',
                                                                   'engin = "hf"'), "t.toml"))
    assert err.key == "generators[1].engin" and "did you mean 'generators[1].engine'" in str(err)


def test_topology_bad_engine_lists_engines(tmp_path: Path) -> None:
    err = error_of(load_topology, write(tmp_path, TOPOLOGY, "t.toml"), ["generators[0].engine=x"])
    assert err.key == "generators[0].engine"
    assert "'hf', 'lean', 'sglang', 'torch', 'vllm'" in str(err)


def test_topology_index_out_of_range(tmp_path: Path) -> None:
    err = error_of(load_topology, write(tmp_path, TOPOLOGY, "t.toml"), ["generators[5].engine=hf"])
    assert "out of range" in str(err)


def test_topology_duplicate_generator_names(tmp_path: Path) -> None:
    err = error_of(load_topology, write(tmp_path, TOPOLOGY.replace('"b"', '"a"'), "t.toml"))
    assert err.key == "generators[1].name" and "already the name of generators[0]" in str(err)


def test_topology_port_range(tmp_path: Path) -> None:
    err = error_of(load_topology, write(tmp_path, TOPOLOGY.replace("7000", "70000"), "t.toml"))
    assert err.key == "buffer.port" and "<= 65535" in str(err)


def test_non_loopback_address_requires_curve(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    remote = ["launcher.backend=ssh", "buffer.host=10.1.2.3"]
    err = error_of(load_topology, write(tmp_path, TOPOLOGY, "t.toml"), remote)
    assert err.key == "buffer.host" and "CURVE" in str(err)
    err = error_of(load_topology, write(tmp_path, TOPOLOGY, "t.toml"),
                   [*remote, "security.curve=true", "security.keys_dir=nokeys"])
    assert err.key == "security.keys_dir" and "does not exist" in str(err)
    (tmp_path / "keys").mkdir()
    topology = load_topology(write(tmp_path, TOPOLOGY, "t.toml"),
                             [*remote, "security.curve=true", "security.keys_dir=keys"])
    assert topology.security.curve


def test_a_lease_may_not_wait_for_weights_longer_than_the_buffer_keeps_it() -> None:
    with pytest.raises(ConfigError, match="buffer.weights_timeout_s.*exceeds "
                                          "buffer.lease_timeout_s"):
        load_run_config(DEFAULT_RUN, ["buffer.lease_timeout_s=60",
                                      "buffer.weights_timeout_s=90"])
    run = load_run_config(DEFAULT_RUN, ["buffer.lease_timeout_s=60"])
    assert run.buffer.weights_timeout_s == 0  # the lease's own timeout


def test_a_hub_id_model_path_is_kept_as_written_unless_it_is_a_local_folder(
        run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from relay.configs.loader import load
    from relay.configs.run_schema import RunConfig

    path = write(run_dir, GOOD_RUN.replace("builtin:tiny-arith", "Org/Model"))
    keys = [("model", "path")]
    run = load(RunConfig, path, path_keys=keys, hub_id_keys=keys)
    assert run.model.path == "Org/Model"
    (run_dir / "Org" / "Model").mkdir(parents=True)
    assert load(RunConfig, path, path_keys=keys, hub_id_keys=keys).model.path == str(
        run_dir / "Org" / "Model")
    monkeypatch.chdir(run_dir)
    run = load(RunConfig, write(run_dir, GOOD_RUN), ["model.path=Org/Other"], path_keys=keys,
               hub_id_keys=keys)
    assert run.model.path == "Org/Other"


def test_a_check_failing_on_a_command_line_value_names_the_command_line(
        run_dir: Path) -> None:
    path = write(run_dir, GOOD_RUN)
    err = error_of(load_run_config, path, ["actor.ppo_mini_batch_size=3"])
    assert (err.source, err.key) == ("command line", "actor.ppo_mini_batch_size")
    err = error_of(load_run_config,
                   write(run_dir, GOOD_RUN + "\n[actor]\nppo_mini_batch_size = 3\n"))
    assert (err.source, err.key) == (str(path), "actor.ppo_mini_batch_size")


USER_ALGORITHMS = Path(__file__).resolve().parents[1] / "e2e" / "user_algorithms.py"


def test_a_users_estimator_and_loss_by_path_resolve_against_the_working_directory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(USER_ALGORITHMS.parents[2])
    run = load_run_config(DEFAULT_RUN, [
        "algorithm.adv_estimator=tests/e2e/user_algorithms.py:centered_score",
        "actor.policy_loss.loss_mode=tests/e2e/user_algorithms.py:clipped_reinforce"])
    assert run.algorithm.adv_estimator == f"{USER_ALGORITHMS}:centered_score"
    assert run.actor.policy_loss.loss_mode == f"{USER_ALGORITHMS}:clipped_reinforce"
    assert run.algorithm.estimator.name == "user_centered_score"


def test_a_users_file_named_in_the_config_resolves_against_its_folder(run_dir: Path) -> None:
    (run_dir / "mine.py").write_text("def zero(inputs, norm_adv_by_std_in_grpo, gamma):\n"
                                     "    return 0 * inputs.response_mask\n")
    config = GOOD_RUN + '\n[algorithm]\nadv_estimator = "./mine.py:zero"\n'
    run = load_run_config(write(run_dir, config), ["actor.policy_loss.loss_mode=gspo"])
    assert run.algorithm.adv_estimator == f"{run_dir / 'mine.py'}:zero"
    assert run.actor.policy_loss.loss_mode == "gspo"  # a name is left as it is


@pytest.mark.parametrize("key, value, problem", [
    ("actor.policy_loss.loss_mode", f"{USER_ALGORITHMS}:wrong_signature_loss",
     r"wrong_signature_loss\(logprobs.*does not take the arguments Relay passes"),
    ("algorithm.adv_estimator", f"{USER_ALGORITHMS}:clipped_reinforce",
     r"clipped_reinforce\(.*does not take the arguments Relay passes, \(inputs, "),
    ("algorithm.adv_estimator", "ppo", "unknown advantage estimator 'ppo'; known: grpo, rloo"),
    ("actor.policy_loss.loss_mode", "losses.py:mine", "file not found"),
    # the user's file is loaded here by the estimator's path, not in the other processes
    ("actor.policy_loss.loss_mode", "user_clipped_reinforce",
     f"'user_clipped_reinforce' is registered by a module that only this process imported; "
     f"name its function by path, '{USER_ALGORITHMS}:clipped_reinforce'"),
])
def test_an_estimator_or_loss_that_does_not_fit_is_refused_naming_the_key(
        key: str, value: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem) as info:
        load_run_config(DEFAULT_RUN, [f"algorithm.adv_estimator={USER_ALGORITHMS}:centered_score",
                                      f"{key}={value}"])
    assert info.value.key == key
