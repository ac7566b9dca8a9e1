"""relay.generators.weight_chunks: a version cut into chunks of at most a byte budget, in order."""

from __future__ import annotations

import torch

from relay.generators.weight_chunks import chunks_of


def test_chunks_keep_the_order_stay_within_the_budget_and_a_large_tensor_goes_alone() -> None:
    named = [("a", torch.zeros(4)), ("b", torch.zeros(4)), ("big", torch.zeros(20)),
             ("c", torch.zeros(2, dtype=torch.float64)), ("d", torch.zeros(1))]
    chunks = list(chunks_of(iter(named), max_bytes=32))  # a, b: 16 bytes each; big: 80
    assert [[name for name, _ in chunk] for chunk in chunks] == [["a", "b"], ["big"],
                                                                 ["c", "d"]]
    sent = [tensor for chunk in chunks for _, tensor in chunk]
    assert all(got is given for got, (_, given) in zip(sent, named, strict=True))
    assert list(chunks_of([], max_bytes=32)) == []
