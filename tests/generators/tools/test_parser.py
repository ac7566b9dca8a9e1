"""The hermes parser on what small models really emit: each row is a decoded assistant turn,
the content left once the calls are out, and each call's name and arguments (or the start
of its error)."""

from __future__ import annotations

import pytest

from relay.generators.tools.parser import MAX_CALL_CHARS, parse_tool_calls

CALC = "calculator"
WELL_FORMED = [
    ("no call at all", "The answer is 42.", "The answer is 42.", []),
    ("one call, Qwen's layout",
     'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": '
     '"12*7"}}\n</tool_call>', "Let me compute.", [(CALC, {"expression": "12*7"})]),
    ("no whitespace", '<tool_call>{"name":"calculator","arguments":{"expression":"1+1"}}'
     '</tool_call>', "", [(CALC, {"expression": "1+1"})]),
    ("spaces and blank lines inside the tags",
     '<tool_call>  \n\n  {"name": "calculator",\n  "arguments": {"expression": "2**10"}}  '
     '\n\n</tool_call>\n', "", [(CALC, {"expression": "2**10"})]),
    ("closing tag missing at the end (stop string stripped)",
     'I will check.\n<tool_call>\n{"name": "calc_gsm8k_reward", "arguments": {"answer": '
     '"72"}}\n', "I will check.", [("calc_gsm8k_reward", {"answer": "72"})]),
    ("arguments as a JSON string",
     '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"3-5\\"}"}'
     '</tool_call>', "", [(CALC, {"expression": "3-5"})]),
    ("empty arguments string", '<tool_call>{"name": "get_time", "arguments": ""}</tool_call>',
     "", [("get_time", {})]),
    ("no arguments key", '<tool_call>{"name": "get_time"}</tool_call>', "",
     [("get_time", {})]),
    ("Llama's 'parameters'", '<tool_call>{"name": "calculator", "parameters": '
     '{"expression": "9/3"}}</tool_call>', "", [(CALC, {"expression": "9/3"})]),
    ("trailing comma in arguments", '<tool_call>{"name": "calculator", "arguments": '
     '{"expression": "1+2",}}</tool_call>', "", [(CALC, {"expression": "1+2"})]),
    ("trailing commas at both levels and in a list", '<tool_call>{"name": "f", "arguments": '
     '{"xs": [1, 2, ], },\n}</tool_call>', "", [("f", {"xs": [1, 2]})]),
    ("a comma before a brace inside a string is kept",
     '<tool_call>{"name": "echo", "arguments": {"text": "a, }b \\", ]"}}</tool_call>', "",
     [("echo", {"text": 'a, }b ", ]'})]),
    ("one extra closing brace", '<tool_call>{"name": "calculator", "arguments": '
     '{"expression": "4*4"}}}</tool_call>', "", [(CALC, {"expression": "4*4"})]),
    ("a ```json fence inside the tags",
     '<tool_call>\n```json\n{"name": "calculator", "arguments": {"expression": "8%3"}}\n```\n'
     '</tool_call>', "", [(CALC, {"expression": "8%3"})]),
    ("Python dict with single quotes", "<tool_call>{'name': 'calculator', 'arguments': "
     "{'expression': '5+5', 'exact': True}}</tool_call>", "",
     [(CALC, {"expression": "5+5", "exact": True})]),
    ("two calls, prose between and after",
     'First <tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
     ' then <tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}'
     '</tool_call> done.', "First  then  done.",
     [(CALC, {"expression": "1+1"}), (CALC, {"expression": "2+2"})]),
    ("first call unclosed, second closed",
     '<tool_call>{"name": "a", "arguments": {}}\n<tool_call>{"name": "b", "arguments": {}}'
     '</tool_call>', "", [("a", {}), ("b", {})]),
    ("unicode and nested arguments", '<tool_call>{"name": "search", "arguments": {"query": '
     '"café ☕", "filters": {"year": [2020, 2021]}}}</tool_call>', "",
     [("search", {"query": "café ☕", "filters": {"year": [2020, 2021]}})]),
    ("name with spaces around it", '<tool_call>{"name": " calculator ", "arguments": '
     '{"expression": "7"}}</tool_call>', "", [(CALC, {"expression": "7"})]),
    ("unclosed, then the end-of-turn token kept by the decode",
     '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}<|im_end|>\n'
     '<|endoftext|>', "", [(CALC, {"expression": "6*7"})]),
    ("Llama's end-of-sequence token", '<tool_call>{"name": "f", "arguments": {}}</s>', "",
     [("f", {})]),
    ("OpenAI's nested function object", '<tool_call>{"type": "function", "function": '
     '{"name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}}</tool_call>', "",
     [(CALC, {"expression": "1"})]),
    ("a stray closing tag leaves the content", 'Done.</tool_call>', "Done.", []),
]


