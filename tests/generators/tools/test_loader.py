"""Tools from verl's tool YAML: the shipped examples, a user's class by dotted path and by
file, verl's built-in class paths, and errors that name the file, the entry and the key."""

from __future__ import annotations

import logging
import sys
import textwrap
from pathlib import Path

import pytest

from relay.generators.tools.calculator import CalculatorTool
from relay.generators.tools.code_interpreter import CodeInterpreterTool
from relay.generators.tools.gsm8k import Gsm8kTool
from relay.generators.tools.loader import ToolConfigError, load_tools

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "tools"
USER_TOOL = '''
from relay.generators.tools import BaseTool

class EchoTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return parameters["text"] * self.config["times"], 0.0, {}

class NotATool:
    def __init__(self, config, tool_schema):
        pass
'''
ECHO_SCHEMA = """
    tool_schema:
      type: function
      function:
        name: echo
        description: Repeat the text.
        parameters:
          type: object
          properties: {text: {type: string, description: what to repeat}}
          required: [text]
"""


def write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "tools.yaml"
    path.write_text(textwrap.dedent(body))
    return path


def test_the_shipped_calculator_yaml_loads_relays_calculator() -> None:
    (tool,) = load_tools(CONFIGS / "calculator.yaml").values()
    assert isinstance(tool, CalculatorTool)
    assert tool.name == "calculator"
    assert tool.tool_schema.as_dict()["function"]["parameters"]["required"] == ["expression"]


def test_verls_gsm8k_yaml_runs_relays_gsm8k_tool_with_a_note(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="relay.generators.tools.loader"):
        (tool,) = load_tools(CONFIGS / "gsm8k.yaml").values()
    assert isinstance(tool, Gsm8kTool)
    assert tool.config == {"type": "native"}
    assert ("verl's verl.tools.gsm8k_tool.Gsm8kTool runs as Relay's "
            "relay.generators.tools.gsm8k.Gsm8kTool") in caplog.text
    # verl's schema as the chat template gets it: exactly what the YAML wrote
    assert tool.tool_schema.as_dict() == {"type": "function", "function": {
        "name": "calc_gsm8k_reward",
        "description": Gsm8kTool.default_schema.function.description,
        "parameters": {"type": "object", "properties": {"answer": {
            "type": "string", "description": "The model's answer to the GSM8K math problem, "
                                             "must be a digits"}},
                       "required": ["answer"]}}}


def test_verls_sandbox_fusion_class_runs_relays_code_interpreter(tmp_path: Path) -> None:
    path = write(tmp_path, """
        tools:
          - class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool
            config: {type: native, default_timeout: 7, memory_limit_mb: 512}
        """)
    (tool,) = load_tools(path).values()
    assert isinstance(tool, CodeInterpreterTool)
    assert tool.name == "code_interpreter"  # its default schema: the YAML gave none
    assert tool.limits.wall_s == 7 and tool.limits.memory_mb == 512


@pytest.mark.parametrize("spec", ["{module}.EchoTool", "{file}:EchoTool"])
def test_a_users_tool_class_loads_by_dotted_path_or_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: str) -> None:
    (tmp_path / "my_echo_tools.py").write_text(USER_TOOL)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_echo_tools", raising=False)
    class_name = spec.format(module="my_echo_tools", file=tmp_path / "my_echo_tools.py")
    path = write(tmp_path, textwrap.dedent(f"""
        tools:
          - class_name: "{class_name}"
            config: {{type: native, times: 2}}
        """) + ECHO_SCHEMA)
    (tool,) = load_tools(path).values()
    assert type(tool).__name__ == "EchoTool"
    assert tool.config == {"type": "native", "times": 2}
    assert tool.name == "echo"


BAD = [
    ("not a mapping", "- 1\n", "expected a mapping with a 'tools' list"),
    ("not YAML", "tools: [\n", "not valid YAML"),
    ("an entry not a mapping", "tools: [3]\n", "tools[0]: expected a mapping"),
    ("an unknown key", "tools:\n  - class_name: a.B\n    schema: {}\n",
     "tools[0]: unknown keys ['schema']"),
    ("no class_name", "tools:\n  - config: {type: native}\n",
     "tools[0].class_name: expected a class path"),
    ("a class path without a module", "tools:\n  - class_name: Calculator\n",
     "tools[0].class_name: 'Calculator' is not a class path"),
    ("a missing module", "tools:\n  - class_name: no_such_pkg.Tool\n",
     "tools[0].class_name: tool class 'no_such_pkg:Tool': module 'no_such_pkg' not found"),
    ("a missing class", "tools:\n  - class_name: relay.generators.tools.calculator.Nope\n",
     "has no attribute 'Nope'"),
    ("not a BaseTool", "tools:\n  - class_name: relay.generators.tools.calculator.evaluate\n",
     "tools[0].class_name: relay.generators.tools.calculator.evaluate is not a subclass"),
    ("an MCP tool", "tools:\n  - class_name: a.B\n    config: {type: mcp}\n",
     "tools[0].config.type: 'mcp' is not supported"),
    ("config not a mapping", "tools:\n  - class_name: a.B\n    config: [1]\n",
     "tools[0].config: expected a mapping"),
    ("a schema with an unknown field",
     "tools:\n  - class_name: relay.generators.tools.calculator.CalculatorTool\n"
     "    tool_schema: {type: function, function: {name: c, descripton: x}}\n",
     "tools[0].tool_schema: Object contains unknown field `descripton` - at `$.function`"),
    ("required names not in properties",
     "tools:\n  - class_name: relay.generators.tools.calculator.CalculatorTool\n"
     "    tool_schema: {type: function, function: {name: c, description: x, parameters: "
     "{type: object, properties: {}, required: [expression]}}}\n",
     "required names ['expression'] are not in properties"),
    ("two tools with one name",
     "tools:\n  - class_name: relay.generators.tools.calculator.CalculatorTool\n"
     "  - class_name: relay.generators.tools.calculator.CalculatorTool\n",
     "tools[1].tool_schema.function.name: tool name 'calculator' is already used by tools[0]"),
    ("a constructor that raises",
     "tools:\n  - class_name: relay.generators.tools.code_interpreter.CodeInterpreterTool\n"
     "    config: {type: native, default_language: cpp}\n",
     "tools[0]: CodeInterpreterTool(config, tool_schema) raised ValueError: "),
]


@pytest.mark.parametrize("body,message", [row[1:] for row in BAD], ids=[r[0] for r in BAD])
def test_a_bad_tool_yaml_names_the_file_entry_and_key(tmp_path: Path, body: str,
                                                      message: str) -> None:
    path = write(tmp_path, body)
    with pytest.raises(ToolConfigError) as raised:
        load_tools(path)
    assert str(raised.value).startswith(f"{path}:")
    assert message in str(raised.value)


def test_tools_come_by_name_in_the_files_order(tmp_path: Path) -> None:
    path = write(tmp_path, """
        tools:
          - class_name: relay.generators.tools.gsm8k.Gsm8kTool
          - class_name: relay.generators.tools.calculator.CalculatorTool
        """)
    assert list(load_tools(path)) == ["calc_gsm8k_reward", "calculator"]


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ToolConfigError, match="cannot read the tool config"):
        load_tools(tmp_path / "absent.yaml")
