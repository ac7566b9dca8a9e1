"""The tool-using variant's warm start: episodes as the generators build them, loss only on
the assistant's tokens, the route mix, and that training learns."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from relay.algorithms.tasks.arithmetic_tools import Problem
from relay.configs import CONFIG_DIR
from relay.generators.tools.loader import load_tools
from relay.learner.tiny_model.tokenizer import build_tools_tokenizer
from relay.learner.tiny_model.tool_warm_start import (
    ToolWarmStartConfig,
    collate,
    encode_episode,
    tool_warm_start,
)
from relay.learner.tiny_model.warm_start import IGNORE_INDEX, WarmStartConfig


@pytest.fixture(scope="module")
def tokenizer():
    return build_tools_tokenizer()


def _masked_text(tokenizer, episode, value: bool) -> list[str]:
    """The runs of response tokens whose mask is ``value``, decoded."""
    response = episode.input_ids[episode.prompt_length:]
    runs: list[list[int]] = []
    for token, flag in zip(response, episode.loss_mask, strict=True):
        if flag == value:
            if not runs or runs[-1] is None:
                runs.append([])
            runs[-1].append(token)
        elif runs and runs[-1] is not None:
            runs.append(None)
    return [tokenizer.decode(run) for run in runs if run is not None]


def test_tool_episode_reads_as_the_template_renders_it_and_masks_only_assistant_turns(tokenizer):
    problem = Problem(47, 385)
    episode = encode_episode(tokenizer, problem, use_tool=True)
    conversation = [{"role": "user", "content": problem.question},
                    {"role": "assistant", "content": problem.tool_call},
                    {"role": "tool", "content": problem.tool_result},
                    {"role": "assistant", "content": problem.response}]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert tokenizer.decode(episode.input_ids) + "\n" == rendered
    assert len(episode.loss_mask) == len(episode.input_ids) - episode.prompt_length
    assert _masked_text(tokenizer, episode, True) == [problem.tool_call + "<|im_end|>",
                                                      problem.response + "<|im_end|>"]
    assert _masked_text(tokenizer, episode, False) == [
        "\n<|im_start|>tool\n18095<|im_end|>\n<|im_start|>assistant\n"]


def test_direct_episode_is_the_answer_alone(tokenizer):
    problem = Problem(12, 34)
    episode = encode_episode(tokenizer, problem, use_tool=False)
    assert all(episode.loss_mask)
    assert tokenizer.decode(episode.input_ids[episode.prompt_length:]) == \
        "<answer>408</answer><|im_end|>"


def test_the_calculator_schema_changes_no_token(tokenizer):
    """The generators pass the tools' schemas to the template; this one does not render them."""
    schemas = [t.tool_schema.as_dict()
               for t in load_tools(CONFIG_DIR / "tools" / "calculator.yaml").values()]
    problem = Problem(47, 385)
    assert encode_episode(tokenizer, problem, True, tools=schemas) == \
        encode_episode(tokenizer, problem, True)


def test_collate_labels_exactly_the_masked_tokens(tokenizer):
    episodes = [encode_episode(tokenizer, Problem(47, 385), True),
                encode_episode(tokenizer, Problem(12, 34), False)]
    batch = collate(episodes, tokenizer.pad_token_id)
    for row, episode in enumerate(episodes):
        mask = [False] * episode.prompt_length + episode.loss_mask
        labelled = [i for i, m in enumerate(mask) if m]
        assert (batch.labels[row] != IGNORE_INDEX).nonzero().flatten().tolist() == labelled
        assert batch.labels[row, labelled].tolist() == [episode.input_ids[i] for i in labelled]
        assert (batch.input_ids[row, len(episode.input_ids):] == tokenizer.pad_token_id).all()


def test_tool_fraction_is_checked():
    with pytest.raises(ValueError, match="tool_fraction"):
        ToolWarmStartConfig(tool_fraction=1.5)


def test_warm_start_lowers_the_loss_and_uses_both_routes(tokenizer, monkeypatch):
    routes: list[bool] = []
    import relay.learner.tiny_model.tool_warm_start as module

    real = module.encode_episode

    def spy(tokenizer, problem, use_tool, tools=None):
        routes.append(use_tool)
        return real(tokenizer, problem, use_tool, tools)

    monkeypatch.setattr(module, "encode_episode", spy)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64,
                                         intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=4))
    losses: list[float] = []
    config = ToolWarmStartConfig(optim=WarmStartConfig(steps=30, batch_size=16, warmup_steps=5),
                                 tool_fraction=0.25)
    tool_warm_start(model, tokenizer, config, on_step=lambda _, loss: losses.append(loss))
    assert sum(losses[-5:]) / 5 < 0.75 * sum(losses[:5]) / 5
    assert 0.15 < sum(routes) / len(routes) < 0.35  # 480 draws at p = 0.25
    expected = random.Random("tool-routes/0")
    assert routes == [expected.random() < 0.25 for _ in routes]
