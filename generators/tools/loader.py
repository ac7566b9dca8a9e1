"""Tools from verl's tool YAML (``rollout.multi_turn.tool_config_path``)::

    tools:
      - class_name: "my_pkg.tools.MyTool"     # or "path/to/file.py:MyTool", or verl's
        config: {type: native, ...}           # given to the tool as a dict
        tool_schema: {type: function, function: {name, description, parameters}}

``class_name`` is a dotted path (verl's form) or a Relay spec (``module:Class``,
``file.py:Class``), loaded with ``relay.algorithms.user_code``; the class must subclass
``relay.generators.tools.BaseTool``. verl's built-in class paths (``VERL_BUILTINS``) run
as Relay's built-ins, with a logged note. ``config.type`` is ``native`` (the default);
verl's ``mcp`` tools are refused. ``tool_schema`` may be left out when the class has a
``default_schema``. Every error names the file, the entry (``tools[i]``) and the key.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, TypeVar

from relay.algorithms.user_code import describe, is_spec, load_function
from relay.generators.tools.base import BaseTool
from relay.generators.tools.schema import ToolSchema, ToolSchemaError

logger = logging.getLogger(__name__)
T = TypeVar("T")

VERL_BUILTINS: dict[str, str] = {
    "verl.tools.gsm8k_tool.Gsm8kTool": "relay.generators.tools.gsm8k:Gsm8kTool",
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool":
        "relay.generators.tools.code_interpreter:CodeInterpreterTool",
}
"""verl's class path -> the Relay built-in that runs in its place."""

_ENTRY_KEYS = {"class_name", "config", "tool_schema"}


class ToolConfigError(ValueError):
    """A tool YAML that cannot be loaded; the message names the file, entry and key."""


def load_tools(path: str | Path) -> dict[str, BaseTool]:
    """Build every tool the YAML at ``path`` lists, by tool name in the file's order (the
    order of the chat template's ``tools=``); names must be unique."""
    path = Path(path)
    tools: dict[str, BaseTool] = {}
    for index, entry in enumerate(_read_entries(path)):
        where = f"{path}: tools[{index}]"
        tool = _build(entry, where)
        if tool.name in tools:
            raise ToolConfigError(f"{where}.tool_schema.function.name: tool name "
                                  f"{tool.name!r} is already used by "
                                  f"tools[{list(tools).index(tool.name)}]")
        tools[tool.name] = tool
    return tools


def read_yaml(path: Path, what: str = "tool config") -> Any:
    """The YAML document at ``path``; ``ToolConfigError`` naming the file (and ``what`` it
    should be) when it cannot be read or parsed."""
    try:
        import yaml  # PyYAML: verl's tool configs are YAML
    except ModuleNotFoundError as exc:
        raise ToolConfigError(f"{path}: reading a {what} needs PyYAML "
                              "(pip install pyyaml)") from exc
    try:
        return yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ToolConfigError(f"{path}: cannot read the {what}: {describe(exc)}") from exc
    except yaml.YAMLError as exc:
        raise ToolConfigError(f"{path}: not valid YAML: {exc}") from exc


def _read_entries(path: Path) -> list[Any]:
    document = read_yaml(path)
    if not isinstance(document, dict) or not isinstance(document.get("tools"), list):
        raise ToolConfigError(f"{path}: expected a mapping with a 'tools' list "
                              "(tools: - class_name: ..., config: ..., tool_schema: ...)")
    return document["tools"]


def _build(entry: Any, where: str) -> BaseTool:
    if not isinstance(entry, dict):
        raise ToolConfigError(f"{where}: expected a mapping with class_name, config and "
                              f"tool_schema, got a {type(entry).__name__}")
    unknown = sorted(set(entry) - _ENTRY_KEYS)
    if unknown:
        raise ToolConfigError(f"{where}: unknown keys {unknown}; valid keys: "
                              f"{', '.join(sorted(_ENTRY_KEYS))}")
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise ToolConfigError(f"{where}.config: expected a mapping, got a "
                              f"{type(config).__name__}")
    kind = config.get("type", "native")
    if kind != "native":
        raise ToolConfigError(f"{where}.config.type: {kind!r} is not supported; only "
                              "'native' (verl's MCP tools are not supported)")
    schema = None
    if entry.get("tool_schema") is not None:
        try:
            schema = ToolSchema.parse(entry["tool_schema"])
        except ToolSchemaError as exc:
            raise ToolConfigError(f"{where}.tool_schema: {exc}") from exc
    cls = _tool_class(entry.get("class_name"), f"{where}.class_name")
    try:
        return cls(config=dict(config), tool_schema=schema)
    except Exception as exc:  # a user's constructor: report whatever it raised
        raise ToolConfigError(f"{where}: {cls.__name__}(config, tool_schema) raised "
                              f"{describe(exc)}") from exc


def _tool_class(class_name: Any, where: str) -> type[BaseTool]:
    return load_class(class_name, where, builtins=VERL_BUILTINS, base=BaseTool,
                      what="tool", interface="relay.generators.tools.BaseTool (verl's "
                                              "BaseTool interface: create, execute, "
                                              "calc_reward, release)")


def load_class(class_name: Any, where: str, *, builtins: dict[str, str], base: type[T],
               what: str, interface: str) -> type[T]:
    """The subclass of ``base`` that ``class_name`` names: a dotted path (verl's form, or
    one of verl's ``builtins``, which runs as Relay's with a logged note) or a Relay spec
    (``module:Class``, ``file.py:Class``). ``ToolConfigError`` naming ``where`` otherwise."""
    if not isinstance(class_name, str) or not class_name.strip():
        raise ToolConfigError(f"{where}: expected a class path such as "
                              "'my_pkg.module.MyClass' or 'path/to/file.py:MyClass'")
    spec = builtins.get(class_name)
    if spec is not None:
        logger.warning("%s %s: verl's %s runs as Relay's %s", what, where, class_name,
                       spec.replace(":", "."))
    elif is_spec(class_name):
        spec = class_name
    else:
        module, _, name = class_name.rpartition(".")
        if not module:
            raise ToolConfigError(f"{where}: {class_name!r} is not a class path; expected "
                                  "'module.Class' or 'path/to/file.py:Class'")
        spec = f"{module}:{name}"
    cls = load_function(spec, f"{where}: {what} class", ToolConfigError)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ToolConfigError(f"{where}: {class_name} is not a subclass of {interface}")
    return cls
