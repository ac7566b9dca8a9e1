"""The programs a code reward runs in the sandbox, and the solution they are built from.

- ``extract_code``: the solution in a response, the last fenced Python block (as verl's
  ``prime_code``), else the whole text.
- ``stdio_program`` / ``call_program`` / ``humaneval_program``: a self-contained program
  (the solution embedded as a string literal, so no file or import path is needed), run as
  ``__main__``. Stdin and call-based solutions run after ``PRELUDE``, the imports that
  competitive-programming and LeetCode solutions assume (verl prepends a similar list).
- ``call_result``: the return value a call program reported.

A call program reads ``{"args": [...], "nonce": "..."}`` on stdin before the solution runs
and prints ``nonce + JSON(result)`` as its last line, so what the solution itself prints
cannot be taken for the result. This is bookkeeping, not a defence: the solution runs in the
same interpreter and could find the nonce; the sandbox is the isolation boundary.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

# The imports a competitive-programming or LeetCode solution may use without writing them.
PRELUDE = (
    "import bisect, collections, copy, functools, heapq, itertools, math, operator, random, "
    "re, string, sys\n"
    "from bisect import *\nfrom collections import *\nfrom functools import *\n"
    "from heapq import *\nfrom itertools import *\nfrom math import *\nfrom typing import *\n"
    "sys.setrecursionlimit(100000)\n"
)
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_OPEN_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n", re.IGNORECASE)
_PYTHON_TAGS = {"", "python", "python3", "py"}


class Extracted(msgspec.Struct, frozen=True):
    """The solution in a response; ``fenced``: it came from a fenced block, not the whole
    text (a whole text that does not compile is prose, not a syntax error)."""

    code: str
    fenced: bool


def extract_code(response: str) -> Extracted:
    """The last fenced block tagged Python (or untagged); else the text after an unclosed
    opening Python fence (a response cut at the length limit); else the whole response.
    Empty when the response holds only blocks in other languages."""
    blocks = _FENCE.findall(response)
    python = [code for tag, code in blocks if tag.lower() in _PYTHON_TAGS]
    if python:
        return Extracted(python[-1], fenced=True)
    if blocks:
        return Extracted("", fenced=True)
    opening = list(_OPEN_FENCE.finditer(response))
    if opening:
        return Extracted(response[opening[-1].end():], fenced=True)
    return Extracted(response, fenced=False)


def syntax_error(source: str, filename: str = "solution.py") -> str | None:
    """Why ``source`` does not compile, or None when it does (nothing is executed)."""
    try:
        compile(source, filename, "exec", dont_inherit=True)
    except SyntaxError as exc:
        return f"SyntaxError: {exc.msg} ({filename}, line {exc.lineno})"
    except (ValueError, RecursionError, MemoryError) as exc:  # null bytes, deep nesting
        return f"{type(exc).__name__}: {exc}"
    return None


def _run_solution(source: str, name: str) -> str:
    """Statements that run ``source`` after the prelude in a namespace whose ``__name__`` is
    ``name``, left in the variable ``_ns``."""
    return (f"_ns = {{'__name__': {name!r}, '__builtins__': __builtins__}}\n"
            f"exec({PRELUDE!r}, _ns)\n"
            f"exec(compile({source!r}, 'solution.py', 'exec', dont_inherit=True), _ns)\n")


def stdio_program(solution: str) -> str:
    """A program that runs ``solution`` as ``__main__`` on the test's stdin."""
    return _run_solution(solution, "__main__")


_CALL_HARNESS = """\
import json as _json, sys as _sys
_request = _json.loads(_sys.stdin.read())
{run}
if {fn_name!r} in _ns:
    _fn = _ns[{fn_name!r}]
elif isinstance(_ns.get('Solution'), type):
    _fn = getattr(_ns['Solution'](), {fn_name!r})
else:
    raise NameError('the solution defines no function or Solution method {fn_name}')
_result = _fn(*_request['args'])
try:
    _reply = _json.dumps(_result)
except (TypeError, ValueError) as _error:
    raise TypeError(f'{fn_name} returned a value that is not JSON: {{_error}}') from None
_sys.stdout.write('\\n' + _request['nonce'] + _reply + '\\n')
"""


def call_program(solution: str, fn_name: str) -> str:
    """A program that calls ``fn_name`` (a function, or a method of a ``Solution`` class as
    LeetCode writes it) with the arguments on stdin and prints the result."""
    return _CALL_HARNESS.format(run=_run_solution(solution, "solution"), fn_name=fn_name)


def call_stdin(args: list[Any], nonce: str) -> str:
    """The stdin of a call program."""
    return json.dumps({"args": args, "nonce": nonce})


def call_result(stdout: str, nonce: str) -> tuple[bool, Any]:
    """``(True, value)`` for the value the call program reported, ``(False, None)`` when it
    reported none."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(nonce):
            try:
                return True, json.loads(line[len(nonce):])
            except ValueError:
                return False, None
    return False, None


def defines(source: str, name: str) -> bool:
    """Whether ``source`` has a top-level ``def name(``."""
    return re.search(rf"^(?:async\s+)?def\s+{re.escape(name)}\s*\(", source, re.MULTILINE) \
        is not None


def humaneval_program(prompt: str, completion: str, test: str, entry_point: str) -> str:
    """HumanEval's program, ``prompt + completion + test + check(entry_point)``.

    A completion that defines ``entry_point`` itself (a whole function in a fenced block)
    comes after the prompt instead of continuing it: the prompt's own definition (a
    docstring-only body, valid Python) is replaced, and its imports and helpers are kept.
    """
    if defines(completion, entry_point):
        body = f"{prompt}\n\n{completion}"
    else:
        body = prompt + completion
    return f"{body}\n\n{test}\n\ncheck({entry_point})\n"
