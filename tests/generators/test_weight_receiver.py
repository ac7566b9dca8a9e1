"""A weight version travels from the learner's server to a generator whole, or not at all."""

from __future__ import annotations

import pytest
import torch

from generators.weight_receiver import IncompleteVersion, WeightReceiver, assemble
from learner.weights import WeightServer, bucketize


def version_tensors(scale: float) -> dict[str, torch.Tensor]:
    return {f"layer{i}.weight": torch.full((64, 64), scale * i, dtype=torch.bfloat16)
            for i in range(5)}


def test_versions_stream_over_sockets_in_buckets() -> None:
    server = WeightServer("tcp://127.0.0.1:*").start()
    receiver = WeightReceiver(server.endpoint, "g0", poll_s=0.05).start(applied_version=0)
    try:
        assert receiver.wait_for(1, timeout_s=0.3) is None  # nothing published yet
        published = bucketize(1, version_tensors(1.0), bucket_bytes=3 * 64 * 64 * 2)
        assert published.manifest.num_buckets == 2
        server.publish(published)
        staged = receiver.wait_for(1, timeout_s=10)
        assert staged is not None and staged.version == 1
        for name, tensor in version_tensors(1.0).items():
            assert torch.equal(staged.tensors[name], tensor)
        server.publish(bucketize(2, version_tensors(2.0)))
        staged = receiver.wait_for(2, timeout_s=10)
        assert staged is not None and float(staged.tensors["layer3.weight"][0, 0]) == 6.0
        assert receiver.take() is None  # handed over once
    finally:
        receiver.stop()
        server.stop()


def test_an_incomplete_version_is_refused() -> None:
    published = bucketize(3, version_tensors(1.0), bucket_bytes=64 * 64 * 2)
    with pytest.raises(IncompleteVersion, match="4 of 5 buckets"):
        assemble(published.manifest, published.buckets[:4])
    swapped = [published.buckets[1], published.buckets[0], *published.buckets[2:]]
    with pytest.raises(IncompleteVersion, match="bucket 1 of version 3"):
        assemble(published.manifest, swapped)
    published.buckets[0].tensors[0] = torch.zeros(2, dtype=torch.bfloat16)
    with pytest.raises(IncompleteVersion, match="layer0.weight: got torch.bfloat16 \\[2\\]"):
        assemble(published.manifest, published.buckets)
