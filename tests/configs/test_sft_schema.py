"""The SFT config: verl's SFT keys from YAML, TOML or the command line alone; every
problem a ``ConfigError`` naming its source and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.configs.loader import ConfigError
from relay.configs.sft_schema import load_sft_config

VERL_YAML = """
data:
  train_batch_size: 64
  micro_batch_size_per_gpu: 4
  train_files: data/train.parquet
  val_files: data/test.parquet
  prompt_key: question
  response_key: answer
  prompt_dict_keys: ['question']
  response_dict_keys: ['answer']
  multiturn:
    enable: false
    messages_key: messages
  max_length: 1024
  truncation: error
model:
  partial_pretrain: Qwen/Qwen2.5-0.5B-Instruct
  enable_gradient_checkpointing: true
optim:
  lr: 1e-4
  betas: [0.9, 0.95]
  weight_decay: 0.01
  warmup_steps_ratio: 0.1
  clip_grad: 1.0
  lr_scheduler: cosine
ulysses_sequence_parallel_size: 1
use_remove_padding: true
trainer:
  default_local_dir: out
  project_name: gsm8k-sft
  experiment_name: test
  total_epochs: 2
  logger: [console]
  seed: 1
  save_freq: 10
  test_freq: 5
"""


def test_a_verl_yaml_loads_with_overrides(tmp_path: Path) -> None:
    path = tmp_path / "sft.yaml"
    path.write_text(VERL_YAML)
    assert load_sft_config(path).optim.lr == 1e-4  # YAML 1.1 would read "1e-4" as text
    config = load_sft_config(path, ["optim.lr=2e-5", "data.truncation=left",
                                    "+trainer.total_training_steps=7"])
    assert config.data.train_files == str(tmp_path / "data" / "train.parquet")
    assert config.model.partial_pretrain == "Qwen/Qwen2.5-0.5B-Instruct"  # a hub ID, kept
    assert config.optim.lr == 2e-5 and config.data.truncation == "left"
    assert config.trainer.total_training_steps == 7
    assert config.trainer.output_dir() == tmp_path / "out"
    assert config.use_remove_padding and config.model.enable_gradient_checkpointing
    assert config.data.prompt_dict_keys == ["question"]
    optim = config.optim.as_optim()
    assert (optim.lr_warmup_steps_ratio, optim.warmup_style, optim.betas) == \
        (0.1, "cosine", [0.9, 0.95])


def test_the_command_line_alone_is_a_config(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = load_sft_config(None, ["data.train_files=t.jsonl", "model.partial_pretrain=m"])
    assert config.data.train_files == str(tmp_path / "t.jsonl")
    assert config.trainer.output_dir() == Path("checkpoints/relay-sft/sft")  # verl's default


@pytest.mark.parametrize("overrides, message", [
    (["data.prompt_kye=q"], "command line: data.prompt_kye: unknown key; did you mean "
                            "'data.prompt_key'?"),
    (["data.truncation=middle"], "command line: data.truncation: expected one of 'error', "
                                 "'left', 'right', got 'middle'"),
    (["optim.lr=-1"], "command line: optim.lr: expected"),
    (["trainer.resume_mode=resume_path"], "trainer.resume_from_path: must be set"),
    (["trainer.save_freq=0"], "trainer.save_freq: 0: use -1"),
])
def test_a_bad_key_or_value_is_named(overrides: list[str], message: str) -> None:
    base = ["data.train_files=t.jsonl", "model.partial_pretrain=m"]
    with pytest.raises(ConfigError, match=message.replace("?", r"\?")):
        load_sft_config(None, base + overrides)


def test_a_file_error_names_the_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "sft.toml"
    path.write_text('[data]\ntrain_files = "t.jsonl"\nmicro_batch_size = 4\n'
                    '[model]\npartial_pretrain = "m"\n')
    with pytest.raises(ConfigError, match=f"{path}: data.micro_batch_size: unknown key"):
        load_sft_config(path)
    missing = tmp_path / "nomodel.yaml"
    missing.write_text("data:\n  train_files: t.jsonl\n")
    with pytest.raises(ConfigError, match=f"{missing}: model: missing required key"):
        load_sft_config(missing)
    interpolated = tmp_path / "verl.yaml"
    interpolated.write_text(VERL_YAML.replace("default_local_dir: out",
                                              "default_local_dir: ckpt/${trainer.project_name}"))
    with pytest.raises(ConfigError, match="trainer.default_local_dir: .*interpolation"):
        load_sft_config(interpolated)
