"""A live Server over loopback tcp survives 10,000 bad frame sets interleaved with valid
requests: each bad one is answered and counted under the right WireError kind, the counts
add up to exactly what was sent, and every valid request gets its own correct reply."""

from __future__ import annotations

import random
import struct
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import torch
import zmq

from relay.transport.codec import PREAMBLE, WIRE_ERROR_KINDS, Decoder, encode
from relay.transport.messages import (
    PROTOCOL_VERSION,
    Ack,
    ErrorReply,
    Heartbeat,
    Message,
    WeightBucket,
)
from relay.transport.sockets import Server, ServerThread

NUM_BAD = 10_000
VALID_EVERY = 10  # one valid request after every 10 bad ones
WINDOW = 200  # frame sets in flight before reading replies (below the HWM)
ENVELOPE = struct.Struct(">QB")
Case = tuple[list[bytes], str]  # (frames after the envelope, expected WireError kind)


def handler(msg: Message, peer: bytes) -> Message:
    if isinstance(msg, Heartbeat):
        return Ack(detail=f"{msg.generator_id}@{msg.version}")  # an echo: no reply mix-ups
    if isinstance(msg, WeightBucket):
        return Ack(detail=f"{msg.index}:{float(sum(t.sum() for t in msg.tensors))}")
    return Ack(detail=type(msg).__name__)


def valid_request(rng: random.Random, i: int) -> tuple[Message, Message]:
    """A valid request and the reply the handler must give to it."""
    if i % 3:
        return Heartbeat(generator_id=f"gen-{i}", version=i), Ack(detail=f"gen-{i}@{i}")
    tensor = torch.full((rng.choice([3, 2048]),), float(i % 7))
    total = float(tensor.sum())
    return WeightBucket(version=1, index=i, names=["w"], starts=[0], tensors=[tensor]), Ack(
        detail=f"{i}:{total}"
    )


