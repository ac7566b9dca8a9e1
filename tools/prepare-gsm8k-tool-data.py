#!/usr/bin/env python3
"""GSM8K records as the rows of verl's multi-turn GSM8K-with-tool recipe.

    python tools/prepare-gsm8k-tool-data.py ../shared/data/gsm8k/train.jsonl OUT.parquet \
        [--split train] [--rows N] [--no-system]

The conversion is verl's ``examples/data_preprocess/gsm8k_multiturn_w_tool.py`` (v0.5.0):
a system message asking for the ``calc_gsm8k_reward`` tool, the question plus verl's
instruction as the user message, ground truth = the number after ``####``, and
``extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs.ground_truth`` (the tool's
``create`` arguments, which ``Gsm8kTool`` checks answers against). The output's suffix
picks JSONL or parquet; a malformed record stops the conversion naming file, line and field.
``--no-system`` leaves the system message out (307 tokens of the embedded default's
tokenizer, more than its 256 positions), the rest unchanged.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Run by path, this folder comes first on sys.path, and its relay/ holds only the command's
# own modules: the package (the checkout's folders mapped by an install) is found without it.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from relay.algorithms.tasks.gsm8k import DATA_SOURCE, extract_solution  # noqa: E402
from relay.configs.prompt_data import (DatasetError, load_prompt_rows,  # noqa: E402
                                       write_prompt_rows)

TOOL = "calc_gsm8k_reward"
SYSTEM = ("You are a math expert. You are given a question and you need to solve it step by step. "
          "Reasoning step by step before any tool call. "
          f"You should use the `{TOOL}` tool after step by step solving the question, "
          "before generate final answer at least once and refine your answer if necessary. "
          "Put your final answer in the format of `#### <answer>`.")
INSTRUCTION = "Let's think step by step and output the final answer after `####`."


def tool_row(record: Mapping[str, Any], index: int, *, split: str,
             system: bool = True) -> dict[str, Any]:
    """One GSM8K record as a row of verl's GSM8K-with-tool recipe (without its system
    message unless ``system``); ``ValueError`` names a missing or bad field."""
    for field in ("question", "answer"):
        if not isinstance(record.get(field), str):
            found = type(record[field]).__name__ if field in record else "nothing"
            raise ValueError(f"field `{field}`: expected a string, got {found}")
    question, answer = record["question"], record["answer"]
    solution = extract_solution(answer)
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "system", "content": SYSTEM}] * system
        + [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "reward_model": {"style": "rule", "ground_truth": solution},
        "extra_info": {
            "split": split, "index": index, "answer": answer, "question": question,
            "need_tools_kwargs": True,
            "tools_kwargs": {TOOL: {"create_kwargs": {"ground_truth": solution}}},
            "interaction_kwargs": {"query": question, "ground_truth": solution},
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input", type=Path, help="GSM8K-style .jsonl or .parquet")
    parser.add_argument("output", type=Path, help="verl-schema .jsonl or .parquet")
    parser.add_argument("--split", default="train", help="recorded in extra_info.split")
    parser.add_argument("--rows", type=int, default=None, help="only the first N records")
    parser.add_argument("--no-system", dest="system", action="store_false",
                        help="leave verl's system message out (for a model of short context)")
    args = parser.parse_args(argv)
    try:
        rows = load_prompt_rows(args.input, convert=lambda record, index: tool_row(
            record, index, split=args.split, system=args.system))
    except DatasetError as error:
        print(f"prepare-gsm8k-tool-data: {error}", file=sys.stderr)
        return 1
    rows = rows[:args.rows] if args.rows is not None else rows
    write_prompt_rows(args.output, rows)
    print(f"wrote {len(rows)} rows to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
