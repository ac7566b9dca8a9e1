"""tools/make-tiny-model.py: the calculator it runs for the tool-using variant, and the
variant's build from the command line."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from relay.algorithms.tasks.arithmetic_tools import Problem

TOOL = Path(__file__).resolve().parents[2] / "tools" / "make-tiny-model.py"


@pytest.fixture(scope="module")
def script():
    return runpy.run_path(str(TOOL))


@pytest.mark.parametrize(("text", "expected"), [
    (Problem(47, 385).tool_call, "18095"),
    ("<answer>5</answer>", None),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "7 / 2"}}</tool_call>', "3.5"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "x * 2"}}</tool_call>',
     "Error: the name 'x' is not allowed: only numbers, + - * / // % **, unary minus and "
     "parentheses"),
    ('<tool_call>{"name": "search", "arguments": {"q": "1"}}</tool_call>',
     "Error: unknown tool 'search'"),
])
def test_run_calculator_answers_a_turn_as_the_tool_would(script, text, expected):
    assert script["run_calculator"](text) == expected


def test_a_malformed_call_gets_an_error_message(script):
    assert script["run_calculator"]("<tool_call>{not json</tool_call>").startswith(
        "Error: malformed tool call:")


def test_variant_tools_builds_into_the_given_folder_and_prints_its_rates(script, tmp_path,
                                                                        capsys):
    code = script["main"](["--variant", "tools", "--out", str(tmp_path / "m"), "--steps", "2"])
    printed = capsys.readouterr()
    assert code == 1  # two steps leave the accuracy far below the band
    assert "band" in printed.err
    assert (tmp_path / "m" / "config.json").is_file()
    assert "greedy: tool-call rate" in printed.out and "without tools" in printed.out
