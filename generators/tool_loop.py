"""Relay's multi-turn tool loop (verl's ``rollout.multi_turn``), a rollout workflow.

One episode::

    ids = prompt (rendered with the tools' schemas)
    repeat:
        turn  = engine.generate(ids)                    # the policy's tokens: mask 1
        stop if the turn hit the length limit, called no tool, or a turn limit is reached
        calls = parse_tool_calls(text of turn)          # hermes <tool_call> JSON, tolerant
        results = run_calls(calls)                      # concurrent, per-call timeout
        ids += inserted_ids(tool messages)              # template + tool responses: mask 0

A malformed call, an unknown tool, a timeout or a raising tool becomes an error message the
model reads in the tool's reply (a failed call, counted in ``EpisodeStats.tool_failures``),
never a crash. ``max_assistant_turns`` bounds the policy's turns, ``max_user_turns`` the
tool-response turns; ``rollout.response_length`` bounds the whole response, tool tokens
included (an episode that runs out ends with ``finish_reason`` "length"). Each tool's
``calc_reward`` at the end goes into the sample's ``reward_info`` as ``tool/<name>``; the
reward itself is the run's reward function on the decoded response, as verl scores it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from relay.configs.chat_turns import inserted_ids, prompt_ids
from relay.configs.run_schema import MultiTurnConfig, RolloutConfig
from relay.generators.tools import (BaseTool, ToolSession, load_tools, parse_tool_calls,
                                    run_calls)
from relay.generators.workflow import (EngineHandle, Episode, EpisodeBuilder, EpisodeRow,
                                       Workflow, WorkflowError, load_workflow)
from relay.transport.messages import EpisodeStats


class ToolLoop:
    """The multi-turn workflow over ``tools`` (by name) with ``config``'s limits."""

    def __init__(self, config: MultiTurnConfig, tools: Mapping[str, BaseTool]) -> None:
        self.config, self.tools = config, dict(tools)
        self.schemas = [tool.get_openai_tool_schema().as_dict() for tool in self.tools.values()]

    def render_prompt(self, tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
        """A row's prompt with the tools' schemas (for templates that describe them)."""
        return prompt_ids(tokenizer, messages, self.schemas)

    async def __call__(self, engine: EngineHandle, row: EpisodeRow) -> Episode:
        config, tokenizer = self.config, engine.tokenizer
        builder = EpisodeBuilder(engine.response_length)
        ids, messages = list(row.prompt_ids), list(row.messages)
        stats = EpisodeStats(turns=0)
        kwargs = row.extra_info.get("tools_kwargs") if isinstance(row.extra_info, dict) else None
        async with ToolSession(self.tools, kwargs if isinstance(kwargs, dict) else None) \
                as session:
            while True:
                turn = await engine.generate(ids, max_new_tokens=builder.remaining)
                builder.sampled(turn)
                ids += turn.token_ids
                stats.turns += 1
                if turn.finish_reason == "length":
                    builder.episode.finish_reason = "length"
                    break
                text = tokenizer.decode(turn.token_ids, skip_special_tokens=True)
                messages.append({"role": "assistant", "content": text})
                calls = parse_tool_calls(text, config.format).calls if self.tools else []
                tool_turns = stats.turns - 1  # tool responses so far, one after each turn
                if not calls or _reached(stats.turns, config.max_assistant_turns) \
                        or _reached(tool_turns, config.max_user_turns):
                    break
                results = await run_calls(
                    session, calls, max_parallel_calls=config.max_parallel_calls,
                    timeout_s=config.tool_timeout_s,
                    max_response_length=config.max_tool_response_length,
                    truncate_side=config.tool_response_truncate_side)
                stats.tool_calls += len(results)
                stats.tool_failures += sum(not r.success for r in results)
                stats.tool_latencies_s += [r.latency_s for r in results]
                replies = [r.message for r in results]
                between = inserted_ids(tokenizer, messages, replies, self.schemas)
                messages += replies
                if not builder.inserted(between, engine.version) or builder.remaining < 1:
                    builder.episode.finish_reason = "length"
                    break
                ids += between
            rewards = await session.rewards()
        builder.episode.stats = stats
        builder.episode.reward_info = {f"tool/{name}": value for name, value in rewards.items()}
        return builder.episode


def _reached(count: int, limit: int | None) -> bool:
    return limit is not None and count >= limit


class ConfiguredWorkflow(msgspec.Struct, frozen=True, kw_only=True):
    """The run's rollout workflow: the function, its name for messages, and how it wants a
    row's prompt rendered (None: the generator's plain chat-template rendering)."""

    function: Workflow
    name: str
    render_prompt: Callable[[Any, list[dict[str, Any]]], list[int]] | None = None


def configured_workflow(rollout: RolloutConfig) -> ConfiguredWorkflow | None:
    """``rollout.workflow`` loaded, or the tool loop with ``rollout.multi_turn.enable`` and
    its tools (``tool_config_path``) built; None for single-turn rollouts."""
    if rollout.workflow and rollout.multi_turn.enable:
        raise WorkflowError("rollout.workflow and rollout.multi_turn.enable are both set: the "
                            "tool loop is itself a workflow; choose one")
    if rollout.workflow:
        return ConfiguredWorkflow(function=load_workflow(rollout.workflow),
                                  name=f"rollout.workflow {rollout.workflow!r}")
    if not rollout.multi_turn.enable:
        return None
    path = rollout.multi_turn.tool_config_path
    loop = ToolLoop(rollout.multi_turn, load_tools(path) if path else {})
    return ConfiguredWorkflow(function=loop, name="the multi-turn tool loop",
                              render_prompt=loop.render_prompt)
