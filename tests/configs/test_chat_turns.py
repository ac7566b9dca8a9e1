"""A conversation's token ids, turn by turn, read as its chat template renders it."""

from __future__ import annotations

import pytest

from relay.configs.chat_turns import ChatTemplateError, inserted_ids, prompt_ids
from relay.learner.tiny_model.tokenizer import build_tokenizer

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_turns_joined_read_as_the_whole_conversation(tokenizer) -> None:
    user = [{"role": "user", "content": "What is 12 * 34?"}]
    first = prompt_ids(tokenizer, user)
    sampled = tokenizer.encode(CALL, add_special_tokens=False) + [tokenizer.eos_token_id]
    conversation = [*user, {"role": "assistant", "content": CALL}]
    between = inserted_ids(tokenizer, conversation, [{"role": "tool", "content": "408"}])
    whole = tokenizer.apply_chat_template(
        [*conversation, {"role": "tool", "content": "408"}], add_generation_prompt=True,
        tokenize=False)
    assert tokenizer.decode(first + sampled + between) == whole
    assert tokenizer.decode(between).startswith("\n<|im_start|>tool\n408")


def test_a_conversation_must_end_with_the_assistant(tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="must end with the assistant"):
        inserted_ids(tokenizer, [{"role": "user", "content": "hi"}],
                     [{"role": "tool", "content": "1"}])


class _Rewriting:
    """A template that renders the last message differently from earlier ones."""

    eos_token = "</s>"

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=False,
                            tokenize=False):
        body = "".join(f"[{m['role']}]{m['content']}</s>" for m in messages[:-1])
        return body + f"[LAST {messages[-1]['role']}]{messages[-1]['content']}</s>"


def test_a_template_that_rewrites_earlier_turns_is_refused() -> None:
    with pytest.raises(ChatTemplateError, match="differently"):
        inserted_ids(_Rewriting(), [{"role": "assistant", "content": "a"}],
                     [{"role": "tool", "content": "b"}])
