"""Relay's tool interface: verl's ``BaseTool``, so a verl tool ports by changing its imports.

A tool is built once per generator, ``Tool(config, tool_schema)``, and serves every
episode through instances: ``create`` one per episode (or per call) with the row's
``create_kwargs``, ``execute`` each call, ``calc_reward`` at the end, ``release`` always.
All four are coroutines run on the generator's event loop, so a tool must not block it:
blocking work goes to a thread (``asyncio.to_thread``) or the sandbox's ``arun``.

``execute`` returns verl's triple ``(response, step_reward, metrics)``: a ``ToolResponse``
or a string, a float (or None), a dict of numbers (or None).
"""

from __future__ import annotations

from typing import Any, ClassVar
from uuid import uuid4

from relay.generators.tools.schema import ToolResponse, ToolSchema

ExecuteResult = tuple["ToolResponse | str", "float | None", "dict[str, Any] | None"]


class BaseTool:
    """A tool the policy can call. Subclasses override ``execute`` (and the others when
    they keep per-instance state); ``default_schema`` is used when the tool YAML gives no
    ``tool_schema``."""

    default_schema: ClassVar[ToolSchema | None] = None

    def __init__(self, config: dict[str, Any], tool_schema: ToolSchema | None) -> None:
        schema = tool_schema or self.default_schema
        if schema is None:
            raise ValueError(f"{type(self).__name__} has no tool_schema: give one in the tool "
                             "YAML or set the class's default_schema")
        self.config = config
        self.tool_schema = schema
        self.name = schema.name

    def get_openai_tool_schema(self) -> ToolSchema:
        return self.tool_schema

    async def create(self, instance_id: str | None = None,
                     **kwargs: Any) -> tuple[str, ToolResponse]:
        """Start an instance; returns its id and a (usually empty) creation response."""
        return instance_id or str(uuid4()), ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> ExecuteResult:
        """Run one call with the model's ``parameters``; verl's triple (module doc)."""
        raise NotImplementedError(f"{type(self).__name__}.execute")

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The instance's reward from its state (0.0 for a stateless tool)."""
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Forget the instance."""

    def close(self) -> None:
        """Free what the tool holds (a sandbox, a connection) when the generator stops;
        Relay's addition, verl has none."""
