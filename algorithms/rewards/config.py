"""Settings of reward scoring, shared by the scorer and its worker process.

The config lives in its own module, not beside ``RewardScorer``, because two processes
build from it: the caller (routing, time limits) and the worker (which function to call).
"""

from __future__ import annotations

import functools
from typing import get_args

import msgspec

from algorithms.rewards import gsm8k
from algorithms.rewards.custom import load_score_fn
from algorithms.rewards.registry import default_compute_score
from algorithms.rewards.result import ScoreFn


class RewardConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How rewards are computed and bounded.

    - ``custom_function``: ``"module:function"`` or ``"path/to/file.py:function"`` with
      verl's ``compute_score`` signature. When set it scores EVERY data_source (verl's
      ``custom_reward_function`` semantics) and always runs in the worker process. Empty:
      built-in rules chosen by data_source (``registry``).
    - ``timeout_s``: per-sample limit for calls in the worker; past it the sample gets 0.0
      with a ``timeout`` error and the worker is killed and replaced.
    - ``startup_timeout_s``: limit for (re)starting the worker, including importing the
      custom function's module. Exceeding it raises ``RewardWorkerError``.
    - ``in_process_builtins``: run the linear-time built-in rules (arithmetic, GSM8K) in
      the caller's process, with no time limit (they need none): 4-7x the throughput of
      the worker round-trip, and no worker process at all for a run that only uses them
      (``tools/bench-rewards.py``). Math-Verify rules and custom functions always run in
      the worker.
    - ``gsm8k_method`` / ``gsm8k_format_score``: verl's GSM8K options (``gsm8k``).
    """

    custom_function: str = ""
    timeout_s: float = 5.0
    startup_timeout_s: float = 60.0
    in_process_builtins: bool = True
    gsm8k_method: gsm8k.Method = "strict"
    gsm8k_format_score: float = 0.0

    def __post_init__(self) -> None:
        for name in ("timeout_s", "startup_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"RewardConfig.{name} must be > 0 seconds, got {value!r}")
        if self.gsm8k_method not in get_args(gsm8k.Method):
            raise ValueError(
                f"RewardConfig.gsm8k_method must be one of {get_args(gsm8k.Method)}, "
                f"got {self.gsm8k_method!r}"
            )


def build_score_fn(config: RewardConfig) -> ScoreFn:
    """The function the config selects: the custom one, or the built-in dispatcher."""
    if config.custom_function:
        return load_score_fn(config.custom_function)
    return functools.partial(
        default_compute_score,
        gsm8k_method=config.gsm8k_method,
        gsm8k_format_score=config.gsm8k_format_score,
    )
