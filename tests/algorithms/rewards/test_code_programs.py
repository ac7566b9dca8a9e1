"""Solution extraction and the programs a code reward runs (run here with plain Python)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from relay.algorithms.rewards.code_programs import (
    Extracted,
    call_program,
    call_result,
    call_stdin,
    extract_code,
    humaneval_program,
    stdio_program,
    syntax_error,
)


@pytest.mark.parametrize(("response", "extracted"), [
    ("```python\nx = 1\n```", Extracted("x = 1\n", fenced=True)),
    ("a\n```python\nx = 1\n```\nthen\n```py\ny = 2\n```\nend", Extracted("y = 2\n", True)),
    ("```\nx = 1\n```", Extracted("x = 1\n", True)),  # untagged counts as Python
    ("```python3 title\nx = 1\n```", Extracted("x = 1\n", True)),
    ("```python\nx = 1\n```\n```cpp\nint x;\n```", Extracted("x = 1\n", True)),
    ("```cpp\nint x;\n```", Extracted("", True)),  # only another language: no code
    ("cut off:\n```python\nx = 1\ny = ", Extracted("x = 1\ny = ", True)),
    ("    return x + 1\n", Extracted("    return x + 1\n", False)),  # whole text, as is
])
def test_extract_code(response: str, extracted: Extracted) -> None:
    assert extract_code(response) == extracted


def test_syntax_error_names_the_line_and_runs_nothing(tmp_path: object) -> None:
    assert syntax_error("x = 1\n") is None
    assert syntax_error("import os; os._exit(3)\n") is None  # compiled, not run
    assert syntax_error("x = (1,\n") == "SyntaxError: '(' was never closed (solution.py, line 1)"
    assert syntax_error("x = 1\0") is not None


def _run(program: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-I", "-c", program], input=stdin,
                          capture_output=True, text=True, timeout=30, check=False)


def test_a_stdio_solution_runs_as_main_with_the_prelude_and_future_imports() -> None:
    solution = ("from __future__ import annotations\n"
                "def main() -> None:\n    print(gcd(*map(int, input().split())))\n"
                "if __name__ == '__main__':\n    main()\n")
    done = _run(stdio_program(solution), "12 18\n")
    assert (done.returncode, done.stdout) == (0, "6\n"), done.stderr


@pytest.mark.parametrize("solution", [
    "def f(xs: List[int]) -> int:\n    print('noise')\n    return sum(xs)\n",
    "class Solution:\n    def f(self, xs):\n        return sum(xs)\n",
])
def test_a_call_program_reports_the_return_value_behind_the_nonce(solution: str) -> None:
    done = _run(call_program(solution, "f"), call_stdin([[1, 2, 3]], "n0nce"))
    assert done.returncode == 0, done.stderr
    assert call_result(done.stdout, "n0nce") == (True, 6)
    assert call_result(done.stdout, "other") == (False, None)


@pytest.mark.parametrize(("solution", "error"), [
    ("def g():\n    return 1\n",
     "NameError: the solution defines no function or Solution method f"),
    ("def f():\n    return {1}\n", "TypeError: f returned a value that is not JSON"),
])
def test_a_call_program_fails_with_a_reason(solution: str, error: str) -> None:
    done = _run(call_program(solution, "f"), call_stdin([], "n"))
    assert done.returncode == 1
    assert error in done.stderr.strip().splitlines()[-1]


PROMPT = 'from typing import List\n\n\ndef total(xs: List[int]) -> int:\n    """Sum."""\n'
TEST = "def check(candidate):\n    assert candidate([1, 2]) == 3\n"


@pytest.mark.parametrize(("completion", "passes"), [
    ("    return sum(xs)\n", True),  # HumanEval's form: the body continues the prompt
    ("def total(xs: List[int]) -> int:\n    return sum(xs)\n", True),  # a whole function
    ("    return 0\n", False),
])
def test_humaneval_program(completion: str, passes: bool) -> None:
    done = _run(humaneval_program(PROMPT, completion, TEST, "total"))
    assert (done.returncode == 0) is passes, done.stderr
    if not passes:
        assert "AssertionError" in done.stderr
