"""The bundled arithmetic task: seeded problems, their prompt text and the target response.

A problem is ``a + b`` or ``a - b`` on non-negative integers. Each operand's digit count is
drawn independently and uniformly from ``1..MAX_DIGITS``, so difficulty varies from one
prompt to the next ("What is 7 + 2?" next to "What is 4821 - 3795?"): GRPO learns only from
prompts where some samples succeed and some fail. Subtraction puts the larger operand first,
so answers are never negative.

Train and test problems are disjoint by construction: a problem's split is a pure function
of the problem (a stable hash, see ``split_of``), so a training stream of any length never
contains a test problem, whatever the seeds.

The verifier accepts exactly ``<answer>{integer}</answer>``; the ground truth is the
integer's decimal string. A model may also answer in other styles (``ANSWER_STYLES``): the
tiny model's warm start imitates a pretrained model that answers in all of them, as base
models answer in whatever style they saw, so that RL first has to discover the verifier's
format (the early phase of R1-Zero-style training) before it sharpens the arithmetic.

This module knows the task's text and nothing of tokenizers, models or files:
``relay.configs.prompt_data`` validates and writes the rows, and
``relay.algorithms.rewards.arithmetic`` scores responses.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

DATA_SOURCE = "relay/arithmetic"
MAX_DIGITS = 4
TEST_BUCKETS = 1  # out of SPLIT_BUCKETS: a tenth of all problems is reserved for test
SPLIT_BUCKETS = 10

# How an answer may be written; only the first is what the verifier accepts.
ANSWER_STYLES = ("<answer>{}</answer>", "The answer is {}.", "{}")

Operator = Literal["+", "-"]
Split = Literal["train", "test"]


@dataclass(frozen=True)
class Problem:
    """One arithmetic problem, ``a op b``, with ``a >= b`` when ``op`` is ``-``."""

    a: int
    op: Operator
    b: int

    @property
    def answer(self) -> int:
        return self.a + self.b if self.op == "+" else self.a - self.b

    @property
    def question(self) -> str:
        """The user message, e.g. ``What is 4821 - 379?``."""
        return f"What is {self.a} {self.op} {self.b}?"

    @property
    def response(self) -> str:
        """The answer in the verifier's format, e.g. ``<answer>4442</answer>``."""
        return format_answer(self.answer)

    def response_in(self, style: int) -> str:
        """The answer in ``ANSWER_STYLES[style]``, e.g. ``The answer is 4442.``."""
        return ANSWER_STYLES[style].format(self.answer)


def format_answer(value: int) -> str:
    """The response format the reward function expects: ``<answer>{integer}</answer>``."""
    return ANSWER_STYLES[0].format(value)


def split_of(problem: Problem) -> Split:
    """The split a problem belongs to, from a stable hash of its text (seed-independent)."""
    digest = hashlib.blake2b(f"{problem.a}{problem.op}{problem.b}".encode(), digest_size=8)
    bucket = int.from_bytes(digest.digest(), "big") % SPLIT_BUCKETS
    return "test" if bucket < TEST_BUCKETS else "train"


def iter_problems(seed: int, split: Split) -> Iterator[Problem]:
    """An endless, seeded stream of problems of one split (repeats are possible)."""
    rng = random.Random(f"{DATA_SOURCE}/{split}/{seed}")
    while True:
        problem = _draw(rng)
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


def _draw(rng: random.Random) -> Problem:
    op: Operator = rng.choice(("+", "-"))
    a = _operand(rng, rng.randint(1, MAX_DIGITS))
    b = _operand(rng, rng.randint(1, MAX_DIGITS))
    if op == "-" and a < b:
        a, b = b, a
    return Problem(a, op, b)


def _operand(rng: random.Random, digits: int) -> int:
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)
