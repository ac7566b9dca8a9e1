"""A weight version cut into chunks of bounded size, for engines in other processes that
take it piece by piece (``relay.generators.vllm_weights``, ``relay.generators.sglang_engine``): each
chunk is copied to the GPU and handed over, then freed, so a version never sits whole on
the GPU twice."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def chunks_of(named: Iterable[tuple[str, torch.Tensor]],
              max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The (name, tensor) pairs in order, in lists of at most ``max_bytes`` bytes of tensor
    data (a larger tensor is a chunk of its own); never an empty list."""
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, tensor))
        size += nbytes
    if chunk:
        yield chunk
