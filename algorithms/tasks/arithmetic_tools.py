"""The agentic arithmetic task: products a tiny model cannot compute in its head but can
get right by calling a calculator tool.

A problem is ``a * b`` with each operand's digit count drawn uniformly from
``MIN_DIGITS..MAX_DIGITS`` (2-3 digits: "What is 47 * 385?", answers of 3 to 6 digits).
Guessing a product digit by digit is mostly wrong; one calculator call gets it right. So
held-out accuracy measures how often the policy takes the tool route, which is what RL on
this task should raise.

A tool-using solution is two assistant turns around one tool message::

    assistant: <tool_call>{"name": "calculator",
                "arguments": {"expression": "47 * 385"}}</tool_call>
    tool:      18095
    assistant: <answer>18095</answer>

in the hermes format that ``relay.generators.tools.parser`` reads; the tool message is the
text ``relay.generators.tools.calculator.CalculatorTool`` returns for an integer product
(its decimal string). A direct solution is one turn, ``<answer>N</answer>``. Both end in
``<answer>N</answer>``, which ``relay.algorithms.rewards.arithmetic`` scores (the data source
is routed to it), also when it reads the whole episode's text.

Train and test problems are disjoint by a stable hash of the problem (``split_of``), as in
``relay.algorithms.tasks.arithmetic``. This module knows the task's text and nothing of
tokenizers, models, tools' code or files.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from relay.algorithms.tasks.arithmetic import format_answer

DATA_SOURCE = "relay/arithmetic-tools"
MIN_DIGITS = 2
MAX_DIGITS = 3
TEST_BUCKETS = 1  # out of SPLIT_BUCKETS: a tenth of all problems is reserved for test
SPLIT_BUCKETS = 10
TOOL_NAME = "calculator"

Split = Literal["train", "test"]


@dataclass(frozen=True)
class Problem:
    """One product ``a * b``."""

    a: int
    b: int

    @property
    def answer(self) -> int:
        return self.a * self.b

    @property
    def question(self) -> str:
        """The user message, e.g. ``What is 47 * 385?``."""
        return f"What is {self.expression}?"

    @property
    def expression(self) -> str:
        """The calculator's argument, e.g. ``47 * 385``."""
        return f"{self.a} * {self.b}"

    @property
    def tool_call(self) -> str:
        """The first turn of the tool route: one hermes ``<tool_call>`` of the calculator."""
        return tool_call_text(self.expression)

    @property
    def tool_result(self) -> str:
        """The tool message's content: the calculator's text for the product."""
        return str(self.answer)

    @property
    def response(self) -> str:
        """The final answer in the verifier's format, e.g. ``<answer>18095</answer>``."""
        return format_answer(self.answer)


def tool_call_text(expression: str) -> str:
    """A hermes tool call of the calculator with ``expression``, as verl's hermes format
    writes it: ``<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}``
    ``</tool_call>`` (one line, no space between the JSON and the tags)."""
    call = {"name": TOOL_NAME, "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def split_of(problem: Problem) -> Split:
    """The split a problem belongs to, from a stable hash of its text (seed-independent)."""
    digest = hashlib.blake2b(f"{problem.a}*{problem.b}".encode(), digest_size=8)
    bucket = int.from_bytes(digest.digest(), "big") % SPLIT_BUCKETS
    return "test" if bucket < TEST_BUCKETS else "train"


def iter_problems(seed: int, split: Split) -> Iterator[Problem]:
    """An endless, seeded stream of problems of one split (repeats are possible)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")
    rng = random.Random(f"{DATA_SOURCE}/{split}/{seed}")
    while True:
        problem = Problem(_operand(rng), _operand(rng))
        if split_of(problem) == split:
            yield problem


def sample_problems(seed: int, count: int, split: Split) -> list[Problem]:
    """``count`` distinct problems of one split, in the order the seeded stream draws them."""
    seen: dict[Problem, None] = {}  # an ordered set
    stream = iter_problems(seed, split)
    while len(seen) < count:
        seen.setdefault(next(stream))
    return list(seen)


def verl_row(problem: Problem, split: Split, index: int) -> dict[str, Any]:
    """The problem as a prompt row in verl's schema (``relay.configs.prompt_data`` validates it)."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": problem.question}],
        "reward_model": {"style": "rule", "ground_truth": str(problem.answer)},
        "extra_info": {"split": split, "index": index},
    }


def _operand(rng: random.Random) -> int:
    digits = rng.randint(MIN_DIGITS, MAX_DIGITS)
    return rng.randint(10 ** (digits - 1), 10**digits - 1)
