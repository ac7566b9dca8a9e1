"""Settings of reward scoring (verl's ``custom_reward_function`` section), shared by the
scorer and its worker process.

The config lives in its own module, not beside ``RewardScorer``, because two processes
build from it: the caller (routing, time limits) and the worker (which function to call).
``relay.configs.run_schema`` composes it as ``custom_reward_function``.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal, get_args

import msgspec

from relay.algorithms.rewards import gsm8k
from relay.algorithms.rewards.code import CodeRewardConfig, SandboxHandle
from relay.algorithms.rewards.custom import load_score_fn
from relay.algorithms.rewards.registry import default_compute_score
from relay.algorithms.rewards.result import ScoreFn
from relay.algorithms.sandbox import SandboxSettings

RewardManager = Literal["naive", "prime", "dapo", "batch"]  # verl's names
OWN_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info", "data_sources",
                 "solution_strs", "ground_truths", "extra_infos")
"""The arguments verl's per-sample and batch signatures pass (``reward_kwargs`` may not)."""
CODE_BUDGET_SHARE = 0.8  # of timeout_s, for a code sample's tests; the rest is the margin


class RewardConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """verl's ``custom_reward_function`` section: how rewards are computed and bounded.

    - ``path``, ``name``: the function ``name`` in the Python file or module ``path``, with
      verl's ``compute_score`` signature (``custom_function`` joins them as
      ``"path:name"``). When set it scores EVERY data_source (verl's semantics) and always
      runs in the worker process. Empty ``path``: built-in rules chosen by data_source
      (``registry``).
    - ``timeout_s`` (*Relay*): per-sample limit for calls in the worker; past it the sample
      gets 0.0 with a ``timeout`` error and the worker is killed and replaced.
    - ``startup_timeout_s`` (*Relay*): limit for (re)starting the worker, including importing
      the custom function's module. Exceeding it raises ``RewardWorkerError``.
    - ``worker_memory_gb`` (*Relay*; verl caps only its sandbox, with
      ``reward_model.sandbox_fusion.memory_limit_mb``): the worker's memory cap in GiB, 0 for
      none (``memory_cap``). A sample whose call allocates past it gets 0.0 with an error
      naming this key, and the worker is replaced; the generator goes on scoring.
    - ``max_concurrent`` (*Relay*): how many samples of one group an ``async def`` reward
      function scores at once (each within ``timeout_s`` of its own start).
    - ``in_process_builtins`` (*Relay*): run the linear-time built-in rules (arithmetic,
      GSM8K) in the caller's process, with no time limit (they need none): 4-7x the
      throughput of the worker round-trip, and no worker process at all for a run that only
      uses them (``tools/bench-rewards.py``). Math-Verify rules and custom functions always
      run in the worker.
    - ``reward_manager`` (verl's ``reward_model.reward_manager`` / ``reward.reward_manager.name``):
      ``batch`` calls the custom function ONCE per group, with verl's batch signature
      ``compute_score(data_sources, solution_strs, ground_truths, extra_infos) -> list``
      (one float or dict per sample, in order), within ``timeout_s`` times the group's size;
      a raise, a timeout or a list of the wrong length scores every sample of the group 0.0
      with the error. It needs ``path`` (``RewardScorer`` and the run config's checks refuse
      it without). ``naive``, ``prime`` and ``dapo`` call it sample by
      sample (DAPO's overlong penalty is ``reward_model.overlong_buffer``).
    - ``reward_kwargs`` (verl's ``custom_reward_function.reward_kwargs``): keyword arguments
      every call of the custom function gets beside its own (per sample and batch alike), as
      verl binds them; they need ``path`` (the built-in rules take none) and may not name
      the function's own arguments (``OWN_ARGUMENTS``): the run config's checks refuse both.
    - ``gsm8k_method`` / ``gsm8k_format_score`` (*Relay* keys for verl's GSM8K options,
      ``gsm8k``).
    - ``code`` (*Relay*): how the code sources' tests run (``code.CodeRewardConfig``: partial
      credit, per-test limits, how many tests). A code sample's tests share
      ``CODE_BUDGET_SHARE`` of ``timeout_s``, so they end, scored, before the worker's limit
      would kill it: raise ``timeout_s`` for problems with many or slow tests.
    """

    path: str = ""
    name: Annotated[str, msgspec.Meta(min_length=1)] = "compute_score"
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    startup_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0
    worker_memory_gb: Annotated[float, msgspec.Meta(ge=0)] = 8.0
    max_concurrent: Annotated[int, msgspec.Meta(gt=0)] = 64
    in_process_builtins: bool = True
    reward_manager: RewardManager = "naive"
    reward_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    gsm8k_method: gsm8k.Method = "strict"
    gsm8k_format_score: float = 0.0
    code: CodeRewardConfig = msgspec.field(default_factory=CodeRewardConfig)

    def __post_init__(self) -> None:
        # Decoding checks these against the annotations first; this guards direct construction.
        for field in ("timeout_s", "startup_timeout_s"):
            value = getattr(self, field)
            if not value > 0:
                raise ValueError(f"RewardConfig.{field} must be > 0 seconds, got {value!r}")
        if not 0 <= self.worker_memory_gb < float("inf"):
            raise ValueError("RewardConfig.worker_memory_gb must be a finite number of GiB >= 0 "
                             f"(0: no cap), got {self.worker_memory_gb!r}")
        if self.max_concurrent < 1:
            raise ValueError(
                f"RewardConfig.max_concurrent must be >= 1, got {self.max_concurrent!r}")
        if self.gsm8k_method not in get_args(gsm8k.Method):
            raise ValueError(
                f"RewardConfig.gsm8k_method must be one of {get_args(gsm8k.Method)}, "
                f"got {self.gsm8k_method!r}"
            )

    @property
    def custom_function(self) -> str:
        """``"path:name"``, the spec ``load_score_fn`` reads; empty without a ``path``."""
        return f"{self.path}:{self.name}" if self.path else ""


def build_score_fn(config: RewardConfig, sandbox: SandboxSettings | None = None) -> ScoreFn:
    """The function the config selects: the custom one, or the built-in dispatcher, with a
    sandbox of its own made from ``sandbox`` when the first code sample comes."""
    if config.custom_function:
        score_fn = load_score_fn(config.custom_function)
        if config.reward_kwargs:
            return functools.partial(score_fn, **config.reward_kwargs)
        return score_fn
    return functools.partial(
        default_compute_score,
        gsm8k_method=config.gsm8k_method,
        gsm8k_format_score=config.gsm8k_format_score,
        code=config.code,
        sandbox=SandboxHandle(sandbox),
        budget_s=CODE_BUDGET_SHARE * config.timeout_s,
    )
