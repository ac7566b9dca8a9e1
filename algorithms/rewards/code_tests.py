"""A code problem's tests, read from its ground truth (APPS, TACO, PrimeIntellect, LiveCodeBench).

Two forms, as a dict or its JSON string (verl's ``prime_code`` reads the same):

- stdin/stdout: ``{"inputs": [...], "outputs": [...]}``; each input is fed to the program on
  stdin, each output is the expected stdout (a list of lines is joined with newlines).
- call-based: ``{"fn_name": "f", "inputs": [...], "outputs": [...]}``; each input is the
  argument list (a list, or a string of JSON values one per line as PrimeIntellect and
  LiveCodeBench store it); each output is the return value (a JSON string is decoded).
- a list of tests, as DeepCoder stores LiveCodeBench and PrimeIntellect: ``[{"input": ...,
  "output": ..., "fn_name": "f"}, ...]`` (``fn_name`` only on call-based tests, the same on
  every test; a ``testtype`` / ``type`` field is ignored).

HumanEval's form is a check program: ``{"test": "def check(candidate): ...",
"entry_point": "f", "prompt": "def f(...):\n    \"\"\"...\"\"\"\n"}`` (``prompt`` optional).

This module only parses; a malformed ground truth is a dataset bug and raises
``BadGroundTruth`` naming what is wrong (the reward worker turns it into the sample's error).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import msgspec


class BadGroundTruth(ValueError):
    """A code problem's ground truth is not one of the forms this module reads."""


class Case(msgspec.Struct, frozen=True):
    """One test: ``given`` is the stdin text (stdin style) or the argument list (call-based);
    ``expected`` is the stdout text or the return value."""

    given: Any
    expected: Any


class CodeTests(msgspec.Struct, frozen=True):
    """A problem's tests; ``fn_name`` is None for stdin/stdout problems."""

    fn_name: str | None
    cases: list[Case]


class CheckProgram(msgspec.Struct, frozen=True):
    """HumanEval's form: ``test`` defines ``check(candidate)``, called on ``entry_point``."""

    test: str
    entry_point: str
    prompt: str = ""


def _as_mapping(ground_truth: Any) -> Mapping[str, Any]:
    if isinstance(ground_truth, (str, bytes)):
        try:
            ground_truth = json.loads(ground_truth)
        except ValueError as exc:
            raise BadGroundTruth(f"code ground truth is not valid JSON: {exc}") from None
    if not isinstance(ground_truth, Mapping):
        raise BadGroundTruth(
            f"code ground truth must be a dict (or its JSON), got {type(ground_truth).__name__}")
    return ground_truth


def _text(value: Any, what: str) -> str:
    """A stdin or stdout text: a string, or a list of lines joined with newlines."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "\n".join(value)
    raise BadGroundTruth(f"{what} must be a string or a list of strings, got {value!r:.80}")


def _arguments(value: Any, index: int) -> list[Any]:
    """An argument list: a list, or JSON values one per line."""
    if isinstance(value, list):
        return value
    if isinstance(value, str):
        try:
            return [json.loads(line) for line in value.split("\n") if line.strip()]
        except ValueError as exc:
            raise BadGroundTruth(f"inputs[{index}] is not JSON values one per line: {exc}") \
                from None
    raise BadGroundTruth(f"inputs[{index}] must be an argument list or JSON lines, "
                         f"got {type(value).__name__}")


def _return_value(value: Any) -> Any:
    """An expected return value; a string holding JSON is decoded (PrimeIntellect), any
    other string is the value itself."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _from_test_list(tests: list[Any]) -> dict[str, Any]:
    """A list of ``{"input", "output"[, "fn_name"]}`` tests as the dict form."""
    if not all(isinstance(test, Mapping) and "input" in test and "output" in test
               for test in tests):
        raise BadGroundTruth("a code ground truth list must hold tests with 'input' and "
                             "'output'")
    names = {test.get("fn_name") or None for test in tests}
    if len(names) > 1:
        raise BadGroundTruth(f"the tests name different functions: {sorted(map(str, names))}")
    return {"fn_name": names.pop() if names else None,
            "inputs": [test["input"] for test in tests],
            "outputs": [test["output"] for test in tests]}


def parse_tests(ground_truth: Any) -> CodeTests:
    """The tests of a stdin/stdout or call-based problem; raises ``BadGroundTruth``."""
    if isinstance(ground_truth, (str, bytes)):
        try:
            ground_truth = json.loads(ground_truth)
        except ValueError as exc:
            raise BadGroundTruth(f"code ground truth is not valid JSON: {exc}") from None
    if isinstance(ground_truth, list):
        ground_truth = _from_test_list(ground_truth)
    truth = _as_mapping(ground_truth)
    inputs, outputs = truth.get("inputs"), truth.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise BadGroundTruth("code ground truth needs lists 'inputs' and 'outputs' "
                             f"(keys: {', '.join(map(str, list(truth)[:10]))})")
    if len(inputs) != len(outputs):
        raise BadGroundTruth(f"code ground truth has {len(inputs)} inputs but "
                             f"{len(outputs)} outputs")
    if not inputs:
        raise BadGroundTruth("code ground truth has no tests (every response would pass)")
    fn_name = truth.get("fn_name") or None
    if fn_name is None:
        cases = [Case(_text(given, f"inputs[{i}]"), _text(expected, f"outputs[{i}]"))
                 for i, (given, expected) in enumerate(zip(inputs, outputs, strict=True))]
        return CodeTests(fn_name=None, cases=cases)
    if not isinstance(fn_name, str) or not fn_name.isidentifier():
        raise BadGroundTruth(f"fn_name must be a Python identifier, got {fn_name!r:.80}")
    cases = [Case(_arguments(given, i), _return_value(expected))
             for i, (given, expected) in enumerate(zip(inputs, outputs, strict=True))]
    return CodeTests(fn_name=fn_name, cases=cases)


def parse_check(ground_truth: Any) -> CheckProgram:
    """HumanEval's check program; raises ``BadGroundTruth``."""
    truth = _as_mapping(ground_truth)
    test, entry_point, prompt = (truth.get(key) for key in ("test", "entry_point", "prompt"))
    if not isinstance(test, str) or "def check(" not in test:
        raise BadGroundTruth("humaneval ground truth needs 'test', a program defining "
                             "check(candidate)")
    if not isinstance(entry_point, str) or not entry_point.isidentifier():
        raise BadGroundTruth(f"humaneval ground truth needs 'entry_point', a Python "
                             f"identifier, got {entry_point!r:.80}")
    if prompt is not None and not isinstance(prompt, str):
        raise BadGroundTruth(f"humaneval 'prompt' must be a string, got {type(prompt).__name__}")
    return CheckProgram(test=test, entry_point=entry_point, prompt=prompt or "")
