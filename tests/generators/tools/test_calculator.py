"""The calculator: Python's arithmetic on a syntax-tree walk, with bounds, and nothing else."""

from __future__ import annotations

import asyncio

import pytest

from relay.generators.tools.calculator import (
    MAX_EXPRESSION_CHARS,
    CalculatorError,
    CalculatorTool,
    evaluate,
    format_number,
    reply_to,
)


@pytest.mark.parametrize("expression,value", [
    ("1 + 2 * 3", 7), ("(1 + 2) * 3", 9), ("7 / 2", 3.5), ("7 // 2", 3), ("-7 // 2", -4),
    ("7 % 3", 1), ("-7 % 3", 2), ("2 ** 10", 1024), ("2 ** -2", 0.25), ("-2 ** 2", -4),
    ("(-2) ** 2", 4), ("--3", 3), ("+4", 4), ("1.5 * 4", 6.0), (" 12345678 * 87654321 ",
                                                                 1082152022374638),
    ("2 ** 3 ** 2", 512), ("((((1))))", 1), ("10 - 2 - 3", 5), ("1e3 + 1", 1001.0),
])
def test_arithmetic_follows_python(expression: str, value: float) -> None:
    result = evaluate(expression)
    assert result == value and type(result) is type(value)


@pytest.mark.parametrize("expression,message", [
    ("__import__('os').system('echo hi')", "a Call expression is not allowed"),
    ("x + 1", "the name 'x' is not allowed"),
    ("'a' * 3", "the constant 'a' is not allowed"),
    ("2 ^ 3", "operator ^ (use ** for a power) is not supported"),
    ("1 << 40", "operator << is not supported"),
    ("True + 1", "the constant True is not allowed"),
    ("1j * 2", "the constant 1j is not allowed"),
    ("[1, 2]", "a List expression is not allowed"),
    ("1 < 2", "a Compare expression is not allowed"),
    ("1 / 0", "division by zero"), ("5 // 0", "division by zero"), ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("2 ** 1001", "exponent 1001 is beyond ±1000"),
    ("10 ** 999 * 10 ** 999 * 10 ** 999 * 10 ** 999 * 10 ** 999",
     "result would have more than 4096 bits"),
    ("999 ** 999", "result would have more than 4096 bits"),
    ("10.0 ** 400", "result is too large"),
    ("(-8) ** 0.5", "result is a complex number"),
    ("1 +", "not an arithmetic expression"),
    ("", "not an arithmetic expression"),
    ("1" * (MAX_EXPRESSION_CHARS + 1), "characters, over"),
    ("-" * 990 + "1", "nested too deeply"),
])
def test_anything_else_is_refused_with_the_reason(expression: str, message: str) -> None:
    with pytest.raises(CalculatorError, match=message.replace("*", r"\*").replace("^", r"\^")
                       .replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        evaluate(expression)


def test_numbers_are_printed_exactly() -> None:
    assert format_number(2 ** 100) == "1267650600228229401496703205376"
    assert format_number(0.1 + 0.2) == "0.30000000000000004"
    assert format_number(3.0) == "3.0"


def test_the_tool_answers_with_the_value_and_raises_for_a_bad_call() -> None:
    tool = CalculatorTool({"type": "native"}, None)
    assert tool.name == "calculator"
    assert asyncio.run(tool.execute("i", {"expression": "(12 + 7) * 3"})) == ("57", 0.0, {})
    assert asyncio.run(tool.execute("i", {"expression": 12})) == ("12", 0.0, {})
    with pytest.raises(CalculatorError, match="missing argument 'expression'"):
        asyncio.run(tool.execute("i", {"expr": "1"}))


@pytest.mark.parametrize(("text", "expected"), [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "47*385"}}</tool_call>',
     "18095"),
    ("<answer>5</answer>", None),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "7 / 2"}}</tool_call>', "3.5"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "x * 2"}}</tool_call>',
     "Error: tool 'calculator' raised CalculatorError: the name 'x' is not allowed: only "
     "numbers, + - * / // % **, unary minus and parentheses"),
    ('<tool_call>{"name": "search", "arguments": {"q": "1"}}</tool_call>',
     "Error: unknown tool 'search'; the tools are calculator"),
])
def test_reply_to_answers_a_turn_as_the_loops_call_runner_would(text, expected) -> None:
    assert reply_to(text) == expected


def test_reply_to_a_malformed_call_is_an_error_message() -> None:
    assert reply_to("<tool_call>{not json</tool_call>").startswith("Error: malformed tool call:")
