"""Tool calls out of a decoded assistant turn, in hermes format (verl's ``format = "hermes"``).

A call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; a turn may hold
several. The parser knows text, not tokens or tools: it never checks that a name is a tool.
It accepts what small models emit, each departure from strict JSON named:

- whitespace and newlines around and inside the tags, a ```` ```json ```` fence inside,
  special tokens after the JSON (``<|im_end|>``, ``</s>``: a decode that kept them);
- a missing ``</tool_call>``: the call runs to the next ``<tool_call>`` or the end of the
  text (a stop string ``</tool_call>`` that the engine strips leaves exactly this);
- trailing commas before ``}`` or ``]`` (outside strings), extra ``}`` after the object;
- ``arguments`` given as a JSON string holding the object (``""`` is ``{}``), ``parameters``
  for ``arguments`` (Llama's name), no ``arguments`` at all (``{}``), OpenAI's nesting
  ``{"type": "function", "function": {"name": ..., "arguments": ...}}``;
- a Python dict literal (single quotes, ``True``), read with ``ast.literal_eval`` (literals
  only, never code).

Anything else (no ``name``, arguments that are not an object, text that is not JSON) is a
``ParsedCall`` with ``error`` set, so the loop answers it with an error tool message and
counts a failed call; the parser never raises on model text.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any, Literal

import msgspec

Format = Literal["hermes"]
FORMATS: tuple[str, ...] = ("hermes",)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_CALL_CHARS = 64_000
"""A call's text longer than this is refused before parsing (bounds ``literal_eval``)."""

_FENCE_OPEN = re.compile(r"```[A-Za-z]*")
_SPECIAL_TOKEN = re.compile(r"<\|[^|<>\s]*\|>|</s>")
_CALL = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|(?=" + re.escape(OPEN)
                   + r")|\Z)", re.DOTALL)


class ParsedCall(msgspec.Struct, frozen=True, kw_only=True):
    """One call as the model wrote it. ``error`` is empty for a well-formed call; otherwise
    it says why the call cannot run (``name`` and ``arguments`` are then what could be read,
    possibly empty). ``raw``: the text between the tags."""

    name: str
    arguments: dict[str, Any]
    raw: str
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


class ParsedTurn(msgspec.Struct, frozen=True, kw_only=True):
    """A turn split into its prose (``content``: the text without the calls, stripped) and
    its calls in the order written."""

    content: str
    calls: list[ParsedCall]


def parse_tool_calls(text: str, format: Format = "hermes") -> ParsedTurn:
    """Split a decoded assistant turn into content and tool calls (see the module doc)."""
    if format not in FORMATS:
        raise ValueError(f"unknown tool-call format {format!r}; valid formats: "
                         f"{', '.join(FORMATS)} (rollout.multi_turn.format)")
    calls = [_parse_call(match.group(1)) for match in _CALL.finditer(text)]
    content = _CALL.sub("", text).replace(CLOSE, "").strip()
    return ParsedTurn(content=content, calls=calls)


def _parse_call(raw: str) -> ParsedCall:
    if len(raw) > MAX_CALL_CHARS:
        return _failed(raw, f"call is {len(raw)} characters, over {MAX_CALL_CHARS}")
    body = _unwrap(raw)
    if not body:
        return _failed(raw, "empty <tool_call>")
    value, error = _load_object(body)
    if error:
        return _failed(raw, error)
    if not isinstance(value, dict):
        return _failed(raw, f"call is a {type(value).__name__}, not an object with 'name' "
                            "and 'arguments'")
    if "name" not in value and isinstance(value.get("function"), dict):
        value = value["function"]
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        return _failed(raw, "call has no 'name' string")
    name = name.strip()
    arguments, error = _arguments(value)
    if error:
        return ParsedCall(name=name, arguments={}, raw=raw, error=error)
    return ParsedCall(name=name, arguments=arguments, raw=raw)


def _unwrap(raw: str) -> str:
    """The call's text without surrounding whitespace, special tokens after it and a code
    fence around it (string operations: no regex backtracks over long whitespace)."""
    body = raw.strip()
    while True:
        tail = max(body.rfind("<|"), body.rfind("</s>"))
        if tail < 0 or not _SPECIAL_TOKEN.fullmatch(body, tail):
            break
        body = body[:tail].rstrip()
    fence = _FENCE_OPEN.match(body)
    if fence:
        body = body[fence.end():].lstrip()
    if body.endswith("```"):
        body = body[:-3].rstrip()
    return body


def _arguments(call: dict[str, Any]) -> tuple[dict[str, Any], str]:
    key = "arguments" if "arguments" in call else "parameters"
    arguments = call.get(key, {})
    if isinstance(arguments, str):
        if not arguments.strip():
            return {}, ""
        arguments, error = _load_object(arguments)
        if error:
            return {}, f"'{key}' is a string that is not JSON: {error}"
    if not isinstance(arguments, dict):
        return {}, f"'{key}' is a {type(arguments).__name__}, not an object"
    return arguments, ""


def _load_object(text: str) -> tuple[Any, str]:
    """The JSON value ``text`` holds (tolerances of the module doc), or an error message."""
    cleaned = _drop_trailing_commas(text.strip())
    try:
        value, end = json.JSONDecoder().raw_decode(cleaned)
    except RecursionError:
        return None, "nested too deeply"
    except json.JSONDecodeError as exc:
        try:  # literal_eval takes trailing commas itself, and knows single quotes
            return ast.literal_eval(text.strip()), ""
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return None, f"not JSON: {exc.msg} at character {exc.pos}"
    rest = cleaned[end:].strip()
    if rest.strip("}"):
        return None, f"unexpected text after the JSON object: {rest[:40]!r}"
    return value, ""


def _drop_trailing_commas(text: str) -> str:
    """``text`` without the commas (outside double-quoted strings) that only whitespace
    separates from a following ``}`` or ``]``."""
    out: list[str] = []
    in_string = escaped = False
    for i, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char == ",":
            j = i + 1
            while j < len(text) and text[j].isspace():
                j += 1
            if j < len(text) and text[j] in "}]":
                continue
        out.append(char)
    return "".join(out)


def _failed(raw: str, error: str) -> ParsedCall:
    return ParsedCall(name="", arguments={}, raw=raw, error=error)
