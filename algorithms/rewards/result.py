"""What a reward call takes and gives back, and how a raw return becomes a ``RewardResult``.

A reward function has verl's signature, ``compute_score(data_source, solution_str,
ground_truth, extra_info) -> float | dict`` (``ScoreFn``), and is called with keyword
arguments as verl calls it, so a function that orders its parameters differently (or takes
``**kwargs``) works unchanged. Whatever it does, ``evaluate``
turns the call into one ``RewardResult``: an exception, a non-number, NaN / inf or a dict
without ``"score"`` each give score 0.0 and a reason in ``error``; they never propagate.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from relay.algorithms.user_code import describe

ScoreFn = Callable[..., Any]  # (*, data_source, solution_str, ground_truth, extra_info)
_MAX_ERROR_CHARS = 500
MAX_PRED_CHARS = 1000  # an extracted answer longer than this is cut (it is only compared)


class RewardItem(msgspec.Struct):
    """One completion to score, with its prompt's row fields (verl's names).

    ``ground_truth`` is a string for the built-in rules; a custom function may receive any
    msgpack-able value (tuples arrive as lists in the worker, numpy values as lists/numbers).
    """

    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: dict[str, Any] = {}


class RewardResult(msgspec.Struct, frozen=True):
    """The reward of one completion.

    ``info`` holds the other finite numeric entries of a dict return (e.g. ``format_ok``);
    ``error`` is empty when the function returned a valid score, else it says why the
    score is 0.0 (exception, timeout, bad return, dead worker). ``pred``: the answer the
    function extracted, a dict return's string ``pred`` (verl's key; majority voting,
    ``maj@N``, counts it), empty when there is none.
    """

    score: float
    info: dict[str, float] = {}
    error: str = ""
    pred: str = ""


def failure(reason: str) -> RewardResult:
    """A zero reward that says why."""
    return RewardResult(score=0.0, error=reason[:_MAX_ERROR_CHARS])


def _finite_float(value: object) -> float | None:
    """``float(value)`` for a finite real number (bools included), else None."""
    if not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except (OverflowError, ValueError):  # e.g. 10**400
        return None
    return number if math.isfinite(number) else None


def to_result(raw: object) -> RewardResult:
    """Validate a reward function's return: a finite real, or a dict with a finite ``score``.

    Other entries of a dict are kept in ``info`` when they are finite reals with string
    keys, and dropped otherwise (they are diagnostics, not rewards); a string ``pred`` is
    kept as the result's ``pred`` (at most ``MAX_PRED_CHARS``).
    """
    info: dict[str, float] = {}
    pred = ""
    if isinstance(raw, Mapping):
        if isinstance(raw.get("pred"), str):
            pred = raw["pred"][:MAX_PRED_CHARS]
        if "score" not in raw:
            keys = ", ".join(map(repr, list(raw)[:10]))
            return failure(f"bad return: dict without 'score' (keys: {keys})")
        score = raw["score"]
        for key, value in raw.items():
            number = _finite_float(value)
            if key != "score" and isinstance(key, str) and number is not None:
                info[key] = number
    else:
        score = raw
    if not isinstance(score, numbers.Real):
        return failure(
            f"bad return: {type(score).__name__}, expected a float or a dict with 'score'"
        )
    number = _finite_float(score)
    if number is None:
        return failure(f"bad return: non-finite score {score!r}")
    return RewardResult(score=number, info=info, pred=pred)


def call(fn: ScoreFn, item: RewardItem) -> Any:
    """``fn``'s raw return for one item, called with keywords as verl calls it."""
    return fn(
        data_source=item.data_source,
        solution_str=item.solution_str,
        ground_truth=item.ground_truth,
        extra_info=item.extra_info,
    )


def evaluate(fn: ScoreFn, item: RewardItem) -> RewardResult:
    """Call ``fn`` on one item; every failure becomes an error result, never an exception.

    ``SystemExit`` is caught too: a reward function calling ``sys.exit`` must not take the
    worker (or, in-process, the generator) down with it. For the plain functions that run in
    the caller's process; the worker calls through ``calls.RewardCalls``, which also awaits.
    """
    try:
        return to_result(call(fn, item))
    except (Exception, SystemExit) as exc:  # isolation is the point
        return failure(describe(exc))
