"""Tool calls for multi-turn rollouts, in verl's schema: parse a turn's calls
(``parser``), the tool interface and its YAML (``base``, ``schema``, ``loader``), the
built-in tools (``calculator``, ``gsm8k``, ``code_interpreter``), and running a turn's
calls within an episode's instances (``session``, ``calls``). It knows text and tools,
not tokens, engines or the loss mask: the multi-turn loop owns those.
"""

from relay.generators.tools.base import BaseTool
from relay.generators.tools.calls import CallResult, run_calls, truncate_text
from relay.generators.tools.loader import ToolConfigError, load_tools
from relay.generators.tools.parser import ParsedCall, ParsedTurn, parse_tool_calls
from relay.generators.tools.schema import ToolResponse, ToolSchema
from relay.generators.tools.session import ToolSession

__all__ = ["BaseTool", "CallResult", "ParsedCall", "ParsedTurn", "ToolConfigError",
           "ToolResponse", "ToolSchema", "ToolSession", "load_tools", "parse_tool_calls",
           "run_calls", "truncate_text"]
