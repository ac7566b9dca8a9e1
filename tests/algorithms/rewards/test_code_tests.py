"""Code ground truths in the APPS / PrimeIntellect / LiveCodeBench / HumanEval forms."""

from __future__ import annotations

import json

import pytest

from relay.algorithms.rewards.code_tests import (
    BadGroundTruth,
    Case,
    CheckProgram,
    CodeTests,
    parse_check,
    parse_tests,
)


def test_stdin_tests_from_json_with_lists_of_lines_joined() -> None:
    truth = json.dumps({"inputs": ["1 2\n", ["3", "4"]], "outputs": ["3\n", ["7", ""]]})
    assert parse_tests(truth) == CodeTests(
        fn_name=None, cases=[Case("1 2\n", "3\n"), Case("3\n4", "7\n")])


def test_call_tests_read_argument_lists_and_json_lines_and_decode_json_outputs() -> None:
    truth = {"fn_name": "f", "inputs": [[1, [2]], "[1, 2]\n\"x\"\n", ""],
             "outputs": [[3], "[1, 2]", "not json"]}
    assert parse_tests(truth) == CodeTests(fn_name="f", cases=[
        Case([1, [2]], [3]), Case([[1, 2], "x"], [1, 2]), Case([], "not json")])


def test_an_empty_fn_name_means_stdin_style() -> None:
    assert parse_tests({"fn_name": "", "inputs": ["1"], "outputs": ["1"]}).fn_name is None


@pytest.mark.parametrize(("truth", "message"), [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must hold tests with 'input' and 'output'"),
    ("3", "must be a dict"),
    ({"inputs": ["1"]}, "needs lists 'inputs' and 'outputs'"),
    ({"inputs": ["1", "2"], "outputs": ["1"]}, "2 inputs but 1 outputs"),
    ({"inputs": [], "outputs": []}, "no tests"),
    ({"inputs": [1], "outputs": ["1"]}, r"inputs\[0\] must be a string"),
    ({"fn_name": "not an identifier", "inputs": [[]], "outputs": [1]}, "fn_name"),
    ({"fn_name": "f", "inputs": ["{bad"], "outputs": [1]}, r"inputs\[0\] is not JSON"),
    ({"fn_name": "f", "inputs": [3], "outputs": [1]}, r"inputs\[0\] must be an argument list"),
])
def test_a_malformed_ground_truth_is_refused_naming_the_problem(truth: object,
                                                                message: str) -> None:
    with pytest.raises(BadGroundTruth, match=message):
        parse_tests(truth)


def test_humaneval_check_program() -> None:
    truth = {"test": "def check(candidate):\n    assert candidate(1) == 2\n",
             "entry_point": "inc", "prompt": "def inc(x):\n    \"\"\"x + 1\"\"\"\n"}
    assert parse_check(json.dumps(truth)) == CheckProgram(**truth)
    assert parse_check({**truth, "prompt": None}).prompt == ""


@pytest.mark.parametrize(("truth", "message"), [
    ({"test": "assert True", "entry_point": "f"}, "check\\(candidate\\)"),
    ({"test": "def check(c): pass", "entry_point": "1f"}, "entry_point"),
    ({"test": "def check(c): pass", "entry_point": "f", "prompt": 3}, "prompt"),
])
def test_a_malformed_check_program_is_refused(truth: dict[str, object], message: str) -> None:
    with pytest.raises(BadGroundTruth, match=message):
        parse_check(truth)


def test_a_list_of_tests_as_deepcoder_stores_them() -> None:
    stdin = [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]
    assert parse_tests(json.dumps(stdin)) == CodeTests(None, [Case("1 2\n", "3\n")])
    calls = [{"input": "[1, 2]", "output": "3", "fn_name": "add"},
             {"input": [4, 5], "output": 9, "fn_name": "add"}]
    assert parse_tests(calls) == CodeTests("add", [Case([[1, 2]], 3), Case([4, 5], 9)])
    with pytest.raises(BadGroundTruth, match="different functions"):
        parse_tests([calls[0], {**calls[1], "fn_name": "sub"}])
    with pytest.raises(BadGroundTruth, match="tests with 'input' and 'output'"):
        parse_tests([{"inputs": ["1"]}])
