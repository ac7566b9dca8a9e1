"""A tool's OpenAI function schema and what a tool call gives back, as verl types them.

``ToolSchema`` is what the chat template's ``tools=`` argument receives (``as_dict``):
``{"type": "function", "function": {"name", "description", "parameters": {"type":
"object", "properties": {...}, "required": [...]}}}``. A property is kept as the JSON
Schema the user wrote (``items``, ``enum``, ``minimum``... pass through to the template
unchanged), where verl's pydantic model keeps only ``type``, ``description`` and ``enum``.

``ToolResponse`` is text only: verl's ``image`` / ``video`` fields are refused, naming the
field, since Relay's engines take no images.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class ToolSchemaError(ValueError):
    """A tool schema that does not decode; the message names the field."""


class FunctionParameters(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The arguments' JSON Schema: an object with named properties."""

    type: Literal["object"] = "object"
    properties: dict[str, dict[str, Any]] = {}
    required: list[str] = []

    def __post_init__(self) -> None:
        unknown = [name for name in self.required if name not in self.properties]
        if unknown:
            raise ValueError(f"required names {unknown} are not in properties "
                             f"({', '.join(self.properties) or 'none'})")


class FunctionSchema(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
                     omit_defaults=True):
    """The function a tool exposes to the model. Defaults are left out of ``as_dict`` (as
    verl's ``exclude_unset`` does), so the rendered prompt matches verl's."""

    name: str
    description: str
    parameters: FunctionParameters = FunctionParameters()
    strict: bool = False

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise ValueError("name is empty")


class ToolSchema(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """verl's ``OpenAIFunctionToolSchema``."""

    type: Literal["function"] = "function"
    function: FunctionSchema

    @property
    def name(self) -> str:
        return self.function.name

    def as_dict(self) -> dict[str, Any]:
        """The schema as plain data, for a chat template's ``tools=``."""
        return msgspec.to_builtins(self)

    @classmethod
    def parse(cls, value: Any) -> ToolSchema:
        """A schema from plain data (a YAML mapping), or ``ToolSchemaError`` naming the field."""
        try:
            return msgspec.convert(value, cls)
        except (msgspec.ValidationError, ValueError) as exc:
            raise ToolSchemaError(str(exc)) from exc


class ToolResponse(msgspec.Struct, frozen=True, kw_only=True):
    """What a tool call gives the model: text. ``image`` / ``video`` (verl's multimodal
    fields) must stay None."""

    text: str = ""
    image: list[Any] | None = None
    video: list[Any] | None = None

    def __post_init__(self) -> None:
        for field in ("image", "video"):
            if getattr(self, field) is not None:
                raise ValueError(f"ToolResponse.{field}: Relay's tool responses are text only "
                                 "(verl's multimodal tool responses are not supported); "
                                 "return ToolResponse(text=...)")

    @classmethod
    def of(cls, value: Any) -> ToolResponse:
        """What a tool's ``execute`` returned as its response (a ``ToolResponse``, a string,
        None for no text, or a mapping with verl's keys), or ``ValueError`` saying why not."""
        if isinstance(value, ToolResponse):
            return value
        if value is None:
            return cls()
        if isinstance(value, str):
            return cls(text=value)
        if isinstance(value, dict):
            unknown = set(value) - {"text", "image", "video"}
            if unknown:
                raise ValueError(f"tool response has unknown keys {sorted(unknown)}; "
                                 "expected text (image and video are refused)")
            text = value.get("text")
            if text is not None and not isinstance(text, str):
                raise ValueError(f"tool response text is a {type(text).__name__}, not a str")
            return cls(text=text or "", image=value.get("image"), video=value.get("video"))
        raise ValueError(f"a tool response is a ToolResponse or a str, not a "
                         f"{type(value).__name__}")
