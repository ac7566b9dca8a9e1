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
from relay.generators.tools import (BaseTool, ParsedCall, ToolSession, load_tools,
                                    parse_tool_calls, run_calls)
from relay.generators.tools.interaction import BaseInteraction, load_interactions
from relay.generators.workflow import (EngineHandle, Episode, EpisodeBuilder, EpisodeRow,
                                       Workflow, WorkflowError, load_workflow)
from relay.transport.messages import EpisodeStats


class ToolLoop:
    """The multi-turn workflow over ``tools`` (by name) and, with ``interactions``, verl's
    simulated users (``relay.generators.tools.interaction``), with ``config``'s limits."""

    def __init__(self, config: MultiTurnConfig, tools: Mapping[str, BaseTool],
                 interactions: Mapping[str, BaseInteraction] | None = None) -> None:
        self.config, self.tools = config, dict(tools)
        self.interactions = dict(interactions or {})
        self.schemas = [tool.get_openai_tool_schema().as_dict() for tool in self.tools.values()]

    def render_prompt(self, tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
        """A row's prompt with the tools' schemas (for templates that describe them)."""
        return prompt_ids(tokenizer, messages, self.schemas)

    async def __call__(self, engine: EngineHandle, row: EpisodeRow) -> Episode:
        tools_kwargs = _extra(row, "tools_kwargs")
        user = await _User.start(self.interactions, _extra(row, "interaction_kwargs"))
        try:
            async with ToolSession(self.tools, tools_kwargs) as session:
                episode = await self._play(engine, row, session, user)
                rewards = await session.rewards()
        finally:
            if user is not None:
                await user.finish()
        episode.reward_info = {f"tool/{name}": value for name, value in rewards.items()}
        if user is not None and user.scores:
            episode.reward_info["interaction/last_turn_score"] = user.scores[-1]
        return episode

    async def _play(self, engine: EngineHandle, row: EpisodeRow, session: ToolSession,
                    user: _User | None) -> Episode:
        """Turns until one neither calls a tool nor gets a user's reply, a limit is
        reached, or the response budget runs out."""
        config, tokenizer = self.config, engine.tokenizer
        builder = EpisodeBuilder(engine.response_length)
        ids, messages = list(row.prompt_ids), list(row.messages)
        stats = builder.episode.stats = EpisodeStats(turns=0)
        user_turns = 0  # tool responses and user replies so far
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
            if _reached(stats.turns, config.max_assistant_turns) \
                    or _reached(user_turns, config.max_user_turns):
                break
            calls = parse_tool_calls(text, config.format).calls if self.tools else []
            if calls:
                replies = await self._call_tools(session, calls, stats)
            elif user is not None:
                stop, reply = await user.reply(messages)
                if stop:
                    break
                replies = [{"role": "user", "content": reply}]
            else:
                break
            user_turns += 1
            between = inserted_ids(tokenizer, messages, replies, self.schemas)
            messages += replies
            if not builder.inserted(between, engine.version) or builder.remaining < 1:
                builder.episode.finish_reason = "length"
                break
            ids += between
        return builder.episode

    async def _call_tools(self, session: ToolSession, calls: list[ParsedCall],
                          stats: EpisodeStats) -> list[dict[str, str]]:
        """Run a turn's calls; their tool messages, counted into ``stats``."""
        config = self.config
        results = await run_calls(
            session, calls, max_parallel_calls=config.max_parallel_calls,
            timeout_s=config.tool_timeout_s,
            max_response_length=config.max_tool_response_length,
            truncate_side=config.tool_response_truncate_side)
        stats.tool_calls += len(results)
        stats.tool_failures += sum(not r.success for r in results)
        stats.tool_latencies_s += [r.latency_s for r in results]
        return [r.message for r in results]


class _User:
    """One episode's simulated user: the interaction the row names (its
    ``interaction_kwargs["name"]``, the first configured one when absent)."""

    def __init__(self, interaction: BaseInteraction, instance_id: str,
                 kwargs: dict[str, Any]) -> None:
        self.interaction, self.instance_id, self.kwargs = interaction, instance_id, kwargs
        self.scores: list[float] = []

    @classmethod
    async def start(cls, interactions: Mapping[str, BaseInteraction],
                    kwargs: dict[str, Any] | None) -> _User | None:
        if not interactions:
            return None
        kwargs = dict(kwargs or {})
        name = kwargs.get("name") or next(iter(interactions))
        if name not in interactions:
            raise KeyError(f"extra_info.interaction_kwargs.name {name!r}: no such interaction; "
                           f"the interaction config has {', '.join(interactions)}")
        interaction = interactions[name]
        return cls(interaction, await interaction.start_interaction(None, **kwargs), kwargs)

    async def reply(self, messages: list[dict[str, Any]]) -> tuple[bool, str]:
        """(stop, the user's reply) to the conversation so far."""
        stop, reply, score, _ = await self.interaction.generate_response(
            self.instance_id, messages, **self.kwargs)
        self.scores.append(float(score))
        return bool(stop), str(reply)

    async def finish(self) -> None:
        await self.interaction.finalize_interaction(self.instance_id)


def _extra(row: EpisodeRow, key: str) -> dict[str, Any] | None:
    value = row.extra_info.get(key) if isinstance(row.extra_info, dict) else None
    return value if isinstance(value, dict) else None


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
    its tools (``tool_config_path``) and simulated users (``interaction_config_path``)
    built; None for single-turn rollouts."""
    if rollout.workflow and rollout.multi_turn.enable:
        raise WorkflowError("rollout.workflow and rollout.multi_turn.enable are both set: the "
                            "tool loop is itself a workflow; choose one")
    if rollout.workflow:
        return ConfiguredWorkflow(function=load_workflow(rollout.workflow),
                                  name=f"rollout.workflow {rollout.workflow!r}")
    if not rollout.multi_turn.enable:
        return None
    multi_turn = rollout.multi_turn
    tools = load_tools(multi_turn.tool_config_path) if multi_turn.tool_config_path else {}
    interactions = load_interactions(multi_turn.interaction_config_path) \
        if multi_turn.interaction_config_path else {}
    loop = ToolLoop(multi_turn, tools, interactions)
    return ConfiguredWorkflow(function=loop, name="the multi-turn tool loop",
                              render_prompt=loop.render_prompt)
