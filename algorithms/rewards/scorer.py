"""``RewardScorer``: the reward of every completion of a group, isolated and in order.

Routing, per item:

- a custom function configured: the worker process (``worker``), for every data_source;
- a built-in rule that is a linear-time string scan (arithmetic, GSM8K) and
  ``in_process_builtins``: called right here, no IPC (4-7x the worker's throughput);
- any other built-in rule (Math-Verify): the worker process.

Worker calls are bounded by ``RewardConfig.timeout_s`` per sample; in-process calls are
not, which is why only bounded rules qualify. An unknown data_source is a configuration
error and raises ``UnknownDataSourceError``; call ``check_data_sources`` at start-up so it
fails before the first generation. Everything a reward function does wrong becomes a
``RewardResult`` with score 0.0 and an ``error``; ``score`` itself raises only for
configuration errors and for a worker that cannot be started at all. A call in which more
than ``FAILING_FRACTION`` of the samples fail is a warning in the log (the first at once,
then at most one every ``WARN_EVERY_S``, counting the calls in between): a broken reward
function shows as more than a metric.

Typical use in a generator loop::

    with RewardScorer(RewardConfig(path="my_rewards.py", name="compute_score")) as scorer:
        scorer.check_data_sources(dataset_sources)
        for prompt, completions in groups:
            results = scorer.score([
                RewardItem(prompt.data_source, text, prompt.ground_truth, prompt.extra_info)
                for text in completions
            ])
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from types import TracebackType

from relay.algorithms.rewards.config import RewardConfig, build_score_fn
from relay.algorithms.rewards.registry import check_data_sources, runs_in_process
from relay.algorithms.rewards.result import RewardItem, RewardResult, evaluate
from relay.algorithms.rewards.worker import RewardWorker
from relay.algorithms.sandbox import SandboxSettings

logger = logging.getLogger(__name__)

FAILING_FRACTION = 0.5  # more than this share of failed samples is a broken reward function
WARN_EVERY_S = 60.0


class FailureAlarm:
    """Warns when more than ``FAILING_FRACTION`` of one call's samples failed: at once the
    first time, then at most once every ``WARN_EVERY_S`` with the failing calls since."""

    def __init__(self, every_s: float = WARN_EVERY_S) -> None:
        self.every_s = every_s
        self._last = -math.inf
        self._failing_calls = 0

    def check(self, results: Sequence[RewardResult]) -> None:
        errors = [r.error for r in results if r.error]
        if len(errors) <= FAILING_FRACTION * len(results):
            return
        self._failing_calls += 1
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        common, times = Counter(errors).most_common(1)[0]
        logger.warning(
            "REWARD FUNCTION FAILING: %d of %d samples scored 0 with an error (%d such "
            "calls since the last warning); the most common error (%d times): %s",
            len(errors), len(results), self._failing_calls, times, common)
        self._last, self._failing_calls = now, 0


class RewardScorer:
    """Scores lists of ``RewardItem``; one ``RewardResult`` per item, in the same order.

    Thread-safe (calls are serialized). ``sandbox``: where the worker runs the code sources'
    programs (the run's ``sandbox`` section; default: a local pool with default settings),
    one sandbox per worker process, started by its first code sample. Close the scorer, or
    use it as a context manager, to stop the worker process (and its sandbox); a custom
    function's worker is started (and the function loaded) here, so a bad ``path`` or
    ``name`` raises ``RewardLoadError`` at construction.
    """

    def __init__(self, config: RewardConfig | None = None,
                 sandbox: SandboxSettings | None = None) -> None:
        self.config = config if config is not None else RewardConfig()
        self._custom = bool(self.config.custom_function)
        if self.config.reward_manager == "batch" and not self._custom:
            raise ValueError("reward_manager = 'batch' calls a batch reward function: set "
                             "custom_reward_function.path (and name) to one")
        # The built-in dispatcher, for the in-process route (None: everything goes remote).
        # Code rules never run in process, so its sandbox is never started.
        self._local = None if self._custom else build_score_fn(self.config)
        self._worker = RewardWorker(self.config, sandbox)
        self._lock = threading.Lock()
        self._closed = False
        self._alarm = FailureAlarm()
        if self._custom:
            self._worker.start()

    @property
    def worker_pid(self) -> int | None:
        """The pid of the live worker process, if one is running."""
        return self._worker.pid

    def _in_process(self, data_source: str) -> bool:
        return not self._custom and self.config.in_process_builtins and runs_in_process(
            data_source
        )

    def check_data_sources(self, sources: Iterable[str]) -> None:
        """Fail now if a source has no reward function; start the worker if one will need it.

        A custom function accepts every data_source. Raises ``UnknownDataSourceError``.
        """
        sources = set(sources)
        if not self._custom:
            check_data_sources(sources)
        if not all(self._in_process(source) for source in sources):
            with self._lock:
                self._check_open()
                self._worker.start()

    def score(self, items: Sequence[RewardItem]) -> list[RewardResult]:
        """Score ``items``; ``result[i]`` is the reward of ``items[i]``."""
        if not self._custom:
            check_data_sources(item.data_source for item in items)
        with self._lock:
            self._check_open()
            results: list[RewardResult | None] = [None] * len(items)
            remote: list[int] = []
            for position, item in enumerate(items):
                if self._local is not None and self._in_process(item.data_source):
                    results[position] = evaluate(self._local, item)
                else:
                    remote.append(position)
            if remote:
                remote_results = self._worker.score([items[i] for i in remote])
                for position, result in zip(remote, remote_results, strict=True):
                    results[position] = result
            self._alarm.check(results)  # type: ignore[arg-type]  # every slot is filled
        return results  # type: ignore[return-value]  # every slot is filled above

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this RewardScorer is closed")

    def close(self) -> None:
        """Kill the worker process (if any); idempotent."""
        with self._lock:
            self._closed = True
            self._worker.stop()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
