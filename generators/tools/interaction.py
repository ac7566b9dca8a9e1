"""Simulated users for multi-turn episodes, in verl's schema (``rollout.multi_turn.
interaction_config_path``)::

    interaction:
      - name: "gsm8k"                                   # rows pick it by name
        class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"   # or yours
        config: {}

An interaction has verl's async interface: ``start_interaction(instance_id, **kwargs)``
once per episode with the row's ``extra_info.interaction_kwargs`` (whose ``name`` picks the
interaction, the first one when absent), ``generate_response(instance_id, messages,
**kwargs) -> (should_terminate, response, turn_score, metrics)`` after each assistant turn
that called no tool, ``calculate_score`` and ``finalize_interaction(instance_id)`` at the
end. The multi-turn loop (``relay.generators.tool_loop``) inserts the response as a user
message and lets the policy answer again, until the interaction says to stop or
``max_user_turns`` is reached. ``class_name`` is a dotted path (verl's) or a Relay spec
(``module:Class``, ``file.py:Class``); verl's ``Gsm8kInteraction`` runs as Relay's, with a
logged note. Every error names the file, the entry (``interaction[i]``) and the key.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from relay.algorithms.rewards.gsm8k import compute_score
from relay.algorithms.user_code import describe
from relay.generators.tools.loader import ToolConfigError, load_class, read_yaml

VERL_BUILTINS: dict[str, str] = {
    "verl.interactions.gsm8k_interaction.Gsm8kInteraction":
        "relay.generators.tools.interaction:Gsm8kInteraction",
}
"""verl's class path -> the Relay built-in that runs in its place."""

_ENTRY_KEYS = {"name", "class_name", "config"}


class BaseInteraction:
    """verl's ``BaseInteraction``: a simulated user's side of an episode (module docstring)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.name: str = config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        return instance_id or str(uuid.uuid4())

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs: Any) -> tuple[bool, str, float, dict[str, Any]]:
        """(should_terminate, response, turn_score, metrics) after an assistant turn."""
        return False, "Your current result seems acceptable.", 0.8, {}

    async def calculate_score(self, *args: Any, **kwargs: Any) -> float:
        return 0.0

    async def finalize_interaction(self, *args: Any, **kwargs: Any) -> None:
        pass


class Gsm8kInteraction(BaseInteraction):
    """verl's GSM8K user: says whether the last assistant answer (read with GSM8K's
    flexible rule, ``#### `` prefixed) matches ``ground_truth``; stops the episode once it
    does, else asks the model to reflect and try again. The turn score is 1 or 0."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self._ground_truth: dict[str, str] = {}

    async def start_interaction(self, instance_id: str | None = None,
                                ground_truth: str | None = None, **kwargs: Any) -> str:
        instance_id = instance_id or str(uuid.uuid4())
        self._ground_truth[instance_id] = str(ground_truth)
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs: Any) -> tuple[bool, str, float, dict[str, Any]]:
        answer = next((m.get("content") or "" for m in reversed(messages)
                       if m.get("role") == "assistant"), "")
        text = answer if answer.startswith("#### ") else f"#### {answer}"
        score = compute_score(text, self._ground_truth[instance_id], method="flexible")["score"]
        if score == 1.0:
            return True, "Your response is correct!", 1.0, {}
        return (False, "Your response is incorrect! You need to reflect on your answer and "
                       "try again.", 0.0, {})

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        self._ground_truth.pop(instance_id, None)


def load_interactions(path: str | Path) -> dict[str, BaseInteraction]:
    """Build every interaction the YAML at ``path`` lists, by name in the file's order."""
    path = Path(path)
    document = read_yaml(path, "interaction config")
    entries = document.get("interaction") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ToolConfigError(f"{path}: expected a mapping with a non-empty 'interaction' list "
                              "(interaction: - name: ..., class_name: ..., config: ...)")
    interactions: dict[str, BaseInteraction] = {}
    for index, entry in enumerate(entries):
        where = f"{path}: interaction[{index}]"
        interaction = _build(entry, where)
        if interaction.name in interactions:
            raise ToolConfigError(f"{where}.name: {interaction.name!r} is already used")
        interactions[interaction.name] = interaction
    return interactions


def _build(entry: Any, where: str) -> BaseInteraction:
    if not isinstance(entry, dict):
        raise ToolConfigError(f"{where}: expected a mapping with name, class_name and config, "
                              f"got a {type(entry).__name__}")
    unknown = sorted(set(entry) - _ENTRY_KEYS)
    if unknown:
        raise ToolConfigError(f"{where}: unknown keys {unknown}; valid keys: "
                              f"{', '.join(sorted(_ENTRY_KEYS))}")
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise ToolConfigError(f"{where}.config: expected a mapping, got a "
                              f"{type(config).__name__}")
    name = entry.get("name")
    if name is not None and (not isinstance(name, str) or not name):
        raise ToolConfigError(f"{where}.name: expected a non-empty string, got {name!r}")
    cls = _interaction_class(entry.get("class_name"), f"{where}.class_name")
    try:
        interaction = cls({**config, **({"name": name} if name else {})})
    except Exception as exc:  # a user's constructor: report whatever it raised
        raise ToolConfigError(f"{where}: {cls.__name__}(config) raised {describe(exc)}") from exc
    return interaction


def _interaction_class(class_name: Any, where: str) -> type[BaseInteraction]:
    return load_class(class_name, where, builtins=VERL_BUILTINS, base=BaseInteraction,
                      what="interaction",
                      interface="relay.generators.tools.interaction.BaseInteraction (verl's "
                                "interface: start_interaction, generate_response, "
                                "calculate_score, finalize_interaction)")
