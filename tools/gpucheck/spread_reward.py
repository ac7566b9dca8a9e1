"""Check C's reward, in verl's signature: the parity of the response's characters. A random
model earns the arithmetic task's reward almost never, so every advantage would be 0 and
no gradient would flow; this one spreads the rewards of nearly every group."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):  # noqa: ANN001, ANN201
    return float(sum(map(ord, solution_str)) % 2)
