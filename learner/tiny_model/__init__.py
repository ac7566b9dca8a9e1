"""Relay's embedded default model: a tiny Llama warm-started on the arithmetic task.

``tokenizer`` builds its tokenizer, ``warm_start`` its supervised warm start, ``evaluate``
measures held-out accuracy of any saved model directory, and ``build`` ties them together
(``tools/make-tiny-model.py`` is the command line). What a user of the built directory sees:

- a ``LlamaForCausalLM`` (2 layers, hidden 128, 8 heads of head_dim 32 so that vLLM's CPU
  attention runs it: q/k/v project 128 -> 256; tied embeddings, ~0.69M parameters,
  vocabulary of 283 byte-level BPE tokens with single-token digits);
- the ChatML template without a default system message: a user turn renders as
  ``<|im_start|>user\\nWhat is 4821 - 379?<|im_end|>\\n<|im_start|>assistant\\n``
  (21 tokens; 16 to 22 across the task's problems), and the answer
  ``<answer>4442</answer><|im_end|>`` is 7 tokens (4 to 8), eos ``<|im_end|>``, pad
  ``<|endoftext|>``;
- after the default warm start, a greedy accuracy of roughly 15-40% on the shipped test
  problems depending on the seed, with pass@8 well above it: room for RL.

The tool-using variant ``builtin:tiny-arith-tools`` (``build.build_tools_model``,
``tools/make-tiny-model.py --variant tools``; cache ``tiny-arith-tools-r1``) is the same
architecture with its own tokenizer (``tokenizer.build_tools_tokenizer``: a calculator call
is at most 12 tokens), warm start (``tool_warm_start``: a quarter of the transcripts call
the calculator, the rest guess the product) and evaluator (``tool_evaluate``: the calls
executed) on ``relay.algorithms.tasks.arithmetic_tools``. Sampled at temperature 1 it calls
the tool on about 30% of held-out problems and is right on about 24% (76% of its calls,
under 1% of its guesses); greedy decoding guesses: RL has to raise the tool route.
"""
