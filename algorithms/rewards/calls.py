"""Calling a reward function in the worker: plain ones one by one, ``async def`` ones at once,
batch ones (``RewardConfig.reward_manager = "batch"``) once per group.

A plain function is called outside any event loop (it may run ``asyncio.run`` itself), one
sample at a time; the caller's clock bounds each call by killing the worker (``worker``).

An ``async def`` function (verl's recommended form for API and sandbox calls; a callable
object whose ``__call__`` is one counts) runs on the worker's event loop, one loop for the
worker's life, so a client it keeps between calls stays on its loop. Up to
``max_concurrent`` samples of a group run at once, each cancelled ``timeout_s`` after its own
start with a ``timeout`` error; results are handed on in sample order, each as soon as the
samples before it are done. Samples start in order, as slots free up, so sample k has
started by the time samples 0..k-1 are done: the caller's clock for sample k, which starts
when the result of k-1 arrives, never runs ahead of the worker's own. An awaitable returned
by a plain function (a wrapper around an ``async def``) is awaited the same way, alone.
A coroutine that blocks the loop (``time.sleep``, a blocking HTTP call) stalls every sample
in flight beside it; the caller's backstop kills the worker at the first late result, which
scores 0 as a timeout, and resends the samples after it.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from relay.algorithms.rewards.result import (
    RewardItem,
    RewardResult,
    ScoreFn,
    call,
    failure,
    to_result,
)

Explain = Callable[[BaseException], str]  # an exception from a call -> the sample's error


def is_async(fn: ScoreFn) -> bool:
    """Whether calling ``fn`` makes a coroutine: an ``async def`` (or a partial of one), or
    an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None))


async def _guarded(awaitable: Awaitable[Any]) -> tuple[Any, BaseException | None]:
    """The awaitable's value, or what it raised. ``SystemExit`` is caught here because an
    event loop re-raises it out of a task, which would end the worker."""
    try:
        return await awaitable, None
    except (Exception, SystemExit) as exc:  # isolation is the point
        return None, exc


class RewardCalls:
    """One reward function's calls in this process; every failure a result, never raised."""

    def __init__(self, fn: ScoreFn, *, timeout_s: float, max_concurrent: int,
                 explain: Explain) -> None:
        self.fn, self.timeout_s, self.max_concurrent = fn, timeout_s, max_concurrent
        self.explain = explain
        self.concurrent = is_async(fn)
        self._loop = asyncio.new_event_loop()

    def one(self, item: RewardItem) -> RewardResult:
        """A plain function's reward for ``item`` (an awaitable it returns is awaited)."""
        try:
            raw = call(self.fn, item)
            if inspect.isawaitable(raw):
                return self._loop.run_until_complete(self._awaited(raw))
            return to_result(raw)
        except (Exception, SystemExit) as exc:  # isolation is the point
            return failure(self.explain(exc))

    def batch(self, items: Sequence[RewardItem | RewardResult]) -> list[RewardResult]:
        """A batch function's (``reward_manager = "batch"``) rewards: ONE call with verl's
        batch signature for the items still to score (a ``RewardResult`` among them is
        already final). A raise, an awaitable, or a return that is not a list of one value
        per item scores each of them 0.0 with the reason."""
        todo = [i for i, item in enumerate(items) if isinstance(item, RewardItem)]
        results = [item if isinstance(item, RewardResult) else failure("") for item in items]
        if not todo:
            return results
        chosen = [item for item in items if isinstance(item, RewardItem)]
        try:
            raw = self.fn(data_sources=[it.data_source for it in chosen],
                          solution_strs=[it.solution_str for it in chosen],
                          ground_truths=[it.ground_truth for it in chosen],
                          extra_infos=[it.extra_info for it in chosen])
            if not isinstance(raw, (list, tuple)) or len(raw) != len(chosen):
                got = (f"{len(raw)} values" if isinstance(raw, (list, tuple))
                       else type(raw).__name__)
                raise TypeError(f"a batch reward function must return a list of {len(chosen)} "
                                f"scores (one per sample), got {got}")
            scored = [to_result(value) for value in raw]
        except (Exception, SystemExit) as exc:  # isolation is the point
            scored = [failure(self.explain(exc))] * len(chosen)
        for i, result in zip(todo, scored, strict=True):
            results[i] = result
        return results

    def many(self, items: Sequence[RewardItem | RewardResult],
             deliver: Callable[[int, RewardResult], None]) -> None:
        """Score ``items`` concurrently (a ``RewardResult`` among them is already final) and
        call ``deliver(index, result)`` for each, in index order."""
        self._loop.run_until_complete(self._many(items, deliver))

    async def _many(self, items: Sequence[RewardItem | RewardResult],
                    deliver: Callable[[int, RewardResult], None]) -> None:
        results = [self._loop.create_future() for _ in items]
        queue = iter(enumerate(items))  # shared by the lanes: samples start in order

        async def lane() -> None:
            for index, item in queue:
                results[index].set_result(await self._scored(item))

        lanes = [self._loop.create_task(lane())
                 for _ in range(min(self.max_concurrent, len(items)))]
        try:
            for index, result in enumerate(results):
                deliver(index, await result)
        finally:
            for each in lanes:
                each.cancel()

    async def _scored(self, item: RewardItem | RewardResult) -> RewardResult:
        if isinstance(item, RewardResult):
            return item
        try:
            raw = call(self.fn, item)
            if inspect.isawaitable(raw):
                return await self._awaited(raw)
            return to_result(raw)
        except (Exception, SystemExit) as exc:  # isolation is the point
            return failure(self.explain(exc))

    async def _awaited(self, awaitable: Awaitable[Any]) -> RewardResult:
        """The reward an awaitable gives within ``timeout_s``; raises what it raised."""
        task = self._loop.create_task(_guarded(awaitable))
        done, _ = await asyncio.wait({task}, timeout=self.timeout_s)
        if not done:
            task.cancel()
            return failure(f"timeout: no result within {self.timeout_s:g} s (coroutine cancelled)")
        raw, error = task.result()
        if error is not None:
            raise error
        return to_result(raw)
