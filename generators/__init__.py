"""The generators: processes that decode with the current weights (``-m relay.generators.main``).

It owns the five inference engines behind one interface (``engine``: the ``lean`` engine, a
lean Llama/Qwen2/Qwen3 forward with continuous batching and the default; Relay's ``torch``
decode loop over any transformers model; transformers' ``hf`` generate; ``vllm`` and
``sglang``, those runtimes' engines in the generator's process), sampling with
behavior log-probs, the generator's work loop (lease prompts, keep the engine's batch full,
apply new weight versions between decode steps) with its sender thread (score, send
groups), and the evaluator process that decodes the held-out set on the
weights the learner offers. It knows nothing of losses or optimizers: the learner is reached
only through the wire (weight versions in, evaluation reports out).
"""
