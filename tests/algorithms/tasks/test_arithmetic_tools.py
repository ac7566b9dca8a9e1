"""The agentic arithmetic task: problem text, tool call, seeding, split, shipped files."""

from __future__ import annotations

import asyncio
import itertools

import msgspec
import pytest

from relay.algorithms.rewards.arithmetic import compute_score
from relay.algorithms.rewards.registry import default_compute_score, family_of
from relay.algorithms.tasks import arithmetic_tools
from relay.algorithms.tasks.arithmetic_tools import Problem
from relay.configs import CONFIG_DIR
from relay.configs.prompt_data import PromptRow, load_prompt_rows
from relay.generators.tools.loader import load_tools
from relay.generators.tools.parser import parse_tool_calls


def test_problem_text_call_and_answer():
    problem = Problem(47, 385)
    assert problem.question == "What is 47 * 385?"
    assert problem.answer == 18095
    assert problem.tool_call == ('<tool_call>{"name": "calculator", "arguments": '
                                 '{"expression": "47 * 385"}}</tool_call>')
    assert problem.tool_result == "18095"
    assert problem.response == "<answer>18095</answer>"


def test_the_call_parses_and_the_calculator_returns_the_tool_result():
    problem = Problem(123, 456)
    (call,) = parse_tool_calls(problem.tool_call, "hermes").calls
    assert (call.name, call.arguments, call.error) == ("calculator",
                                                       {"expression": "123 * 456"}, "")
    calculator = load_tools(CONFIG_DIR / "tools" / "calculator.yaml")["calculator"]
    text, _, _ = asyncio.run(calculator.execute("x", call.arguments))
    assert text == problem.tool_result


def test_the_arithmetic_reward_scores_the_data_source_and_a_whole_tool_episode():
    assert family_of(arithmetic_tools.DATA_SOURCE) == "arithmetic"
    problem = Problem(47, 385)
    episode = f"{problem.tool_call}\ntool\n{problem.tool_result}\nassistant\n{problem.response}"
    truth = str(problem.answer)
    assert default_compute_score(arithmetic_tools.DATA_SOURCE, episode, truth)["score"] == 1.0
    assert compute_score(problem.tool_call, truth)["score"] == 0.0  # a call alone
    assert compute_score("<answer>18000</answer>", truth)["score"] == 0.0


def test_operands_have_two_or_three_digits_and_the_stream_is_seeded():
    problems = arithmetic_tools.sample_problems(seed=0, count=2000, split="train")
    assert {(len(str(p.a)), len(str(p.b))) for p in problems} == set(
        itertools.product((2, 3), (2, 3)))
    assert problems == arithmetic_tools.sample_problems(seed=0, count=2000, split="train")
    assert problems[:50] != arithmetic_tools.sample_problems(seed=1, count=50, split="train")


def test_train_and_test_problems_are_disjoint_whatever_the_seeds():
    train = set(arithmetic_tools.sample_problems(seed=0, count=4000, split="train"))
    test = set(arithmetic_tools.sample_problems(seed=1, count=300, split="test"))
    assert not train & test
    assert {arithmetic_tools.split_of(p) for p in test} == {"test"}
    stream = itertools.islice(arithmetic_tools.iter_problems(seed=0, split="train"), 20000)
    assert not test & set(stream)
    everything = {Problem(a, b) for a in range(10, 110) for b in range(10, 110)}
    assert 0.07 < sum(arithmetic_tools.split_of(p) == "test" for p in everything) / 10000 < 0.13


def test_an_unknown_split_is_refused():
    with pytest.raises(ValueError, match="split must be"):
        next(arithmetic_tools.iter_problems(0, "validation"))  # type: ignore[arg-type]


@pytest.mark.parametrize(("split", "count"), [("train", 4000), ("test", 300)])
def test_shipped_files_load_and_are_the_seed_0_problems(split, count):
    rows = load_prompt_rows(CONFIG_DIR / "data" / f"arithmetic-tools-{split}.jsonl")
    expected = [msgspec.convert(arithmetic_tools.verl_row(p, split, i), PromptRow)
                for i, p in enumerate(arithmetic_tools.sample_problems(0, count, split))]
    assert rows == expected