class BadFrames:
    """Makers of bad frame sets: one ``case_*`` method per way of being wrong."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.preamble = PREAMBLE + bytes([PROTOCOL_VERSION])

    def valid_frames(self) -> list[bytes]:
        i = self.rng.randrange(1000)
        msg, _reply = valid_request(self.rng, i)
        return [bytes(f) for f in encode(msg)]

    def _noise(self, max_len: int = 64) -> bytes:
        return self.rng.randbytes(self.rng.randrange(max_len))

    def _tensor_bucket(self, *headers: list[Any], frames: tuple[bytes, ...] = ()) -> list[bytes]:
        exts = [msgspec.msgpack.Ext(1, msgspec.msgpack.encode(h)) for h in headers]
        names = [f"w{i}" for i in range(len(exts))]
        body = msgspec.msgpack.encode(["weight_bucket", 1, 0, names, [0] * len(exts), exts])
        return [self.preamble, body, *frames]

    # -- preamble / version ------------------------------------------------------------
    def case_random_bytes(self) -> Case:
        frame0 = self.rng.randbytes(self.rng.choice([0, 1, 2, 3, 5, 8, 33]))
        return [frame0, *(self._noise() for _ in range(self.rng.randrange(5)))], "preamble"

    def case_wrong_magic(self) -> Case:
        magic = bytes(self.rng.choice(b"ABCXYZrly") for _ in range(3))
        return [magic + bytes([PROTOCOL_VERSION]), *self.valid_frames()[1:]], "preamble"

    def case_foreign_version(self) -> Case:
        version = self.rng.choice([v for v in range(256) if v != PROTOCOL_VERSION])
        return [PREAMBLE + bytes([version]), *self.valid_frames()[1:]], "version"

    # -- malformed ---------------------------------------------------------------------
    def case_preamble_only(self) -> Case:
        return [self.preamble], "malformed"

    def case_truncated_body(self) -> Case:
        frames = self.valid_frames()
        return [
            frames[0],
            frames[1][: self.rng.randrange(len(frames[1]))],
            *frames[2:],
        ], "malformed"

    def case_trailing_bytes(self) -> Case:
        frames = self.valid_frames()
        tail = self.rng.randbytes(1 + self.rng.randrange(8))
        return [frames[0], frames[1] + tail, *frames[2:]], "malformed"

    def case_reserved_byte_body(self) -> Case:
        return [self.preamble, b"\xc1" + self._noise()], "malformed"

    def case_unknown_extension(self) -> Case:
        ext = msgspec.msgpack.Ext(self.rng.randrange(2, 100), self._noise(16))
        return [
            self.preamble,
            msgspec.msgpack.encode(["weight_bucket", 1, 0, ["w"], [0], [ext]]),
        ], "malformed"

    # -- schema ------------------------------------------------------------------------
    def case_unknown_tag(self) -> Case:
        tag = "x" + self.rng.randbytes(6).hex()
        return [self.preamble, msgspec.msgpack.encode([tag, 1, 2])], "schema"

    def case_wrong_field_type(self) -> Case:
        bad = self.rng.choice(["three", 3.5, None, [1], {"a": 1}])
        return [self.preamble, msgspec.msgpack.encode(["heartbeat", "gen-0", bad])], "schema"

    def case_outside_a_closed_set(self) -> Case:
        word = self.rng.choice(["nope", "", "ACCEPTED", "handler ", "rejected"])
        body = self.rng.choice([["error_reply", word, "detail"], ["rollout_ack", "roll-1", word]])
        return [self.preamble, msgspec.msgpack.encode(body)], "schema"

    def case_not_a_message(self) -> Case:
        value = self.rng.choice([7, -1.5, "heartbeat", None, {"tag": "heartbeat"}, [], True])
        return [self.preamble, msgspec.msgpack.encode(value)], "schema"

    # -- tensor ------------------------------------------------------------------------
    def case_bad_dtype(self) -> Case:
        dtype = self.rng.choice(["complex64", "object", "float128", "", "torch.float32"])
        return self._tensor_bucket([dtype, [2], bytes(8)]), "tensor"

    def case_negative_dim(self) -> Case:
        return self._tensor_bucket(["float32", [2, -self.rng.randrange(1, 9)], b""]), "tensor"

    def case_inline_length_lie(self) -> Case:
        n = self.rng.randrange(1, 64)
        wrong = self.rng.choice([0, 4 * n - 1, 4 * n + 1, 8 * n])
        return self._tensor_bucket(["float32", [n], bytes(wrong)]), "tensor"

    def case_frame_length_lie(self) -> Case:
        n = self.rng.randrange(1024, 4096)
        return self._tensor_bucket(["int32", [n], 2], frames=(bytes(4 * n - 4),)), "tensor"

    def case_frame_index_lie(self) -> Case:
        index = self.rng.choice([-1, 0, 1, 3, 99])
        return self._tensor_bucket(["uint8", [4096], index], frames=(bytes(4096),)), "tensor"

    def case_double_reference(self) -> Case:
        header = ["uint8", [4096], 2]
        return self._tensor_bucket(header, header, frames=(bytes(4096),)), "tensor"

    def case_missing_tensor_frame(self) -> Case:
        frames = [
            bytes(f)
            for f in encode(
                WeightBucket(version=1, index=0, names=["w"], starts=[0],
                             tensors=[torch.ones(2048)])
            )
        ]
        return frames[:2], "tensor"

    def case_extra_frames(self) -> Case:
        return [
            *self.valid_frames(),
            *(self._noise() for _ in range(1 + self.rng.randrange(3))),
        ], "tensor"

    def case_bad_header(self) -> Case:
        header = self.rng.choice([["float32"], ["float32", "2", b""], [1, [1], b"\0\0\0\0"], "x"])
        return self._tensor_bucket(header), "tensor"


def bad_envelope(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    """A frame set whose request-reply envelope is wrong (answered with request id 0)."""
    choice = rng.randrange(3)
    if choice == 0:
        return frames  # no envelope at all: the preamble is read as one
    if choice == 1:
        return [rng.randbytes(rng.choice([0, 1, 8, 10, 16])), *frames]
    return [ENVELOPE.pack(rng.randrange(1, 2**63), rng.randrange(1, 256)), *frames]


def build_traffic(seed: int) -> list[tuple[list[bytes], int, str | Message]]:
    """(frames to send, request id expected in the reply, expected kind or reply message)."""
    rng = random.Random(seed)
    bad = BadFrames(rng)
    makers: list[Callable[[], Case]] = [
        getattr(bad, name) for name in dir(BadFrames) if name.startswith("case_")
    ]
    traffic: list[tuple[list[bytes], int, str | Message]] = []
    for i in range(NUM_BAD):
        if i % VALID_EVERY == 0:
            msg, reply = valid_request(rng, i)
            request_id = len(traffic) + 1
            traffic.append(([ENVELOPE.pack(request_id, 0), *encode(msg)], request_id, reply))
        if rng.random() < 0.05:
            traffic.append((bad_envelope(rng, bad.valid_frames()), 0, "envelope"))
            continue
        frames, kind = rng.choice(makers)()
        request_id = len(traffic) + 1
        traffic.append(([ENVELOPE.pack(request_id, 0), *frames], request_id, kind))
    return traffic


@pytest.fixture
def live_server() -> Any:
    server = Server("tcp://127.0.0.1:*", handler)
    with ServerThread(server, poll_s=0.01):
        yield server


def test_live_server_rejects_and_counts_every_bad_frame_set(live_server: Server) -> None:
    traffic = build_traffic(seed=1234)
    decoder = Decoder()
    sent_kinds: Counter[str] = Counter()
    got_kinds: Counter[str] = Counter()
    valid_sent = valid_ok = 0
    with zmq.Context.instance().socket(zmq.DEALER) as peer:
        peer.linger = 0
        peer.rcvtimeo = 10_000
        peer.connect(live_server.endpoint)
        for start in range(0, len(traffic), WINDOW):
            window = traffic[start : start + WINDOW]
            for frames, _request_id, _expected in window:
                peer.send_multipart(frames, copy=False)
            for _frames, request_id, expected in window:  # one connection: replies in order
                envelope, *reply_frames = peer.recv_multipart(copy=False)
                assert ENVELOPE.unpack(envelope.bytes) == (request_id, 0)
                reply = decoder.decode(reply_frames)
                if isinstance(expected, str):
                    sent_kinds[expected] += 1
                    assert isinstance(reply, ErrorReply), reply
                    assert reply.code == expected, (expected, reply)
                    got_kinds[reply.code] += 1
                else:
                    valid_sent += 1
                    valid_ok += reply == expected

    assert sum(sent_kinds.values()) >= NUM_BAD
    assert set(sent_kinds) == set(WIRE_ERROR_KINDS), "every kind must be exercised"
    assert valid_ok == valid_sent == NUM_BAD // VALID_EVERY
    assert {k: live_server.errors[k] for k in WIRE_ERROR_KINDS} == dict(sent_kinds)
    assert sum(live_server.errors.values()) == sum(sent_kinds.values())  # no handler/unroutable
    assert live_server.served == valid_sent
