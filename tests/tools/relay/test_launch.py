"""relay.launch: the user mistakes a launch refuses (exit 2, naming the cause) before anything
starts, through ``--dry-run`` as a real launch takes the same path; ``builtin:`` for every
model path; a Hub ID resolved from the local cache; the verl-key notes written to the run
directory and printed at a real launch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from relay import launch
from relay.configs import DEFAULT_RUN, DEFAULT_TOPOLOGY, load_run_config
from relay.configs.rundir import VERL_KEYS
from relay.launcher import resources, supervisor

GOOD_ROW = {"prompt": [{"role": "user", "content": "1 + 1?"}], "data_source": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": "2"}}


def dry_run(tmp_path: Path, *args: str) -> int:
    return launch.main([*args, f"trainer.run_dir={tmp_path / 'runs'}", "--dry-run"])


def refusal(capsys: pytest.CaptureFixture[str], code: int) -> str:
    assert code == 2
    return capsys.readouterr().err


def jsonl(path: Path, *rows: dict) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize(("row", "name", "cause"), [
    ({**GOOD_ROW, "prompt": "1 + 1?"}, "train.jsonl", "field `prompt`: expected `array`"),
    ({k: v for k, v in GOOD_ROW.items() if k != "reward_model"}, "train.jsonl",
     "field `reward_model`: missing"),
    ({**GOOD_ROW, "data_source": "nobody/knows"}, "train.jsonl",
     "no built-in reward function for data_source 'nobody/knows'"),
    (GOOD_ROW, "train.csv", "unsupported file type '.csv'"),
], ids=["prompt-as-string", "no-reward_model", "unknown-data_source", "suffix"])
def test_a_broken_training_file_is_refused_as_a_validation_file_is(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], row: dict, name: str,
        cause: str) -> None:
    train = jsonl(tmp_path / name, row)
    err = refusal(capsys, dry_run(tmp_path, f"data.train_files={train}"))
    assert "data.train_files" in err and cause in err


def test_a_bad_value_from_the_command_line_is_blamed_on_the_command_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = refusal(capsys, dry_run(tmp_path, "actor.ppo_mini_batch_size=7"))
    assert "config error: command line: actor.ppo_mini_batch_size: 7 does not divide" in err
    assert str(DEFAULT_RUN) not in err



def test_dry_run_may_come_before_the_overrides(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    code = launch.main([str(DEFAULT_TOPOLOGY), "--dry-run", "trainer.total_training_steps=3",
                        f"trainer.run_dir={tmp_path / 'runs'}"])
    assert code == 0
    assert "total_training_steps = 3" in capsys.readouterr().out

def test_the_same_value_in_the_file_is_blamed_on_the_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run.toml"
    run.write_text(DEFAULT_RUN.read_text().replace("[actor]", "[actor]\nppo_mini_batch_size = 7")
                   .replace('"data/', f'"{DEFAULT_RUN.parent}/data/'))
    err = refusal(capsys, dry_run(tmp_path, str(DEFAULT_TOPOLOGY), str(run)))
    assert f"{run}: actor.ppo_mini_batch_size: 7 does not divide" in err


def test_a_lone_run_config_passed_first_is_named_as_that_mistake(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = refusal(capsys, dry_run(tmp_path, str(DEFAULT_RUN)))
    assert "this is a run config" in err and "the first config file is the topology" in err
    assert f"relay launch {DEFAULT_TOPOLOGY} {DEFAULT_RUN}" in err
    assert "unknown key" not in err


@pytest.mark.parametrize(("override", "key"), [
    ("topology.generators[0].device=gpu0", "generators[0].device"),
    ("topology.evaluator.device=cuda:first", "evaluator.device"),
    ("topology.learner.device=gpu0", "learner.device"),
])
def test_a_device_that_is_not_one_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], override: str, key: str) -> None:
    err = refusal(capsys, dry_run(tmp_path, override))
    assert f"command line: {key}" in err and "'cpu'" in err and "'cuda'" in err


def test_cuda_with_a_gpu_index_is_a_device(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resources, "cuda_device_count", lambda: 2)  # a machine with 2 GPUs
    assert dry_run(tmp_path, "topology.generators[0].device=cuda:1",
                   "topology.evaluator.device=cuda") == 0


def test_builtin_works_for_the_critic_and_the_reward_model(
        tmp_path: Path, random_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    builtin = ["critic.model.path=builtin:tiny-arith", "reward_model.model.path=builtin:tiny-arith"]
    assert dry_run(tmp_path, "algorithm.adv_estimator=gae", "rollout.n=1", *builtin) == 0
    from relay.learner.tiny_model import build

    monkeypatch.setattr(build, "default_model_dir",
                        lambda name="tiny-arith": random_model_dir)  # built already
    run = supervisor.builtin_model(load_run_config(DEFAULT_RUN, builtin))
    assert {run.model.path, run.critic.model.path, run.reward_model.model.path} == {
        str(random_model_dir)}


def hub_cache(root: Path, repo_id: str, model: Path) -> Path:
    """A Hugging Face cache under ``root`` holding ``model``'s files as ``repo_id``, laid out
    as huggingface_hub writes it; returns the snapshot folder."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    shutil.copytree(model, snapshot)
    return snapshot


