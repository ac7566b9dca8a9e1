"""GSM8K records (``question``, ``answer`` ending in ``#### <number>``) as verl prompt rows.

The conversion is verl's ``examples/data_preprocess/gsm8k.py``, so rewards and results
compare with verl's: the question plus a fixed instruction as the only user message,
data source ``openai/gsm8k``, ground truth = the number after ``####`` with commas removed,
and the raw question and answer kept in ``extra_info``. (verl's ``ability`` column is left
out: nothing in Relay reads it.) This module converts one record; reading and writing files
is ``relay.configs.prompt_data``'s job.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_FINAL_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_solution(answer: str) -> str:
    """The final answer after ``####``, commas removed; ``ValueError`` if there is none."""
    match = _FINAL_ANSWER.search(answer)
    if match is None:
        raise ValueError(f"field `answer`: no final '#### <number>' in {answer[-60:]!r}")
    return match[1].replace(",", "")


def verl_row(record: Mapping[str, Any], index: int, *, split: str) -> dict[str, Any]:
    """One GSM8K record as a verl prompt row; ``ValueError`` names a missing or bad field."""
    for field in ("question", "answer"):
        if not isinstance(record.get(field), str):
            found = type(record[field]).__name__ if field in record else "nothing"
            raise ValueError(f"field `{field}`: expected a string, got {found}")
    question, answer = record["question"], record["answer"]
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "reward_model": {"style": "rule", "ground_truth": extract_solution(answer)},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }
