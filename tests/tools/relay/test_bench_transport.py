"""relay.bench_transport (``relay bench transport``): each measurement runs end to end over
loopback and reports positive rates for Relay's path and for bare ZeroMQ."""

from __future__ import annotations

from relay.bench_transport import codec_only, large_tensor, small_messages


def test_small_messages_and_the_codec_alone_are_measured() -> None:
    comparison = small_messages(messages=200, repeats=1)
    assert comparison.relay > 0 and comparison.raw > 0 and comparison.ratio > 0
    assert codec_only(messages=200, repeats=1) > 0


def test_a_large_tensor_crosses_as_a_weight_bucket() -> None:
    comparison, memcpy = large_tensor(megabytes=1, transfers=1, repeats=1)
    assert comparison.unit == "MB/s" and comparison.relay > 0 and comparison.raw > 0
    assert memcpy > 0
