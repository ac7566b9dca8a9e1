"""Tool schemas and responses: verl's shapes, typed; multimodal responses refused by name."""

from __future__ import annotations

import asyncio

import pytest

from relay.generators.tools.base import BaseTool
from relay.generators.tools.schema import ToolResponse, ToolSchema, ToolSchemaError


def test_a_schema_keeps_the_users_json_schema_properties_unchanged() -> None:
    given = {"type": "function", "function": {
        "name": "search", "description": "Search.", "strict": True,
        "parameters": {"type": "object", "required": ["query"], "properties": {
            "query": {"type": "string", "minLength": 1},
            "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}}}}}}
    assert ToolSchema.parse(given).as_dict() == given


def test_a_schema_without_parameters_renders_without_them_as_verls_does() -> None:
    schema = ToolSchema.parse({"type": "function", "function": {"name": "now",
                                                                "description": "Time."}})
    assert schema.as_dict() == {"type": "function", "function": {"name": "now",
                                                                 "description": "Time."}}
    assert schema.function.parameters.properties == {}


@pytest.mark.parametrize("value,message", [
    ({"type": "retrieval", "function": {"name": "a", "description": ""}}, "$.type"),
    ({"type": "function", "function": {"name": " ", "description": ""}}, "name is empty"),
    ({"type": "function"}, "missing required field `function`"),
])
def test_a_bad_schema_names_the_field(value: dict, message: str) -> None:
    with pytest.raises(ToolSchemaError, match=message.replace("$", r"\$")):
        ToolSchema.parse(value)


@pytest.mark.parametrize("field", ["image", "video"])
def test_a_multimodal_response_is_refused_naming_the_field(field: str) -> None:
    with pytest.raises(ValueError, match=f"ToolResponse.{field}: Relay's tool responses are "
                                         "text only"):
        ToolResponse(text="x", **{field: [object()]})
    with pytest.raises(ValueError, match=f"ToolResponse.{field}"):
        ToolResponse.of({"text": "x", field: [1]})


@pytest.mark.parametrize("value,text", [("hi", "hi"), (None, ""), ({"text": "t"}, "t"),
                                        (ToolResponse(text="r"), "r")])
def test_what_execute_may_return_as_a_response(value: object, text: str) -> None:
    assert ToolResponse.of(value).text == text


def test_a_response_of_another_type_is_refused() -> None:
    with pytest.raises(ValueError, match="not a int"):
        ToolResponse.of(3)


def test_base_tool_has_verls_async_interface_and_needs_a_schema() -> None:
    with pytest.raises(ValueError, match="BaseTool has no tool_schema"):
        BaseTool({}, None)
    schema = ToolSchema.parse({"type": "function", "function": {"name": "t",
                                                                "description": "d"}})
    tool = BaseTool({"type": "native"}, schema)
    assert tool.name == "t" and tool.get_openai_tool_schema() is schema

    async def lifecycle() -> tuple[str, float]:
        instance_id, response = await tool.create("episode-1")
        assert response == ToolResponse()
        with pytest.raises(NotImplementedError, match="BaseTool.execute"):
            await tool.execute(instance_id, {})
        reward = await tool.calc_reward(instance_id)
        await tool.release(instance_id)
        return instance_id, reward

    assert asyncio.run(lifecycle()) == ("episode-1", 0.0)
