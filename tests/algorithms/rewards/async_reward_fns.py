"""``async def`` reward functions for ``test_async_rewards.py``, loaded by file path (verl's
recommended form for reward functions that call an API or a sandbox).

``compute_score`` reads its behaviour from the completion, ``"<kind>:<arg>"``, like
``reward_fns.py``; a correct sample (``ok:<n>``) scores n and reports in ``peak`` the most
samples this worker has had in flight at once so far.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any

_in_flight = 0
_peak = 0


async def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                        extra_info: dict[str, Any]) -> Any:
    global _in_flight, _peak
    kind, _, arg = solution_str.partition(":")
    if kind == "ok":
        _in_flight += 1
        _peak = max(_peak, _in_flight)
        try:
            await asyncio.sleep(0.2)
        finally:
            _in_flight -= 1
        return {"score": float(arg), "peak": float(_peak)}
    if kind == "sleep":  # awaits past any test's time limit
        await asyncio.sleep(float(arg))
        return 1.0
    if kind == "block":  # blocks the event loop itself: only a kill can stop it
        time.sleep(float(arg))
        return 1.0
    if kind == "raise":
        raise ValueError(f"bad sample {arg}")
    if kind == "exit":
        sys.exit(3)
    if kind == "alloc":  # arg: GiB (zero pages, never touched)
        block = bytearray(int(float(arg) * 2**30))
        return float(len(block) > 0)
    if kind == "pid":
        return float(os.getpid())
    raise AssertionError(f"unknown test kind {kind!r}")


def wrapped(**kwargs: Any) -> Any:
    """A plain function that returns the coroutine (a decorator that lost ``async``)."""
    return compute_score(**kwargs)


class _Scorer:
    async def __call__(self, **kwargs: Any) -> Any:
        return await compute_score(**kwargs)


as_object = _Scorer()
