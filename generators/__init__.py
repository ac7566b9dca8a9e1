"""The generators: processes that decode with the current weights (``-m generators.main``).

It owns the inference engines behind one interface (``engine``: Relay's own ``torch``
decode loop, transformers' ``hf`` generate), sampling with behavior log-probs, the
generator's work loop (lease prompts, sample, score, send groups, apply new weight versions
between decode steps) and the evaluator process that decodes the held-out set on the
weights the learner offers. It knows nothing of losses or optimizers: the learner is reached
only through the wire (weight versions in, evaluation reports out).
"""
