"""Run one turn's parsed tool calls: concurrently, each bounded in time, never raising.

The first ``max_parallel_calls`` calls of a turn run together (asyncio); as in verl, the
rest do not run, but where verl drops them silently each gets an error tool message here
and counts as a failed call. Every call yields one ``CallResult`` in call order, with its
tool message (``{"role": "tool", "content": text}``), success, latency and step reward. A
call fails (an error message to the model, ``success=False``) when it was malformed, names
no tool, times out after ``timeout_s``, or its tool raises or returns something that is not
verl's ``(response, reward, metrics)``; the episode goes on.

A timeout cancels the tool's coroutine, which stops a tool that awaits (the sandbox's
``arun``, a thread) but not one that blocks the event loop: tools must not block.

Responses longer than ``max_response_length`` characters (verl's ``max_tool_response_length``
counts characters too) are cut on ``truncate_side``, as verl does:

    left:   text[:L] + "...(truncated)"                         (keeps the head)
    right:  "(truncated)..." + text[-L:]                        (keeps the tail)
    middle: text[:L//2] + "...(truncated)..." + text[-(L//2):]  (keeps both ends)
"""

from __future__ import annotations

import asyncio
import math
import numbers
import time
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from relay.algorithms.user_code import describe
from relay.generators.tools.parser import ParsedCall
from relay.generators.tools.schema import ToolResponse
from relay.generators.tools.session import ToolSession

TruncateSide = Literal["left", "middle", "right"]
TRUNCATE_SIDES: tuple[str, ...] = ("left", "middle", "right")


class CallResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one call gave: the tool message for the chat, and what the metrics need.
    ``error`` says why a failed call failed (it is also in the message)."""

    name: str
    message: dict[str, str]
    success: bool
    latency_s: float
    reward: float | None = None
    metrics: dict[str, Any] = {}
    error: str = ""
    truncated: bool = False


class _CallFailed(Exception):
    """A call that cannot give a response; the message is the error the model sees."""


def check_truncation(max_length: int, side: str) -> None:
    """``ValueError`` naming verl's key when ``max_length`` or ``side`` is invalid."""
    if side not in TRUNCATE_SIDES:
        raise ValueError(f"tool_response_truncate_side {side!r}: valid sides are "
                         f"{', '.join(TRUNCATE_SIDES)}")
    if max_length < 1:
        raise ValueError(f"max_tool_response_length {max_length}: must be at least 1")


def truncate_text(text: str, max_length: int, side: TruncateSide) -> tuple[str, bool]:
    """``text`` cut to ``max_length`` characters on ``side`` (module doc), and whether it was."""
    check_truncation(max_length, side)
    if len(text) <= max_length:
        return text, False
    if side == "left":
        return text[:max_length] + "...(truncated)", True
    if side == "right":
        return "(truncated)..." + text[-max_length:], True
    half = max_length // 2
    return text[:half] + "...(truncated)..." + (text[-half:] if half else ""), True


async def run_calls(session: ToolSession, calls: Sequence[ParsedCall], *,
                    max_parallel_calls: int = 1, timeout_s: float = 30.0,
                    max_response_length: int = 256,
                    truncate_side: TruncateSide = "middle") -> list[CallResult]:
    """One ``CallResult`` per call, in call order (module doc); defaults are verl's."""
    if max_parallel_calls < 1:
        raise ValueError(f"max_parallel_calls {max_parallel_calls}: must be at least 1")
    if not timeout_s > 0:
        raise ValueError(f"tool call timeout {timeout_s}: must be positive")
    check_truncation(max_response_length, truncate_side)
    run = [_run_one(session, call, timeout_s) for call in calls[:max_parallel_calls]]
    results = list(await asyncio.gather(*run))
    results += [_failure(call.name, f"call {i + 1} of {len(calls)} not run: at most "
                                    f"{max_parallel_calls} tool calls run per turn", 0.0)
                for i, call in enumerate(calls[max_parallel_calls:], start=max_parallel_calls)]
    return [_truncated(result, max_response_length, truncate_side) for result in results]


async def _run_one(session: ToolSession, call: ParsedCall, timeout_s: float) -> CallResult:
    start = time.perf_counter()
    try:
        if not call.ok:
            raise _CallFailed(f"malformed tool call: {call.error}")
        if call.name not in session.tools:
            raise _CallFailed(f"unknown tool {call.name!r}; the tools are "
                              f"{', '.join(sorted(session.tools)) or 'none'}")
        try:
            returned = await asyncio.wait_for(_execute(session, call), timeout_s)
        except asyncio.TimeoutError:
            raise _CallFailed(f"tool {call.name!r} timed out after {timeout_s:g} s") from None
        except Exception as exc:  # a user's tool: whatever it raised goes to the model
            raise _CallFailed(f"tool {call.name!r} raised {describe(exc)}") from exc
        response, reward, metrics = _unpack(call.name, returned)
    except _CallFailed as exc:
        return _failure(call.name, str(exc), time.perf_counter() - start)
    return CallResult(name=call.name, message=_message(response.text), success=True,
                      latency_s=time.perf_counter() - start, reward=reward, metrics=metrics)


async def _execute(session: ToolSession, call: ParsedCall) -> Any:
    instance_id = await session.instance(call.name)
    return await session.tools[call.name].execute(instance_id, call.arguments)


def _unpack(name: str, returned: Any) -> tuple[ToolResponse, float | None, dict[str, Any]]:
    """verl's ``(response, reward, metrics)``, checked; a bad one is ``_CallFailed``."""
    if not (isinstance(returned, tuple) and len(returned) == 3):
        raise _CallFailed(f"tool {name!r} returned a {type(returned).__name__}, not verl's "
                          "(response, reward, metrics)")
    response, reward, metrics = returned
    try:
        response = ToolResponse.of(response)
    except ValueError as exc:
        raise _CallFailed(f"tool {name!r}: {exc}") from exc
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, numbers.Real)
                               or not math.isfinite(reward)):
        raise _CallFailed(f"tool {name!r} returned the reward {reward!r}, not a finite number "
                          "or None")
    if metrics is not None and not isinstance(metrics, dict):
        raise _CallFailed(f"tool {name!r} returned metrics of type {type(metrics).__name__}, "
                          "not a dict or None")
    return response, None if reward is None else float(reward), metrics or {}


def _failure(name: str, error: str, latency_s: float) -> CallResult:
    return CallResult(name=name, message=_message(f"Error: {error}"), success=False,
                      latency_s=latency_s, error=error)


def _message(text: str) -> dict[str, str]:
    return {"role": "tool", "content": text}


def _truncated(result: CallResult, max_length: int, side: TruncateSide) -> CallResult:
    text, cut = truncate_text(result.message["content"], max_length, side)
    return msgspec.structs.replace(result, message=_message(text), truncated=cut) if cut \
        else result
