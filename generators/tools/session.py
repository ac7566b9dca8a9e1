"""One episode's tool instances: created on first use, rewarded and released at the end.

An instance lives for the whole episode (verl's SGLang multi-turn rollout; verl's agent
loop makes one per call instead), so a stateful tool such as ``Gsm8kTool`` sees every
submission of the episode and ``calc_reward`` scores its final state. A tool's instance
is created with the row's ``tools_kwargs[name]["create_kwargs"]`` (verl's data layout),
passed both as keyword arguments and as ``create_kwargs=`` (verl's two callers), at most
once even when calls to it run concurrently.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from relay.algorithms.user_code import describe
from relay.generators.tools.base import BaseTool

logger = logging.getLogger(__name__)


class ToolSession:
    """The instances of ``tools`` (by name) for one episode of a row with ``tools_kwargs``.
    Use ``async with`` (or ``await close()``) so every instance is released."""

    def __init__(self, tools: Mapping[str, BaseTool],
                 tools_kwargs: Mapping[str, Any] | None = None) -> None:
        self.tools = tools
        self._kwargs = tools_kwargs or {}
        self._instances: dict[str, str] = {}
        self._locks = {name: asyncio.Lock() for name in tools}

    async def instance(self, name: str) -> str:
        """The episode's instance id of tool ``name``, created on first use (``KeyError``
        for an unknown tool; whatever ``create`` raises, for the call to report)."""
        tool = self.tools[name]
        async with self._locks[name]:
            if name not in self._instances:
                create_kwargs = dict((self._kwargs.get(name) or {}).get("create_kwargs") or {})
                instance_id, _ = await tool.create(None, create_kwargs=create_kwargs,
                                                   **create_kwargs)
                self._instances[name] = instance_id
            return self._instances[name]

    async def rewards(self) -> dict[str, float]:
        """``calc_reward`` of each tool this episode used, by tool name."""
        return {name: float(await self.tools[name].calc_reward(instance_id))
                for name, instance_id in self._instances.items()}

    async def close(self) -> None:
        """Release every instance; a failing ``release`` is logged, and the rest still run."""
        instances, self._instances = self._instances, {}
        for name, instance_id in instances.items():
            try:
                await self.tools[name].release(instance_id)
            except Exception as exc:  # a user's tool: one bad release must not leak the rest
                logger.warning("tool %s: release(%s) raised %s", name, instance_id,
                               describe(exc))

    async def __aenter__(self) -> ToolSession:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
