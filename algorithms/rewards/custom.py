"""Load a user's reward function from ``"module:function"`` or ``"path/to/file.py:function"``.

The function must have verl's signature, ``compute_score(data_source, solution_str,
ground_truth, extra_info) -> float | dict`` (verl's ``custom_reward_function.path`` and
``.name`` map to ``f"{path}:{name}"``). Loading is ``relay.algorithms.user_code``'s; every
failure raises ``RewardLoadError`` with a message naming what was asked for and why.
"""

from __future__ import annotations

from relay.algorithms.rewards.result import ScoreFn
from relay.algorithms.user_code import load_function


class RewardLoadError(Exception):
    """A custom reward function could not be loaded; the message says which and why."""


def load_score_fn(spec: str) -> ScoreFn:
    """Import the module or file named by ``spec`` and return its reward function."""
    fn: ScoreFn = load_function(spec, "custom reward function", RewardLoadError)
    return fn
