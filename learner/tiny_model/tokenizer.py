"""The tiny model's tokenizer: byte-level BPE over the arithmetic task's text, ChatML chat.

- Digits are always single tokens (``Digits(individual_digits=True)`` runs before the
  byte-level split), so numbers of any length share ten embeddings.
- Byte-level BPE never meets an unknown character: any text encodes and decodes exactly,
  only less compactly outside the task's vocabulary.
- ``<answer>`` and ``</answer>`` are single, *non-special* added tokens: short responses,
  and ``decode(..., skip_special_tokens=True)`` keeps them for the reward function.
- ``<|im_start|>``/``<|im_end|>`` frame chat turns (``<|im_end|>`` is eos); ``<|endoftext|>``
  pads. No BOS token and no default system prompt: prompts stay a couple of dozen tokens.

The BPE merges are learned from a fixed corpus (the role names and the questions of the
first problems of the seed-0 training stream), so the tokenizer is the same on every build
whatever the model seed.

``build_tools_tokenizer`` is the tool-using variant's (``builtin:tiny-arith-tools``): the
same construction over the agentic task's text (``relay.algorithms.tasks.arithmetic_tools``),
with ``<tool_call>``, ``</tool_call>`` and the hermes JSON skeleton of a calculator call
(``TOOL_CALL_PREFIX``) as further non-special added tokens, so a whole call
``<tool_call>{"name": "calculator", "arguments": {"expression": "123 * 456"}}</tool_call>``
is 12 tokens. Its template is the same ChatML, which renders the tool message as
``<|im_start|>tool\n18095<|im_end|>\n``. This module knows text and token ids, nothing of
models.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from relay.algorithms.tasks import arithmetic, arithmetic_tools

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|endoftext|>"
ANSWER_TAGS = ("<answer>", "</answer>")
TOOL_CALL_PREFIX = '{"name": "calculator", "arguments": {"expression": "'
TOOL_TOKENS = ("<tool_call>", "</tool_call>", TOOL_CALL_PREFIX)
VOCAB_SIZE = 320  # a cap: the corpus supports fewer merges (283 tokens in all)
TOOLS_VOCAB_SIZE = 400  # a cap, with room for the merges of a call's JSON close ('"}}')
CORPUS_PROBLEMS = 1000

# ChatML, as in Qwen2 but without a default system message.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on the task corpus and wrap it with eos, pad and chat template."""
    return _build(_corpus(), ANSWER_TAGS, VOCAB_SIZE)


def build_tools_tokenizer() -> PreTrainedTokenizerFast:
    """The tool-using variant's tokenizer (module docstring): BPE over the agentic task's
    transcripts, plus the tool-call tokens."""
    return _build(_tools_corpus(), ANSWER_TAGS + TOOL_TOKENS, TOOLS_VOCAB_SIZE)


def builtin_tokenizer(name: str) -> PreTrainedTokenizerFast:
    """The tokenizer of the ``builtin:`` model ``name`` (``tiny-arith`` or
    ``tiny-arith-tools``), as built without its weights; ``ValueError`` for another name."""
    builders = {"tiny-arith": build_tokenizer, "tiny-arith-tools": build_tools_tokenizer}
    if name not in builders:
        raise ValueError(f"unknown built-in model {name!r}; known: {', '.join(builders)}")
    return builders[name]()


def _build(corpus: list[str], added: Sequence[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in added])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=256,
    )


def _corpus() -> list[str]:
    # The text between the special and answer tokens, which are atomic and need no merges:
    # role names, questions and answers in every style the warm start writes.
    problems = itertools.islice(arithmetic.iter_problems(seed=0, split="train"), CORPUS_PROBLEMS)
    return [f"system\nuser\n{problem.question}\nassistant\n"
            f"{problem.response_in(index % len(arithmetic.ANSWER_STYLES))}"
            for index, problem in enumerate(problems)]


def _tools_corpus() -> list[str]:
    # Both routes' text between the added tokens (which the trainer must not see: they are
    # atomic once added): roles, questions, a call's expression and JSON close, tool
    # results and answers.
    problems = itertools.islice(arithmetic_tools.iter_problems(seed=0, split="train"),
                                CORPUS_PROBLEMS)
    return [f"system\nuser\n{problem.question}\nassistant\n{problem.expression}\"}}}}\n"
            f"tool\n{problem.tool_result}\nassistant\n{problem.answer}"
            for problem in problems]
