"""A Python code interpreter tool, run in Relay's sandbox (``relay.algorithms.sandbox``).

``code_interpreter(code)`` runs the program as ``__main__`` in a fresh sandboxed process
and answers with its stdout then stderr, cut to ``max_output_chars`` in the middle (so a
traceback's last line stays). A program that ran is a successful call whatever its
exit status (the model reads the traceback); one stopped by a limit gets ``[timeout: ...]``
style notes after its output; a broken sandbox raises, so the call fails.

Config, verl's ``SandboxFusionTool`` keys: ``default_timeout`` (s, the wall-clock and
CPU-time limit, default 30), ``memory_limit_mb`` (1024), ``default_language`` (only
``python``), ``sandbox_fusion_url`` (run on that SandboxFusion server instead of locally),
``rate_limit`` (executions in flight at once for this tool, when ``enable_global_rate_limit``,
default 10), ``num_workers`` (accepted; the sandbox sizes its own pool); Relay's
``max_output_chars`` (4096). Departure from verl: a ``timeout`` argument from the model
is ignored, so the policy cannot lift its own limit.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import msgspec

from relay.algorithms.sandbox import Limits, Sandbox, SandboxFusionConfig, SandboxSettings
from relay.algorithms.sandbox import make_sandbox
from relay.generators.tools.base import BaseTool, ExecuteResult
from relay.generators.tools.calls import truncate_text
from relay.generators.tools.schema import FunctionParameters, FunctionSchema, ToolSchema


class CodeInterpreterConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The tool YAML's ``config`` (module doc)."""

    type: Literal["native"] = "native"
    default_timeout: float = 30.0
    memory_limit_mb: int = 1024
    default_language: Literal["python"] = "python"
    sandbox_fusion_url: str = ""
    rate_limit: int = 10
    enable_global_rate_limit: bool = True
    num_workers: int = 10
    max_output_chars: int = 4096

    def __post_init__(self) -> None:
        for name in ("rate_limit", "num_workers", "max_output_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


class CodeInterpreterTool(BaseTool):
    """Runs the model's Python in ``sandbox`` (given, or built from the config on first use
    and closed by ``close``)."""

    default_schema = ToolSchema(function=FunctionSchema(
        name="code_interpreter",
        description="Run a Python program and see its output (print what you need).",
        parameters=FunctionParameters(
            properties={"code": {"type": "string", "description": "The code to execute."}},
            required=["code"])))

    def __init__(self, config: dict[str, Any], tool_schema: ToolSchema | None,
                 sandbox: Sandbox | None = None) -> None:
        super().__init__(config, tool_schema)
        try:
            self.settings = msgspec.convert(config, CodeInterpreterConfig)
        except msgspec.ValidationError as exc:
            raise ValueError(f"code interpreter config: {exc} (default_language: only "
                             "'python')") from exc
        self.limits = Limits(wall_s=self.settings.default_timeout,
                             cpu_s=self.settings.default_timeout,
                             memory_mb=self.settings.memory_limit_mb)
        self._sandbox = sandbox
        self._owns_sandbox = sandbox is None
        self._in_flight = (asyncio.Semaphore(self.settings.rate_limit)
                           if self.settings.enable_global_rate_limit else None)

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> ExecuteResult:
        code = parameters.get("code")
        if code is None:
            raise ValueError("missing argument 'code'")
        sandbox = self._sandbox_in_use()
        if self._in_flight is None:
            execution = await sandbox.arun(str(code), limits=self.limits)
        else:
            async with self._in_flight:
                execution = await sandbox.arun(str(code), limits=self.limits)
        if execution.status == "sandbox_error":
            raise RuntimeError(f"the sandbox failed: {execution.reason}")
        text = execution.stdout + execution.stderr
        if execution.status not in ("ok", "error"):
            text += f"\n[{execution.status}: {execution.reason}]"
        text, _ = truncate_text(text, self.settings.max_output_chars, "middle")
        return text, None, {
            "sandbox_wall_s": execution.wall_s, "exit_code": execution.exit_code}

    def close(self) -> None:
        if self._owns_sandbox and self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None

    def _sandbox_in_use(self) -> Sandbox:
        if self._sandbox is None:
            fusion = SandboxFusionConfig(url=self.settings.sandbox_fusion_url or None,
                                         max_concurrent=self.settings.rate_limit,
                                         memory_limit_mb=self.settings.memory_limit_mb)
            self._sandbox = make_sandbox(SandboxSettings(limits=self.limits,
                                                         sandbox_fusion=fusion))
        return self._sandbox

