"""A calculator tool: arithmetic expressions evaluated by walking their syntax tree.

The grammar is numbers (int or float literals), ``+ - * / // % **``, unary ``-`` and
``+``, and parentheses, with Python's semantics (``7 / 2`` is ``3.5``, ``7 // 2`` is 3).
Nothing is evaluated with ``eval``: any other node (a name, a call, ``^``, a string) is
refused, naming it. Bounds keep a model from stalling the generator:

- an expression of at most ``MAX_EXPRESSION_CHARS`` characters;
- ``|exponent| <= MAX_EXPONENT`` for ``**``;
- an integer result (or operand product) of at most ``MAX_INT_BITS`` bits, checked
  *before* the multiplication or power is computed: bits(a * b) <= bits(a) + bits(b) and
  bits(a ** e) <= bits(a) * e;
- a finite float (overflow is an error, not ``inf``).
"""

from __future__ import annotations

import ast
import asyncio
import math
import operator
from collections.abc import Callable
from typing import Any

from relay.generators.tools.base import BaseTool, ExecuteResult
from relay.generators.tools.calls import run_calls
from relay.generators.tools.parser import parse_tool_calls
from relay.generators.tools.schema import FunctionParameters, FunctionSchema, ToolSchema
from relay.generators.tools.session import ToolSession

MAX_EXPRESSION_CHARS = 1000
MAX_EXPONENT = 1000
MAX_INT_BITS = 4096

Number = int | float
_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_SYMBOL = {ast.BitXor: "^ (use ** for a power)", ast.BitAnd: "&", ast.BitOr: "|",
           ast.LShift: "<<", ast.RShift: ">>", ast.MatMult: "@"}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message says why."""


def evaluate(expression: str) -> Number:
    """The value of an arithmetic ``expression`` (module doc), or ``CalculatorError``."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression is {len(expression)} characters, over "
                              f"{MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise CalculatorError(f"not an arithmetic expression: {expression.strip()!r}") from exc
    try:
        return _value(tree.body)
    except RecursionError as exc:
        raise CalculatorError("expression is nested too deeply") from exc


def _value(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _value(node.operand)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp):
        op = _BINARY.get(type(node.op))
        if op is None:
            raise CalculatorError(f"operator {_SYMBOL.get(type(node.op), type(node.op).__name__)}"
                                  " is not supported")
        left, right = _value(node.left), _value(node.right)
        _check_size(node.op, left, right)
        try:
            result = op(left, right)
        except ZeroDivisionError as exc:
            raise CalculatorError("division by zero") from exc
        except OverflowError as exc:
            raise CalculatorError("result is too large") from exc
        if isinstance(result, complex):
            raise CalculatorError("result is a complex number (a negative number to a "
                                  "fractional power)")
        if isinstance(result, float) and not math.isfinite(result):
            raise CalculatorError("result is too large")
        return result
    raise CalculatorError(f"{_describe(node)} is not allowed: only numbers, + - * / // % **, "
                          "unary minus and parentheses")


def _check_size(op: ast.operator, left: Number, right: Number) -> None:
    """Refuse a product or power whose integer result would pass ``MAX_INT_BITS``."""
    if isinstance(op, ast.Pow):
        if abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is beyond ±{MAX_EXPONENT}")
        if isinstance(left, int) and isinstance(right, int) and right > 0 \
                and left.bit_length() * right > MAX_INT_BITS:
            raise CalculatorError(f"result would have more than {MAX_INT_BITS} bits")
    elif isinstance(op, ast.Mult) and isinstance(left, int) and isinstance(right, int) \
            and left.bit_length() + right.bit_length() > MAX_INT_BITS + 1:
        raise CalculatorError(f"result would have more than {MAX_INT_BITS} bits")


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return f"the name {node.id!r}"
    if isinstance(node, ast.Constant):
        return f"the constant {node.value!r}"
    return f"a {type(node).__name__} expression"


def format_number(value: Number) -> str:
    """An int exactly; a float as Python's shortest round-trip form (``3.5``, ``3.0``)."""
    return str(value) if isinstance(value, int) else repr(value)


class CalculatorTool(BaseTool):
    """``calculator(expression)``: the expression's value as text. A refused or failing
    expression raises ``CalculatorError``, which the call runner reports to the model as an
    error and counts as a failed call."""

    default_schema = ToolSchema(function=FunctionSchema(
        name="calculator",
        description="Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
        parameters=FunctionParameters(
            properties={"expression": {"type": "string",
                                       "description": "The expression, e.g. (12 + 7) * 3"}},
            required=["expression"])))

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> ExecuteResult:
        expression = parameters.get("expression")
        if isinstance(expression, (int, float)) and not isinstance(expression, bool):
            expression = str(expression)
        if not isinstance(expression, str):
            raise CalculatorError("missing argument 'expression' (a string)")
        return format_number(evaluate(expression)), 0.0, {}


def reply_to(text: str) -> str | None:
    """The tool message the first call of an assistant turn ``text`` gets when the
    calculator is the only tool, exactly as the multi-turn loop's call runner writes it (the
    value, or ``Error: ...``); None when the turn calls nothing. Loops outside the
    generators use it: the tiny tool model's build evaluates with it."""
    calls = parse_tool_calls(text, "hermes").calls
    if not calls:
        return None
    tools = {"calculator": CalculatorTool({}, None)}
    (result,) = asyncio.run(run_calls(ToolSession(tools), calls[:1]))
    return result.message["content"]
