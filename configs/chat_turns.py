"""A chat's token ids turn by turn, as its chat template renders the whole conversation.

A multi-turn episode is one token sequence: the prompt, then each assistant turn as the
policy sampled it (ending with eos), then the tokens the chat template puts between that
turn and the next assistant turn (the end of the assistant's line, the tool or user
messages, the next generation prompt). ``inserted_ids`` computes those in-between tokens
from the template itself:

    before   = render(messages)                                      (ends with the assistant turn)
    after    = render(messages + new_messages, add_generation_prompt)
    inserted = tokens(text of ``before`` after its last eos  +  after[len(before):])

so the sequence reads exactly as the template renders the conversation, whichever template
(ChatML, Llama 3, the tiny model's) the tokenizer carries. The policy's own tokens are never
re-tokenized. The supervised warm start of a tool-using model builds its sequences with
the same functions, so that it trains on what the generators will produce.

This module knows chat templates and token ids, nothing of engines or tools.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Message = Mapping[str, Any]


class ChatTemplateError(ValueError):
    """The tokenizer's chat template does not render a conversation turn by turn."""


def prompt_ids(tokenizer: Any, messages: Sequence[Message],
               tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
    """The first prompt: ``messages`` rendered with the generation prompt (and ``tools``,
    OpenAI function schemas, for templates that describe them)."""
    return list(tokenizer.apply_chat_template(list(messages), tools=_tools(tools),
                                              add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def inserted_ids(tokenizer: Any, messages: Sequence[Message], new_messages: Sequence[Message],
                 tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
    """The token ids between the assistant turn that ends ``messages`` (sampled up to and
    including eos) and the next assistant turn, with ``new_messages`` (tool results, a
    user's reply) in between; see the module docstring.

    Raises ``ChatTemplateError`` when ``messages`` does not end with an assistant message,
    when the template renders the longer conversation with a different beginning, or when
    the rendered turn has no eos token."""
    if not messages or messages[-1].get("role") != "assistant":
        raise ChatTemplateError("inserted_ids: the conversation must end with the assistant "
                                "turn the policy just sampled")
    eos = tokenizer.eos_token
    if not eos:
        raise ChatTemplateError("the tokenizer has no eos token; a turn cannot end")
    before = _render(tokenizer, messages, tools, generation_prompt=False)
    after = _render(tokenizer, [*messages, *new_messages], tools, generation_prompt=True)
    if not after.startswith(before):
        raise ChatTemplateError(
            "the chat template renders the conversation differently once more messages follow "
            "(it rewrites earlier turns), so a multi-turn episode cannot be one token sequence; "
            f"first difference at character {_first_difference(before, after)}")
    end = before.rfind(eos)
    if end < 0:
        raise ChatTemplateError(f"the chat template does not end an assistant turn with the eos "
                                f"token {eos!r}")
    text = before[end + len(eos):] + after[len(before):]
    return list(tokenizer.encode(text, add_special_tokens=False))


def _render(tokenizer: Any, messages: Sequence[Message], tools: Any,
            generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tools=_tools(tools),
                                         add_generation_prompt=generation_prompt,
                                         tokenize=False)


def _tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    return [dict(t) for t in tools] if tools else None


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