@pytest.mark.parametrize("text,content,calls", [row[1:] for row in WELL_FORMED],
                         ids=[row[0] for row in WELL_FORMED])
def test_well_formed_or_tolerated_calls_parse(text: str, content: str,
                                              calls: list[tuple[str, dict]]) -> None:
    turn = parse_tool_calls(text)
    assert turn.content == content
    assert [(call.name, call.arguments) for call in turn.calls] == calls
    assert all(call.ok for call in turn.calls), [call.error for call in turn.calls]


MALFORMED = [
    ("not JSON", "<tool_call>calculator(2+2)</tool_call>", "not JSON"),
    ("JSON cut off mid-object", '<tool_call>{"name": "calculator", "arguments": '
     '{"expression": "2+', "not JSON"),
    ("empty tags", "<tool_call>\n</tool_call>", "empty <tool_call>"),
    ("no name", '<tool_call>{"arguments": {"x": 1}}</tool_call>', "call has no 'name'"),
    ("name not a string", '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
     "call has no 'name'"),
    ("a list, not an object", '<tool_call>[{"name": "a"}]</tool_call>', "call is a list"),
    ("arguments a list", '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',
     "'arguments' is a list"),
    ("arguments a string of non-JSON", '<tool_call>{"name": "f", "arguments": "x=1"}'
     '</tool_call>', "'arguments' is a string that is not JSON"),
    ("arguments a string of a number", '<tool_call>{"name": "f", "arguments": "12"}'
     '</tool_call>', "'arguments' is a int"),
    ("text after the object", '<tool_call>{"name": "f", "arguments": {}} and more'
     '</tool_call>', "unexpected text after the JSON object"),
    ("over the size bound", "<tool_call>" + "[" * (MAX_CALL_CHARS + 1) + "</tool_call>",
     "call is"),
    ("deeply nested brackets", "<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>",
     "nested too deeply"),
    ("deeply nested and unclosed", "<tool_call>" + "(" * 5000, "not JSON"),
]


@pytest.mark.parametrize("text,error", [row[1:] for row in MALFORMED],
                         ids=[row[0] for row in MALFORMED])
def test_a_malformed_call_is_a_failed_call_not_an_exception(text: str, error: str) -> None:
    (call,) = parse_tool_calls(text).calls
    assert not call.ok
    assert call.error.startswith(error), call.error
    assert call.arguments == {}


def test_a_bad_call_does_not_hide_the_good_ones_around_it() -> None:
    turn = parse_tool_calls('<tool_call>{"name": "a", "arguments": {}}</tool_call>'
                            '<tool_call>{oops}</tool_call>'
                            '<tool_call>{"name": "b", "arguments": {"k": 1}}</tool_call>')
    assert [(call.name, call.ok) for call in turn.calls] == [("a", True), ("", False),
                                                              ("b", True)]
    assert turn.calls[1].raw == "{oops}"


def test_an_unknown_format_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match="rollout.multi_turn.format"):
        parse_tool_calls("x", format="gpt-oss")  # type: ignore[arg-type]
