"""The code interpreter tool: what the model sees for each way a program ends, its limits
from verl's config keys, its concurrency cap; with a stand-in sandbox and with Relay's."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

import pytest

from relay.algorithms.sandbox import Execution, Limits, LocalSandbox
from relay.generators.tools.calls import run_calls
from relay.generators.tools.code_interpreter import CodeInterpreterTool
from relay.generators.tools.parser import parse_tool_calls
from relay.generators.tools.session import ToolSession


class FakeSandbox:
    """Answers every program with ``execution``; records the calls and the peak in flight."""

    def __init__(self, execution: Execution, hold_s: float = 0.0) -> None:
        self.execution, self.hold_s = execution, hold_s
        self.calls: list[tuple[str, Limits | None]] = []
        self.in_flight = self.peak = 0

    def run(self, code: str, *, stdin: str = "", limits: Limits | None = None,
            files: Mapping[str, str] | None = None) -> Execution:
        raise AssertionError("the tool must not block the event loop")

    async def arun(self, code: str, *, stdin: str = "", limits: Limits | None = None,
                   files: Mapping[str, str] | None = None) -> Execution:
        self.calls.append((code, limits))
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(self.hold_s)
        self.in_flight -= 1
        return self.execution

    def close(self) -> None:
        pass


def ended(status: str, stdout: str = "", stderr: str = "", reason: str = "") -> Execution:
    return Execution(status=status, exit_code=0 if status == "ok" else 1, stdout=stdout,
                     stderr=stderr, wall_s=0.01, reason=reason)  # type: ignore[arg-type]


def execute(tool: CodeInterpreterTool, code: Any) -> tuple:
    return asyncio.run(tool.execute("i", {"code": code}))


@pytest.mark.parametrize("execution,text", [
    (ended("ok", "4\n"), "4\n"),
    (ended("error", "partial\n", "Traceback ...\nZeroDivisionError: division by zero\n",
           "exited with code 1"),
     "partial\nTraceback ...\nZeroDivisionError: division by zero\n"),
    (ended("timeout", "tick\n", reason="wall-clock limit 1 s"),
     "tick\n\n[timeout: wall-clock limit 1 s]"),
    (ended("memory", reason="address-space limit 64 MB"),
     "\n[memory: address-space limit 64 MB]"),
])
def test_the_model_reads_the_output_and_how_the_program_ended(execution: Execution,
                                                            text: str) -> None:
    sandbox = FakeSandbox(execution)
    tool = CodeInterpreterTool({"type": "native"}, None, sandbox=sandbox)
    response, reward, metrics = execute(tool, "print(2 + 2)")
    assert response == text and reward is None
    assert metrics == {"sandbox_wall_s": 0.01, "exit_code": execution.exit_code}
    assert sandbox.calls == [("print(2 + 2)", tool.limits)]


def test_verls_config_keys_set_the_limits() -> None:
    tool = CodeInterpreterTool({"type": "native", "default_timeout": 3, "memory_limit_mb": 256,
                                "num_workers": 4}, None, sandbox=FakeSandbox(ended("ok")))
    assert (tool.limits.wall_s, tool.limits.cpu_s, tool.limits.memory_mb) == (3, 3, 256)


@pytest.mark.parametrize("config,message", [
    ({"default_language": "cpp"}, "default_language"),
    ({"timeout": 3}, "unknown field `timeout`"),
    ({"rate_limit": 0}, "rate_limit must be at least 1"),
])
def test_a_bad_config_is_refused_naming_the_key(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CodeInterpreterTool(config, None, sandbox=FakeSandbox(ended("ok")))


def test_a_broken_sandbox_fails_the_call() -> None:
    tool = CodeInterpreterTool({}, None, sandbox=FakeSandbox(
        ended("sandbox_error", reason="worker pool died")))
    with pytest.raises(RuntimeError, match="the sandbox failed: worker pool died"):
        execute(tool, "print(1)")
    with pytest.raises(ValueError, match="missing argument 'code'"):
        asyncio.run(tool.execute("i", {}))


def test_long_output_loses_its_middle() -> None:
    tool = CodeInterpreterTool({"max_output_chars": 10}, None,
                               sandbox=FakeSandbox(ended("ok", "a" * 20 + "Error: last")))
    assert execute(tool, "x")[0] == "aaaaa...(truncated)... last"


def test_rate_limit_caps_executions_in_flight() -> None:
    sandbox = FakeSandbox(ended("ok"), hold_s=0.05)
    tool = CodeInterpreterTool({"rate_limit": 2}, None, sandbox=sandbox)

    async def many() -> None:
        await asyncio.gather(*(tool.execute("i", {"code": "1"}) for _ in range(6)))

    asyncio.run(many())
    assert sandbox.peak == 2 and len(sandbox.calls) == 6


@pytest.fixture(scope="module")
def sandbox() -> LocalSandbox:
    with LocalSandbox(workers=2) as local:
        yield local


def calls_through(sandbox: LocalSandbox, *programs: str, **config: Any) -> list:
    tool = CodeInterpreterTool({"type": "native", **config}, None, sandbox=sandbox)
    text = "".join('<tool_call>{"name": "code_interpreter", "arguments": {"code": %s}}'
                   "</tool_call>" % json.dumps(p) for p in programs)

    async def turn() -> list:
        async with ToolSession({tool.name: tool}) as session:
            return await run_calls(session, parse_tool_calls(text).calls,
                                   max_parallel_calls=len(programs), timeout_s=10,
                                   max_response_length=400)
    return asyncio.run(turn())


def test_programs_run_in_relays_sandbox_and_a_runaway_one_does_not_stop_the_others(
        sandbox: LocalSandbox) -> None:
    ok, raised, looped = calls_through(
        sandbox, "print(sum(range(101)))", "1 / 0", "while True:\n    pass",
        default_timeout=1)
    assert ok.success and ok.message["content"] == "5050\n"
    assert raised.success and raised.message["content"].rstrip().endswith(
        "ZeroDivisionError: division by zero")
    assert looped.success and "[timeout:" in looped.message["content"]
    assert looped.latency_s < 5
