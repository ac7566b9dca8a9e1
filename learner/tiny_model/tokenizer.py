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
whatever the model seed. This module knows text and token ids, nothing of models.
"""

from __future__ import annotations

import itertools

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from relay.algorithms.tasks import arithmetic

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|endoftext|>"
ANSWER_TAGS = ("<answer>", "</answer>")
VOCAB_SIZE = 320  # a cap: the corpus supports fewer merges (283 tokens in all)
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
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in ANSWER_TAGS])
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
