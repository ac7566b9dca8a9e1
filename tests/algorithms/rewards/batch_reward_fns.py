"""Batch reward functions (verl's ``BatchRewardManager`` signature) for
``test_batch_rewards.py``, loaded by file path. Each call appends one line to the file named
by the ``RELAY_TEST_BATCH_CALLS`` environment variable, so a test can count the calls."""

from __future__ import annotations

import os
import time
from typing import Any


def _count(n: int) -> None:
    with open(os.environ["RELAY_TEST_BATCH_CALLS"], "a", encoding="utf-8") as calls:
        calls.write(f"{n}\n")


def compute_score(data_sources: list[str], solution_strs: list[str],
                  ground_truths: list[Any], extra_infos: list[dict[str, Any]],
                  **kwargs: Any) -> list[Any]:
    """1.0 where the completion equals the ground truth; every other one a dict."""
    _count(len(solution_strs))
    return [1.0 if s == g else {"score": 0.0, "len": float(len(s))}
            for s, g in zip(solution_strs, ground_truths, strict=True)]


def wrong_length(data_sources: list[str], solution_strs: list[str], **kwargs: Any) -> list[float]:
    _count(len(solution_strs))
    return [1.0]


def hangs(data_sources: list[str], solution_strs: list[str], **kwargs: Any) -> list[float]:
    _count(len(solution_strs))
    time.sleep(3600)
    return []


def scaled(data_sources: list[str], solution_strs: list[str], ground_truths: list[Any],
           extra_infos: list[dict[str, Any]], *, scale: float, bonus: float = 0.0) -> list[float]:
    """``scale`` where the completion equals the ground truth, plus ``bonus``: the run's
    ``custom_reward_function.reward_kwargs``."""
    _count(len(solution_strs))
    return [scale * (s == g) + bonus for s, g in zip(solution_strs, ground_truths, strict=True)]
