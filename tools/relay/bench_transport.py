"""Side-by-side timings of Relay's wire against bare ZeroMQ on the same bytes.

Two measurements, each repeated (relay and raw taking turns) and reported as medians with
the ratio relay/raw:

- small messages: a ``RolloutGroup`` (8 samples x 64 tokens by default) through
  ``Pusher.send`` -> loopback tcp -> ``Puller.receive`` (encode, send, receive, decode),
  beside PUSH/PULL sockets moving the already-encoded frames, and the codec alone;
- one large tensor: a 64 MB ``WeightBucket`` through the same path (zero-copy on both
  ends), beside bare sockets moving the same 64 MB buffer with ``copy=False``, and the
  machine's in-memory copy rate of 64 MB for scale.

Both sides run in one process and one thread, so a number is the cost of the whole trip on
one core plus ZeroMQ's IO thread. This module is used by ``tools/bench-transport.py``
(``relay bench transport``); nothing at run time imports it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq

from relay.transport.codec import Decoder, encode
from relay.transport.messages import RolloutGroup, Sample, WeightBucket
from relay.transport.sockets import Puller, Pusher

LOOPBACK = "tcp://127.0.0.1:*"
BATCH = 100  # messages in flight per round, well under the HWM


@dataclass(frozen=True)
class Comparison:
    """Median rates of one measurement: Relay's path and bare ZeroMQ on the same bytes."""

    what: str
    unit: str
    relay: float
    raw: float

    @property
    def ratio(self) -> float:
        return self.relay / self.raw


def rollout_group(samples: int, tokens: int) -> RolloutGroup:
    """A realistic small message: ``samples`` completions of ``tokens`` tokens each."""
    return RolloutGroup(
        rollout_id="bench-0",
        lease_id="lease-0",
        prompt_id="prompt-0",
        generator_id="gen-0",
        samples=[
            Sample(
                prompt_ids=torch.randint(0, 32000, (tokens,), dtype=torch.int32),
                response_ids=torch.randint(0, 32000, (tokens,), dtype=torch.int32),
                logprobs=-torch.rand(tokens),
                versions=torch.zeros(tokens, dtype=torch.int32),
                reward=1.0,
            )
            for _ in range(samples)
        ],
        data_source="bench",
    )


def median_rates(amount: float, runs: list[Callable[[], None]], repeats: int) -> list[float]:
    """Median ``amount / seconds`` of each run, after one warm-up each.

    The runs take turns within every repeat, so load from other processes on a shared
    machine falls on all of them alike instead of on whichever ran last.
    """
    for run in runs:
        run()
    rates: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for run, samples in zip(runs, rates, strict=True):
            started = time.perf_counter()
            run()
            samples.append(amount / (time.perf_counter() - started))
    return [statistics.median(samples) for samples in rates]


class _RawPair:
    """Bare PUSH/PULL sockets on loopback tcp, for the baseline."""

    def __init__(self) -> None:
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.pull = context.socket(zmq.PULL)
        self.pull.bind(LOOPBACK)
        self.push = context.socket(zmq.PUSH)
        self.push.connect(self.pull.getsockopt_string(zmq.LAST_ENDPOINT))

    def close(self) -> None:
        self.push.close(linger=0)
        self.pull.close(linger=0)


def small_messages(
    samples: int = 8, tokens: int = 64, messages: int = 2000, repeats: int = 5
) -> Comparison:
    """Messages/s for ``RolloutGroup``s through Relay's path and through bare sockets."""
    group = rollout_group(samples, tokens)
    frames = [bytes(frame) for frame in encode(group)]
    puller = Puller(LOOPBACK)
    pusher = Pusher(puller.endpoint)
    raw = _RawPair()

    def relay_run() -> None:
        for _ in range(messages // BATCH):
            for _ in range(BATCH):
                pusher.send(group)
            for _ in range(BATCH):
                puller.receive(5.0)

    def raw_run() -> None:
        for _ in range(messages // BATCH):
            for _ in range(BATCH):
                raw.push.send_multipart(frames)
            for _ in range(BATCH):
                raw.pull.recv_multipart()

    try:
        sent = messages // BATCH * BATCH
        relay, baseline = median_rates(sent, [relay_run, raw_run], repeats)
    finally:
        pusher.close(linger_s=0)
        puller.close()
        raw.close()
    if pusher.dropped or puller.errors:
        raise RuntimeError(
            f"benchmark lost messages: dropped={pusher.dropped} errors={puller.errors}"
        )
    what = f"RolloutGroup {samples}x{tokens} tokens ({sum(map(len, frames))} B)"
    return Comparison(what, "msg/s", relay, baseline)


def codec_only(samples: int = 8, tokens: int = 64, messages: int = 2000, repeats: int = 5) -> float:
    """Messages/s for encode + decode of the same ``RolloutGroup`` with no socket at all."""
    group = rollout_group(samples, tokens)
    decoder: Decoder[RolloutGroup] = Decoder(RolloutGroup)

    def run() -> None:
        for _ in range(messages):
            decoder.decode(encode(group))

    [rate] = median_rates(messages, [run], repeats)
    return rate


def large_tensor(
    megabytes: int = 64, transfers: int = 4, repeats: int = 5
) -> tuple[Comparison, float]:
    """MB/s for one ``megabytes`` tensor per message, and the in-memory copy rate for scale."""
    tensor = torch.randn(megabytes * 2**20 // 4)
    bucket = WeightBucket(version=1, index=0, names=["w"], starts=[0], tensors=[tensor])
    payload = memoryview(tensor.view(torch.uint8).numpy())
    puller = Puller(LOOPBACK)
    pusher = Pusher(puller.endpoint)
    raw = _RawPair()

    def relay_run() -> None:
        for _ in range(transfers):
            pusher.send(bucket)
            received = puller.receive(30.0)
            if not isinstance(received, WeightBucket) or received.tensors[0].shape != tensor.shape:
                raise RuntimeError(f"benchmark lost the tensor: received {received!r:.80}")

    def raw_run() -> None:
        for _ in range(transfers):
            raw.push.send(payload, copy=False)
            raw.pull.recv(copy=False)

    target = torch.empty_like(tensor)

    def memcpy_run() -> None:
        for _ in range(transfers):
            target.copy_(tensor)

    try:
        moved = megabytes * transfers
        relay, baseline, memcpy = median_rates(moved, [relay_run, raw_run, memcpy_run], repeats)
    finally:
        pusher.close(linger_s=0)
        puller.close()
        raw.close()
    return Comparison(f"one {megabytes} MB float32 tensor", "MB/s", relay, baseline), memcpy
