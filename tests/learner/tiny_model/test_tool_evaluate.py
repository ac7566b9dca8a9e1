"""The tool-using model's evaluator: the episode loop over ``generate``, with a scripted model
whose every turn is known, so each rate has a hand-computed value."""

from __future__ import annotations

import re

import msgspec
import pytest
import torch

from relay.algorithms.tasks import arithmetic_tools
from relay.algorithms.tasks.arithmetic_tools import Problem
from relay.configs.prompt_data import PromptRow
from relay.learner.tiny_model.evaluate import GREEDY
from relay.learner.tiny_model.tokenizer import build_tools_tokenizer
from relay.learner.tiny_model.tool_evaluate import _Measure
from relay.learner.tiny_model.tool_warm_start import encode_episode


class ScriptedModel:
    """Calls the calculator when a's last digit is even, else guesses 1; after a tool
    message, answers its content; with ``answer_after_tool=False`` it calls again instead."""

    def __init__(self, tokenizer, answer_after_tool: bool = True) -> None:
        self.tokenizer = tokenizer
        self.answer_after_tool = answer_after_tool
        self.inputs: list[list[int]] = []

    def generate(self, input_ids, attention_mask, max_new_tokens, pad_token_id, eos_token_id,
                 **decoding):
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
            ids = [t for t, m in zip(ids, mask, strict=True) if m]
            self.inputs.append(ids)
            text = self.tokenizer.decode(ids)
            a, b = map(int, re.search(r"What is (\d+) \* (\d+)\?", text).groups())
            tool = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", text)
            if tool and self.answer_after_tool:
                reply = f"<answer>{tool[-1]}</answer>"
            elif a % 2 == 0 or tool:
                reply = Problem(a, b).tool_call
            else:
                reply = "<answer>1</answer>"
            new = self.tokenizer.encode(reply, add_special_tokens=False) + [eos_token_id]
            rows.append(new + [pad_token_id] * (max_new_tokens - len(new)))
        return torch.cat([input_ids, torch.tensor(rows)], dim=1)


def calculator(text: str) -> str | None:
    match = re.search(r'"expression": "(\d+) \* (\d+)"', text)
    return None if match is None else str(int(match[1]) * int(match[2]))


@pytest.fixture(scope="module")
def tokenizer():
    return build_tools_tokenizer()


def _rows(*problems: Problem) -> list[PromptRow]:
    return [msgspec.convert(arithmetic_tools.verl_row(p, "test", i), PromptRow)
            for i, p in enumerate(problems)]


def test_rates_with_the_tool_executed_and_without(tokenizer):
    rows = _rows(Problem(12, 34), Problem(13, 34), Problem(14, 34), Problem(15, 34))
    model = ScriptedModel(tokenizer)
    result = _Measure(model, tokenizer, calculator, max_turns=2, batch_size=3)(
        rows, GREEDY, samples=2, seed=0)
    assert (result.samples, result.tool_call_rate) == (2, 0.5)
    assert result.accuracy == 0.5 and result.accuracy_when_called == 1.0
    assert result.accuracy_without_tools == 0.0


def test_the_second_turn_continues_the_episode_exactly_as_the_warm_start_built_it(tokenizer):
    problem = Problem(12, 34)
    model = ScriptedModel(tokenizer)
    _Measure(model, tokenizer, calculator, max_turns=2, batch_size=8)(
        _rows(problem), GREEDY, samples=1, seed=0)
    episode = encode_episode(tokenizer, problem, use_tool=True)
    answer = len(tokenizer.encode(problem.response, add_special_tokens=False)) + 1
    assert model.inputs[-1] == episode.input_ids[:-answer]


def test_max_turns_ends_the_episode_and_a_call_without_answer_scores_zero(tokenizer):
    model = ScriptedModel(tokenizer, answer_after_tool=False)
    measure = _Measure(model, tokenizer, calculator, max_turns=2, batch_size=8)
    result = measure(_rows(Problem(12, 34)), GREEDY, samples=1, seed=0)
    assert len(model.inputs) == 2  # two turns, the second's call not executed
    assert (result.tool_call_rate, result.accuracy) == (1.0, 0.0)
    one_turn = _Measure(ScriptedModel(tokenizer), tokenizer, calculator, max_turns=1,
                        batch_size=8)(_rows(Problem(12, 34)), GREEDY, samples=1, seed=0)
    assert (one_turn.tool_call_rate, one_turn.accuracy) == (1.0, 0.0)
