"""The SFT trainer: the data order is a function of the step; a step's loss is the token
mean of the NLL over the batch's loss tokens whatever the micro-batching; a resumed run ends
with the weights of an uninterrupted one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from relay.configs import CONFIG_DIR
from relay.configs.sft_schema import load_sft_config
from relay.learner import sft
from relay.learner.model import load_sharded
from relay.learner.sft_data import collate_examples, load_examples
from relay.learner.tiny_model.tokenizer import build_tokenizer
from relay.learner.ulysses import learner_parallelism

TRAIN = CONFIG_DIR / "data" / "arithmetic-sft-train.jsonl"
VAL = CONFIG_DIR / "data" / "arithmetic-sft-val.jsonl"


def config_for(model_dir: Path, out: Path, *extra: str):
    return load_sft_config(None, [
        f"data.train_files={TRAIN}", f"data.val_files={VAL}", "data.prompt_key=question",
        "data.response_key=answer", f"model.partial_pretrain={model_dir}",
        f"trainer.default_local_dir={out}", "data.train_batch_size=16",
        "data.micro_batch_size_per_gpu=4", "optim.lr=3e-3", "trainer.device=cpu", *extra])


def test_each_epoch_visits_distinct_rows_in_a_seeded_order() -> None:
    epoch = [sft.batch_rows(step, 10, 3, seed=1) for step in (1, 2, 3)]
    assert len({row for rows in epoch for row in rows}) == 9  # the 10th row is dropped
    assert sft.batch_rows(4, 10, 3, seed=1) != epoch[0]  # epoch 2: another order
    assert sft.batch_rows(2, 10, 3, seed=1) == epoch[1]  # a function of the step
    with pytest.raises(ValueError, match="data.train_batch_size = 11 is more than the 10"):
        sft.steps_per_epoch(10, 11)


@torch.no_grad()
def plain_token_mean_nll(model_dir: Path, batch) -> float:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logprobs = torch.log_softmax(logits[:, :-1].double(), -1).gather(
        -1, batch.input_ids[:, 1:, None])[..., 0]
    mask = batch.response_mask.double()
    return float(-(logprobs * mask).sum() / mask.sum())


@pytest.mark.parametrize("extra", [["data.micro_batch_size_per_gpu=16"],
                                   ["data.micro_batch_size_per_gpu=3"],
                                   ["data.use_dynamic_bsz=true",
                                    "data.max_token_len_per_gpu=64"],
                                   ["use_remove_padding=true"]])
def test_the_loss_is_the_token_mean_nll_of_the_batch(random_model_dir: Path, tmp_path: Path,
                                                     one_rank_group, extra) -> None:
    config = config_for(random_model_dir, tmp_path, *extra)
    examples = load_examples([str(TRAIN)], build_tokenizer(), config.data)[:16]
    want = plain_token_mean_nll(random_model_dir, collate_examples(examples, 0))
    model = load_sharded(str(random_model_dir), compute_dtype=torch.float32,
                         device=torch.device("cpu"))
    parallelism = learner_parallelism(torch.device("cpu"), 1, packed=config.use_remove_padding)
    trainer = sft.SftTrainer(config, model, torch.device("cpu"), total=4,
                             parallelism=parallelism)
    assert trainer.validate(examples, 0) == pytest.approx(want, rel=1e-5)
    metrics = trainer.train_step(examples, 0)
    assert metrics["train/loss"] == pytest.approx(want, rel=1e-5)
    assert metrics["train/tokens"] == float(collate_examples(examples, 0).response_mask.sum())


def test_a_resumed_run_ends_with_the_uninterrupted_weights(random_model_dir: Path,
                                                           tmp_path: Path, caplog) -> None:
    out = tmp_path / "out"
    config = config_for(random_model_dir, out, "trainer.total_training_steps=6",
                        "trainer.save_freq=3", "trainer.test_freq=3")
    sft.write_resolved(config)
    sft.run(config)
    uninterrupted = load_file(out / "final" / "model.safetensors")
    assert sorted(p.name for p in out.glob("global_step_*")) == ["global_step_3",
                                                                 "global_step_6"]
    # as if killed after step 3's checkpoint: its later files never written
    shutil.rmtree(out / "global_step_6")
    shutil.rmtree(out / "final")
    with caplog.at_level("INFO", logger="relay.sft"):
        sft.run(config)
    assert f"resuming from {out / 'global_step_3'} at step 3 of 6" in caplog.text
    resumed = load_file(out / "final" / "model.safetensors")
    worst = max(float((uninterrupted[k] - resumed[k]).abs().max()) for k in uninterrupted)
    assert worst <= 1e-6, worst  # tests/e2e/test_resume.py's tolerance
    moved = load_file(random_model_dir / "model.safetensors")
    assert all(not torch.equal(moved[k], resumed[k]) for k in moved)
    meta = json.loads((out / "global_step_6" / "meta.json").read_text())
    assert meta["step"] == 6 and meta["world_size"] == 1
    final = AutoModelForCausalLM.from_pretrained(out / "final")  # a model.path
    assert final.config.vocab_size == len(build_tokenizer())
    assert (out / "final" / "tokenizer_config.json").is_file()


def test_resume_mode_disable_starts_afresh(random_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "global_step_2").mkdir(parents=True)
    (out / "global_step_2" / "meta.json").write_text("{}")
    assert sft.resume_point(config_for(random_model_dir, out), out) == out / "global_step_2"
    config = config_for(random_model_dir, out, "trainer.resume_mode=disable")
    assert sft.resume_point(config, out) is None


def test_lora_trains_adapters_alone_and_writes_the_merged_model(random_model_dir: Path,
                                                               tmp_path: Path) -> None:
    from peft import PeftModel

    out = tmp_path / "lora"
    config = config_for(random_model_dir, out, "trainer.total_training_steps=4",
                        "trainer.save_freq=2", "model.lora_rank=4", "model.lora_alpha=8",
                        "model.target_modules=[q_proj,v_proj]")
    sft.write_resolved(config)
    sft.run(config)
    uninterrupted = load_file(out / "final" / "model.safetensors")
    base = load_file(random_model_dir / "model.safetensors")
    adapted = {k for k in base if ".q_proj." in k or ".v_proj." in k}
    assert adapted and all(not torch.equal(uninterrupted[k], base[k]) for k in adapted)
    assert all(torch.equal(uninterrupted[k], base[k]) for k in base.keys() - adapted)
    checkpoint = out / "global_step_4"
    merged = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32),
        checkpoint / "adapter").merge_and_unload().state_dict()
    assert max(float((merged[k] - uninterrupted[k]).abs().max()) for k in adapted) <= 1e-6
    # dcp/ holds the adapters alone; a resume reads the base from model.partial_pretrain
    shutil.rmtree(checkpoint)
    shutil.rmtree(out / "final")
    sft.run(config)
    resumed = load_file(out / "final" / "model.safetensors")
    assert max(float((resumed[k] - uninterrupted[k]).abs().max()) for k in base) <= 1e-6
