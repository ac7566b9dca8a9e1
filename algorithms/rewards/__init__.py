"""Verifiable rewards: built-in rules chosen by ``data_source``, custom functions, isolation.

- ``arithmetic``, ``gsm8k``, ``boxed_math``: the rules, pure functions of text.
- ``registry``: data_source -> rule (verl's names), ``default_compute_score``.
- ``custom``: load ``"module:function"`` / ``"file.py:function"`` (verl's signature).
- ``scorer`` / ``worker``: ``RewardScorer`` scores a group in order, with per-sample time
  limits enforced by killing a worker process.
"""

from relay.algorithms.rewards.config import RewardConfig
from relay.algorithms.rewards.custom import RewardLoadError, load_score_fn
from relay.algorithms.rewards.registry import (
    UnknownDataSourceError,
    check_data_sources,
    default_compute_score,
    known_data_sources,
)
from relay.algorithms.rewards.result import RewardItem, RewardResult
from relay.algorithms.rewards.scorer import RewardScorer
from relay.algorithms.rewards.worker import RewardWorkerError

__all__ = [
    "RewardConfig",
    "RewardItem",
    "RewardLoadError",
    "RewardResult",
    "RewardScorer",
    "RewardWorkerError",
    "UnknownDataSourceError",
    "check_data_sources",
    "default_compute_score",
    "known_data_sources",
    "load_score_fn",
]
