"""build_tiny_model and build_tools_model: loadable, deterministic Hugging Face model
directories.

The fast tests build with a few warm-start steps (seconds); the slow tests do the full
builds and check the accuracy bands the RL stage relies on.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from relay.configs.checks import BUILTIN_MODELS
from relay.learner.tiny_model.build import (
    BUILTIN_RECIPES,
    TOOLS_RECIPE_VERSION,
    build_tiny_model,
    build_tools_model,
    default_model_dir,
)
from relay.learner.tiny_model.tool_warm_start import ToolWarmStartConfig
from relay.learner.tiny_model.warm_start import WarmStartConfig

FAST = {"warm_start_steps": 20, "eval_limit": 16, "eval_k": 2}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0, **FAST)


def _weights(path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def test_directory_loads_with_auto_classes(built):
    tokenizer = AutoTokenizer.from_pretrained(built.path)
    model = AutoModelForCausalLM.from_pretrained(built.path)
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert isinstance(model, LlamaForCausalLM)
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.tie_word_embeddings
    # vLLM's CPU attention runs head_dim 32 and up; hidden 128 / 8 heads alone would give 16
    assert (model.config.head_dim, model.config.num_attention_heads) == (32, 8)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (256, 128)
    assert built.params == sum(p.numel() for p in model.parameters()) < 2_000_000
    assert (model.generation_config.eos_token_id, model.generation_config.pad_token_id) == (
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    saved = json.loads((built.path / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 + 30?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert prompt == "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n"


def test_generate_continues_left_padded_prompts(built):
    tokenizer = AutoTokenizer.from_pretrained(built.path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(built.path)
    questions = ("What is 7 + 2?", "What is 4821 - 3795?")

    def greedy(batch: list[str]) -> list[list[int]]:
        inputs = tokenizer.apply_chat_template(
            [[{"role": "user", "content": q}] for q in batch],
            add_generation_prompt=True,
            padding=True,
            return_tensors="pt",
            return_dict=True,
        )
        output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        new = output[:, inputs["input_ids"].shape[1] :]
        assert 1 <= new.shape[1] <= 8 and int(new.max()) < len(tokenizer)
        return [[t for t in row.tolist() if t != tokenizer.pad_token_id] for row in new]

    # The short prompt is left-padded in the batch; padding must not change what it generates.
    assert greedy(list(questions)) == greedy(questions[:1]) + greedy(questions[1:])


def test_report_describes_the_build(built):
    assert built.path.is_dir() and not built.path.with_name("model.partial").exists()
    assert built.warm_start_steps == 20 and math.isfinite(built.final_loss)
    assert built.eval_problems == 16 and built.k == 2
    assert 0.0 <= built.heldout_accuracy <= 1.0 and 0.0 <= built.pass_at_1 <= built.pass_at_k <= 1.0
    assert built.seconds >= built.warm_start_seconds > 0


def test_same_seed_gives_identical_weights_and_another_seed_does_not(built, tmp_path):
    again = build_tiny_model(tmp_path / "again", seed=0, **FAST)
    other = build_tiny_model(tmp_path / "other", seed=1, **FAST)
    reference, same, different = _weights(built.path), _weights(again.path), _weights(other.path)
    assert all(torch.equal(reference[name], same[name]) for name in reference)
    assert not all(torch.equal(reference[name], different[name]) for name in reference)
    assert again.heldout_accuracy == built.heldout_accuracy


def test_existing_directory_is_kept_unless_overwrite(built, tmp_path):
    with pytest.raises(FileExistsError, match="overwrite=True"):
        build_tiny_model(built.path, **FAST)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a model directory"):
        build_tiny_model(tmp_path, overwrite=True, **FAST)
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_default_build_leaves_room_for_rl(tmp_path):
    report = build_tiny_model(tmp_path / "model")
    assert report.eval_problems == 300 and report.k == 8
    assert 0.05 <= report.heldout_accuracy <= 0.60
    assert report.pass_at_k > report.heldout_accuracy + 0.05  # sampling finds more: room for RL


def _calculator(text: str) -> str | None:
    """A stand-in for the generators' calculator (the learner does not import them)."""
    match = re.search(r'"expression": "(\d+) \* (\d+)"', text)
    return None if match is None else str(int(match[1]) * int(match[2]))


def test_builtin_models_have_their_own_cache_folders(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_model_dir() == tmp_path / "relay" / "models" / "tiny-arith-r3"
    assert default_model_dir("tiny-arith-tools") == \
        tmp_path / "relay" / "models" / f"tiny-arith-tools-r{TOOLS_RECIPE_VERSION}"
    assert set(BUILTIN_RECIPES) == set(BUILTIN_MODELS)
    with pytest.raises(ValueError, match="unknown built-in model 'tiny'"):
        default_model_dir("tiny")


def test_tools_variant_builds_a_loadable_model_that_is_measured_with_its_tool(tmp_path):
    recipe = ToolWarmStartConfig(optim=WarmStartConfig(steps=5, batch_size=8))
    report = build_tools_model(tmp_path / "tools", _calculator, recipe=recipe, eval_limit=4,
                               eval_k=2)
    tokenizer = AutoTokenizer.from_pretrained(report.path)
    model = AutoModelForCausalLM.from_pretrained(report.path)
    assert "<tool_call>" in tokenizer.get_vocab() and model.config.vocab_size == len(tokenizer)
    assert report.warm_start_steps == 5 and report.params == model.num_parameters()
    assert (report.heldout.problems, report.heldout.sampled.samples) == (4, 2)
    again = build_tools_model(tmp_path / "again", _calculator, recipe=recipe, eval_limit=1,
                              eval_k=1)
    for name, tensor in _weights(report.path).items():
        assert torch.equal(tensor, _weights(again.path)[name]), name


@pytest.mark.slow
def test_tools_variant_calls_its_tool_on_a_share_that_rl_can_raise(tmp_path):
    heldout = build_tools_model(tmp_path / "tools", _calculator).heldout
    assert heldout.problems == 300
    sampled = heldout.sampled
    assert 0.15 <= sampled.tool_call_rate <= 0.35
    assert sampled.accuracy_when_called >= 0.6  # the tool route works once taken
    assert sampled.accuracy_without_tools <= 0.05  # guessing a product rarely does
    assert 0.10 <= sampled.accuracy <= 0.35
