"""A weight version travels from the learner's server to a generator whole, or not at all."""

from __future__ import annotations

import msgspec
import pytest
import torch

from generators.weight_receiver import (
    IncompleteVersion,
    WeightReceiver,
    assemble,
    receive_version,
)
from learner.weights import MAX_REQUEST_BYTES, WeightServer, bucketize
from transport.messages import Ack, WeightManifest, WeightRequest
from transport.sockets import Client, PeerTimeout
from transport.threads import ThreadDied


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


def test_a_tensor_in_another_bucket_than_its_manifest_entry_is_refused() -> None:
    published = bucketize(3, version_tensors(1.0), bucket_bytes=2 * 64 * 64 * 2)
    first, second = published.buckets[0], published.buckets[1]
    moved = [msgspec.structs.replace(first, names=[first.names[0], second.names[0]],
                                     tensors=[first.tensors[0], second.tensors[0]]),
             msgspec.structs.replace(second, names=[first.names[1], *second.names[1:]],
                                     tensors=[first.tensors[1], *second.tensors[1:]])]
    with pytest.raises(IncompleteVersion, match="layer1.weight arrived in bucket 1, the "
                                                "manifest says bucket 0"):
        assemble(published.manifest, [*moved, *published.buckets[2:]])


def test_receive_version_assembles_the_buckets_after_a_manifest() -> None:
    published = bucketize(4, version_tensors(1.0), bucket_bytes=2 * 64 * 64 * 2)
    manifest, staged = receive_version(published.manifest, iter(published.buckets))
    assert manifest == published.manifest
    assert staged is not None and staged.version == 4
    assert torch.equal(staged.tensors["layer4.weight"], version_tensors(1.0)["layer4.weight"])


def test_receive_version_of_a_manifest_without_buckets_stages_nothing() -> None:
    up_to_date = WeightManifest(version=4, step=7)
    assert receive_version(up_to_date, iter([])) == (up_to_date, None)


def test_receive_version_refuses_anything_but_a_manifest_first() -> None:
    with pytest.raises(IncompleteVersion, match="expected a WeightManifest, got Ack"):
        receive_version(Ack(), iter([]))
    published = bucketize(5, version_tensors(1.0), bucket_bytes=64 * 64 * 2)
    with pytest.raises(IncompleteVersion, match="2 of 5 buckets"):
        receive_version(published.manifest, iter(published.buckets[:2]))


def test_a_receiver_whose_thread_dies_says_so_instead_of_waiting(monkeypatch) -> None:
    """An unexpected error in the receiving thread stops the waiting generator loudly."""
    import generators.weight_receiver as module

    def broken(*_args):
        raise KeyError("a bug")

    monkeypatch.setattr(module, "receive_version", broken)
    server = WeightServer("tcp://127.0.0.1:*").start()
    receiver = WeightReceiver(server.endpoint, "g0", poll_s=0.05).start(applied_version=0)
    try:
        with pytest.raises(ThreadDied, match="weight-receiver.*a bug"):
            receiver.wait_for(1, timeout_s=30)
    finally:
        receiver.stop()
        server.stop()


def test_the_weight_server_drops_an_oversize_request() -> None:
    server = WeightServer("tcp://127.0.0.1:*").start()
    client = Client(server.endpoint)
    try:
        huge = WeightRequest(generator_id="x" * MAX_REQUEST_BYTES, have_version=0)
        with pytest.raises(PeerTimeout):
            client.request(huge, 1.0)
        reply = client.request(WeightRequest(generator_id="g0", have_version=0), 5.0)
        assert isinstance(reply, WeightManifest) and reply.version == 0
    finally:
        client.close()
        server.stop()
