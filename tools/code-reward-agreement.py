#!/usr/bin/env python3
"""Code-reward agreement on HumanEval: canonical solutions must pass, corrupted ones fail.

    tools/with-venv python tools/code-reward-agreement.py [--limit N] [--timeout-s 20]

Scores every problem of OpenAI's HumanEval (164, ``tests/algorithms/rewards/data``) through
the reward path a run uses (``RewardScorer``: the reward worker process, data_source
``humaneval``, the local sandbox), four responses each:

- ``canonical``: the canonical body as a completion of the prompt (HumanEval's form);
- ``canonical-fenced``: the whole function (prompt + body) in a fenced Python block;
- ``return-none``: the body replaced by ``return None``;
- ``altered-return``: the canonical function wrapped so its return value changes
  (``not`` a bool, +1 to a number, ``"?"`` appended to a string, ``None`` appended to a
  list or tuple, anything else becomes ``None``).

The first two must score 1, the last two 0. Prints the agreement of each, and the overall
one, and names every disagreement with its failure kind; exits 1 below ``--min-agreement``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from relay.algorithms.rewards import RewardConfig, RewardItem, RewardResult, RewardScorer
from relay.algorithms.rewards.code import FAILURE_KINDS

DATA = Path(__file__).resolve().parents[1] / "tests/algorithms/rewards/data/HumanEval.jsonl.gz"
ALTER = """

_relay_original = {entry}


def _relay_altered(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "?"
    if isinstance(value, (list, tuple)):
        return type(value)([*value, None])
    return None


def {entry}(*args, **kwargs):
    return _relay_altered(_relay_original(*args, **kwargs))
"""
VARIANTS = {"canonical": 1.0, "canonical-fenced": 1.0, "return-none": 0.0,
            "altered-return": 0.0}


def load_problems(path: Path = DATA) -> list[dict[str, str]]:
    """HumanEval's problems, in file order."""
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def response(problem: dict[str, str], variant: str) -> str:
    """The response text of one variant."""
    body = problem["canonical_solution"]
    if variant == "canonical":
        return body
    if variant == "canonical-fenced":
        return f"Here is the function:\n\n```python\n{problem['prompt']}{body}```\n"
    if variant == "return-none":
        return "    return None\n"
    if variant == "altered-return":
        return body + ALTER.format(entry=problem["entry_point"])
    raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")


def item(problem: dict[str, str], variant: str) -> RewardItem:
    truth = {key: problem[key] for key in ("test", "entry_point", "prompt")}
    return RewardItem("humaneval", response(problem, variant), json.dumps(truth))


def outcome(result: RewardResult) -> str:
    """The failure kind of a result (or its error, or ``pass``), for a report line."""
    if result.error:
        return f"error: {result.error}"
    return next((kind for kind in FAILURE_KINDS if result.info.get(kind)), "pass")


def agreement(scorer: RewardScorer, problems: Sequence[dict[str, str]]) -> dict[str, list[str]]:
    """For each variant, the task ids whose score disagreed with the expected one."""
    wrong: dict[str, list[str]] = {variant: [] for variant in VARIANTS}
    for variant, expected in VARIANTS.items():
        results = scorer.score([item(problem, variant) for problem in problems])
        for problem, result in zip(problems, results, strict=True):
            if result.score != expected:
                wrong[variant].append(f"{problem['task_id']} ({outcome(result)})")
    return wrong


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=0, help="only the first N problems")
    parser.add_argument("--timeout-s", type=float, default=20.0,
                        help="custom_reward_function.timeout_s (per sample)")
    parser.add_argument("--min-agreement", type=float, default=0.99)
    parser.add_argument("--data", type=Path, default=DATA)
    args = parser.parse_args(argv)
    problems = load_problems(args.data)[: args.limit or None]
    start = time.perf_counter()
    with RewardScorer(RewardConfig(timeout_s=args.timeout_s)) as scorer:
        wrong = agreement(scorer, problems)
    seconds = time.perf_counter() - start
    total = len(problems) * len(VARIANTS)
    agreed = total - sum(map(len, wrong.values()))
    for variant, expected in VARIANTS.items():
        share = 1 - len(wrong[variant]) / len(problems)
        print(f"{variant:17s} expect {expected:g}: {share:7.2%} agree "
              f"({len(problems) - len(wrong[variant])}/{len(problems)})")
        for line in wrong[variant]:
            print(f"    disagrees: {line}")
    print(f"overall: {agreed / total:.2%} ({agreed}/{total}) in {seconds:.1f} s "
          f"({total / seconds:.1f} samples/s)")
    return 0 if agreed / total >= args.min_agreement else 1


if __name__ == "__main__":
    sys.exit(main())