def test_a_hub_id_in_the_cache_is_resolved_to_its_snapshot_folder(
        tmp_path: Path, random_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)  # no ./Qwen folder: the value is a Hub ID
    snapshot = hub_cache(tmp_path / "hub", "Qwen/Tiny-Instruct", random_model_dir)
    assert dry_run(tmp_path, "model.path=Qwen/Tiny-Instruct") == 0
    assert f'path = "{snapshot}"' in capsys.readouterr().out  # the resolved config's
    shutil.rmtree(tmp_path / "hub")
    err = refusal(capsys, dry_run(tmp_path, "model.path=Qwen/Tiny-Instruct"))
    assert "command line: model.path: 'Qwen/Tiny-Instruct' looks like a Hub ID" in err
    assert f"HF_HUB_CACHE={tmp_path / 'hub'}" in err and "HF_HUB_OFFLINE" in err


def test_a_launch_writes_and_prints_the_verl_key_notes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    started = []
    monkeypatch.setattr(supervisor, "launch", lambda resolved: started.append(resolved) or 0)
    assert launch.main(["actor_rollout_ref.model.use_remove_padding=true",
                        f"trainer.run_dir={tmp_path}"]) == 0
    run_dir = started[0].run_dir
    assert "model.use_remove_padding = True: " in (run_dir / VERL_KEYS).read_text()
    out = capsys.readouterr().out
    assert "1 verl key(s) translated" in out and str(run_dir / VERL_KEYS) in out
    assert "model.use_remove_padding = True: " in out


def test_verls_hydra_config_file_gives_overrides_the_command_line_wins_over(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "recipe.yaml").write_text(
        "hydra:\n  searchpath: [file://verl/trainer/config]\n"
        "defaults:\n  - ppo_trainer\n  - _self_\n"
        "data:\n  train_batch_size: 8\n  return_raw_chat: True\n"
        "actor_rollout_ref:\n  rollout:\n    n: 3\n    multi_turn:\n      enable: True\n"
        "      max_assistant_turns: 5\n"
        "trainer:\n  logger: ['console']\n")
    assert launch.hydra_file_overrides(tmp_path, "recipe") == [
        "data.train_batch_size=8", "data.return_raw_chat=true", "actor_rollout_ref.rollout.n=3",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5",
        'trainer.logger=["console"]']
    assert dry_run(tmp_path, f"--config-path={tmp_path}", "--config-name=recipe",
                   "actor_rollout_ref.rollout.n=2") == 0
    out = capsys.readouterr().out
    assert "max_assistant_turns = 5" in out and "\nn = 2\n" in out  # the command line's n


def test_a_hydra_file_built_on_other_defaults_is_refused_naming_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "recipe.yaml").write_text("defaults:\n  - ppo_megatron_trainer\n  - _self_\n")
    with pytest.raises(SystemExit) as exit_:
        dry_run(tmp_path, f"--config-path={tmp_path}", "--config-name=recipe")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "defaults: ['ppo_megatron_trainer']: only verl's ppo_trainer" in err
    with pytest.raises(SystemExit):
        dry_run(tmp_path, f"--config-path={tmp_path}", "--config-name=absent")
    assert "absent.yaml: --config-name: cannot read it" in capsys.readouterr().err
