"""Running a turn's calls: in call order, concurrently, bounded in number and time; every
failure an error tool message and a failed call, never an exception."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import pytest

from relay.generators.tools.base import BaseTool
from relay.generators.tools.calls import CallResult, run_calls, truncate_text
from relay.generators.tools.parser import parse_tool_calls
from relay.generators.tools.schema import ToolResponse, ToolSchema
from relay.generators.tools.session import ToolSession


def schema(name: str) -> ToolSchema:
    return ToolSchema.parse({"type": "function", "function": {"name": name,
                                                              "description": name}})


class Scripted(BaseTool):
    """Each call awaits ``parameters["wait"]`` (an event name) if given, sets
    ``parameters["set"]``, then returns ``parameters["return"]`` or raises ``"raise"``."""

    def __init__(self, name: str, events: dict[str, asyncio.Event] | None = None) -> None:
        super().__init__({}, schema(name))
        self.events = events or {}
        self.created: list[dict[str, Any]] = []
        self.released: list[str] = []
        self.cancelled = 0

    async def create(self, instance_id: str | None = None, **kwargs: Any):
        self.created.append(kwargs)
        await asyncio.sleep(0)  # a concurrent call to this tool now waits on the creation
        return f"{self.name}-{len(self.created)}", ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        try:
            if "sleep" in parameters:
                await asyncio.sleep(parameters["sleep"])
            if "wait" in parameters:
                await self.events[parameters["wait"]].wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if "set" in parameters:
            self.events[parameters["set"]].set()
        if "raise" in parameters:
            raise ValueError(parameters["raise"])
        return parameters.get("return", (f"{instance_id}: ok", 0.5, {"n": 1}))

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        if instance_id.startswith("bad"):
            raise RuntimeError("release failed")
        self.released.append(instance_id)


def call_text(name: str, **arguments: Any) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def run(tools: list[BaseTool], text: str, tools_kwargs: dict | None = None,
        **settings: Any) -> list[CallResult]:
    async def turn() -> list[CallResult]:
        async with ToolSession({tool.name: tool for tool in tools}, tools_kwargs) as session:
            return await run_calls(session, parse_tool_calls(text).calls, **settings)
    return asyncio.run(turn())


def test_results_come_in_call_order_with_messages_rewards_and_latency() -> None:
    a, b = Scripted("a"), Scripted("b")
    results = run([a, b], call_text("b") + call_text("a") + call_text("b"),
                  max_parallel_calls=3)
    assert [r.message for r in results] == [{"role": "tool", "content": "b-1: ok"},
                                            {"role": "tool", "content": "a-1: ok"},
                                            {"role": "tool", "content": "b-1: ok"}]
    assert all(r.success and r.reward == 0.5 and r.metrics == {"n": 1} for r in results)
    assert all(r.latency_s >= 0 for r in results)
    assert len(b.created) == 1  # one instance per tool per episode, despite two calls at once
    assert a.released == ["a-1"] and b.released == ["b-1"]


def test_calls_of_a_turn_run_concurrently() -> None:
    """The first call waits for an event only the second sets: run one after the other,
    the first would time out."""
    events = {"go": asyncio.Event()}
    tool = Scripted("t", events)
    results = run([tool], call_text("t", wait="go") + call_text("t", set="go"),
                  max_parallel_calls=2, timeout_s=5.0)
    assert [r.success for r in results] == [True, True], [r.error for r in results]


def test_calls_past_max_parallel_calls_do_not_run_and_fail_with_a_message() -> None:
    events = {"x": asyncio.Event()}
    tool = Scripted("t", events)
    results = run([tool], call_text("t") + call_text("t", set="x") + call_text("t"),
                  max_parallel_calls=1)
    assert [r.success for r in results] == [True, False, False]
    assert results[1].message["content"] == ("Error: call 2 of 3 not run: at most 1 tool calls "
                                             "run per turn")
    assert not events["x"].is_set()


def test_a_slow_tool_times_out_is_cancelled_and_the_others_finish() -> None:
    slow, fast = Scripted("slow"), Scripted("fast")
    results = run([slow, fast], call_text("slow", sleep=30) + call_text("fast"),
                  max_parallel_calls=2, timeout_s=0.2)
    assert not results[0].success and results[1].success
    assert results[0].message["content"] == "Error: tool 'slow' timed out after 0.2 s"
    assert 0.2 <= results[0].latency_s < 5
    assert slow.cancelled == 1


@pytest.mark.parametrize("text,error", [
    ('<tool_call>{"name": "t", "arguments": [1]}</tool_call>',
     "malformed tool call: 'arguments' is a list, not an object"),
    (call_text("nope"), "unknown tool 'nope'; the tools are t"),
    (call_text("t", **{"raise": "boom"}), "tool 't' raised ValueError: boom"),
    (call_text("t", **{"return": "just text"}), "tool 't' returned a str, not verl's "
                                                "(response, reward, metrics)"),
    (call_text("t", **{"return": ["x", 0.0, {}]}), "tool 't' returned a list, not verl's "
                                                   "(response, reward, metrics)"),
])
def test_a_failing_call_becomes_an_error_message_and_a_failed_call(text: str,
                                                                   error: str) -> None:
    (result,) = run([Scripted("t")], text)
    assert not result.success
    assert result.error == error
    assert result.message == {"role": "tool", "content": f"Error: {error}"}
    assert result.reward is None


class BadReturns(BaseTool):
    def __init__(self, returned: Any) -> None:
        super().__init__({}, schema("t"))
        self.returned = returned

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        return self.returned


@pytest.mark.parametrize("returned,error", [
    (("x", math.nan, {}), "tool 't' returned the reward nan, not a finite number or None"),
    (("x", "1", {}), "returned the reward '1'"),
    (("x", 0.0, [1]), "returned metrics of type list"),
    ((object(), 0.0, {}), "a tool response is a ToolResponse or a str, not a object"),
    (({"text": "x", "image": [1]}, 0.0, {}), "ToolResponse.image: Relay's tool responses are "
                                             "text only"),
])
def test_a_return_that_is_not_verls_triple_fails_the_call(returned: Any, error: str) -> None:
    (result,) = run([BadReturns(returned)], call_text("t"))
    assert not result.success and error in result.error


@pytest.mark.parametrize("returned,reward,text", [
    ((None, None, None), None, ""), ((ToolResponse(text="r"), 1, None), 1.0, "r"),
    (({"text": "d"}, -0.05, {"k": 2}), -0.05, "d"),
])
def test_verls_optional_parts_of_the_triple(returned: Any, reward: float | None,
                                            text: str) -> None:
    (result,) = run([BadReturns(returned)], call_text("t"))
    assert result.success and result.reward == reward and result.message["content"] == text


def test_the_instance_is_created_with_the_rows_create_kwargs_both_ways() -> None:
    tool = Scripted("t")
    run([tool], call_text("t"), tools_kwargs={"t": {"create_kwargs": {"ground_truth": "7"}}})
    assert tool.created == [{"create_kwargs": {"ground_truth": "7"}, "ground_truth": "7"}]


def test_a_create_that_raises_fails_the_call() -> None:
    class NoCreate(Scripted):
        async def create(self, instance_id: str | None = None, **kwargs: Any):
            raise KeyError("ground_truth")

    (result,) = run([NoCreate("t")], call_text("t"))
    assert not result.success and result.error == "tool 't' raised KeyError: 'ground_truth'"


def test_session_rewards_and_a_failing_release_does_not_stop_the_others(
        caplog: pytest.LogCaptureFixture) -> None:
    class Rewarded(Scripted):
        async def create(self, instance_id: str | None = None, **kwargs: Any):
            return ("bad-" if self.name == "a" else "") + self.name, ToolResponse()

        async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
            return 1.0 if self.name == "a" else 0.25

    a, b, unused = Rewarded("a"), Rewarded("b"), Rewarded("c")

    async def episode() -> dict[str, float]:
        session = ToolSession({t.name: t for t in (a, b, unused)})
        await run_calls(session, parse_tool_calls(call_text("a") + call_text("b")).calls,
                        max_parallel_calls=2)
        rewards = await session.rewards()
        await session.close()
        return rewards

    assert asyncio.run(episode()) == {"a": 1.0, "b": 0.25}
    assert b.released == ["b"] and unused.released == []
    assert "tool a: release(bad-a) raised RuntimeError: release failed" in caplog.text


@pytest.mark.parametrize("side,expected", [
    ("left", "abcd...(truncated)"), ("right", "(truncated)...ghij"),
    ("middle", "ab...(truncated)...ij"),
])
def test_truncation_keeps_verls_side(side: str, expected: str) -> None:
    assert truncate_text("abcdefghij", 4, side) == (expected, True)  # type: ignore[arg-type]
    assert truncate_text("abcd", 4, side) == ("abcd", False)  # type: ignore[arg-type]


def test_long_responses_and_errors_are_truncated_in_the_results() -> None:
    (result,) = run([BadReturns(("x" * 50, 0.0, {}))], call_text("t"),
                    max_response_length=10, truncate_side="left")
    assert result.message["content"] == "x" * 10 + "...(truncated)" and result.truncated
    (failed,) = run([Scripted("t")], call_text("t", **{"raise": "y" * 50}),
                    max_response_length=10, truncate_side="right")
    assert failed.message["content"] == "(truncated)..." + "y" * 10 and failed.truncated


@pytest.mark.parametrize("settings,message", [
    ({"max_parallel_calls": 0}, "max_parallel_calls 0"),
    ({"timeout_s": 0}, "timeout 0"),
    ({"max_response_length": 0}, "max_tool_response_length 0"),
    ({"truncate_side": "both"}, "tool_response_truncate_side 'both'"),
])
def test_bad_settings_are_refused_naming_the_key(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        run([Scripted("t")], call_text("t"), **settings)
