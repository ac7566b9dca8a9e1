"""relay.transport.codec: every message round-trips, tensors keep dtype/shape/values, frames are
exactly as documented, and every kind of bad frame set is rejected with the right kind."""

from __future__ import annotations

import warnings
from typing import Any, get_args

import msgspec
import pytest
import torch
import zmq

from relay.transport.codec import (
    INLINE_THRESHOLD,
    MAX_TENSORS,
    PREAMBLE,
    PREAMBLE_FRAME,
    Decoder,
    WireError,
    encode,
)
from relay.transport.messages import (
    ALL_MESSAGES,
    PROTOCOL_VERSION,
    Ack,
    Attach,
    AttachAck,
    BufferCheckpoint,
    BufferCheckpointRequest,
    Detach,
    ErrorCode,
    ErrorReply,
    EvalOffer,
    EvalReport,
    EvalRequest,
    Heartbeat,
    HeartbeatAck,
    LeaseRequest,
    LeaseReturn,
    Message,
    Metrics,
    Prompt,
    PromptLease,
    PromptSourceState,
    RolloutAck,
    RolloutGroup,
    RolloutVerdict,
    Sample,
    SampleBatch,
    SampleRequest,
    ScoreItem,
    ScoreReply,
    ScoreRequest,
    ScoreResult,
    Shutdown,
    StreamBeacon,
    VersionUpdate,
    WeightBucket,
    WeightEntry,
    WeightManifest,
    WeightRequest,
)



def one_piece(tensor: torch.Tensor) -> WeightBucket:
    """A bucket holding one whole tensor."""
    return WeightBucket(version=1, index=0, names=["w"], starts=[0], tensors=[tensor])

def make_sample(response_len: int, seed: int) -> Sample:
    gen = torch.Generator().manual_seed(seed)
    return Sample(
        prompt_ids=torch.randint(0, 32000, (17,), generator=gen, dtype=torch.int32),
        response_ids=torch.randint(0, 32000, (response_len,), generator=gen, dtype=torch.int32),
        logprobs=-torch.rand(response_len, generator=gen),
        versions=torch.full((response_len,), 7, dtype=torch.int32),
        reward=1.0 if seed % 2 else 0.0,
        finish_reason="length" if seed % 3 == 0 else "stop",
        reward_info={"format": 1.0, "accuracy": float(seed % 2)},
        text=f"The answer is {seed}.",
    )


def make_group(rollout_id: str, n: int = 4, response_len: int = 64) -> RolloutGroup:
    return RolloutGroup(
        rollout_id=rollout_id,
        lease_id="lease-3",
        prompt_id="gsm8k-0042",
        generator_id="gen-0",
        samples=[make_sample(response_len, seed) for seed in range(n)],
        data_source="openai/gsm8k",
        ground_truth="72",
        metadata={"temperature": 1.0, "engine": "torch"},
    )


def example_messages() -> dict[type[Message], Message]:
    """One realistic instance of every message class."""
    prompt = Prompt(
        prompt_id="gsm8k-0042",
        messages=[{"role": "user", "content": "What is 8 * 9?"}],
        data_source="openai/gsm8k",
        ground_truth="72",
        extra_info={"split": "train", "index": 42},
    )
    big = torch.randn(64, 128).to(torch.bfloat16)  # 16 KiB: its own frame
    return {
        Attach: Attach(
            generator_id="gen-0", engine="torch", device="cpu", host="node-1", pid=4242, version=3
        ),
        AttachAck: AttachAck(accepted=True, learner_version=3),
        Heartbeat: Heartbeat(
            generator_id="gen-0",
            version=3,
            generated_tokens=123456,
            generation_seconds=42.5,
        ),
        HeartbeatAck: HeartbeatAck(known=False),
        Detach: Detach(generator_id="gen-0", reason="shutdown"),
        LeaseRequest: LeaseRequest(generator_id="gen-0", max_prompts=16),
        PromptLease: PromptLease(
            lease_id="lease-3", prompts=[prompt, prompt], n=8, min_version=2, expires_in_s=30.0
        ),
        LeaseReturn: LeaseReturn(
            generator_id="gen-0",
            lease_id="lease-3",
            prompt_ids=["gsm8k-0042"],
            reason="engine error",
        ),
        RolloutGroup: make_group("roll-1"),
        RolloutAck: RolloutAck(
            rollout_id="roll-1", verdict="stale", detail="version 2, learner at 7"
        ),
        SampleRequest: SampleRequest(num_groups=32, priorities={"roll-1": 0.25}),
        SampleBatch: SampleBatch(
            groups=[make_group("roll-1"), make_group("roll-2", n=2, response_len=1500)],
            buffer_stats={"occupancy": 0.5},
        ),
        VersionUpdate: VersionUpdate(version=5, step=50),
        BufferCheckpointRequest: BufferCheckpointRequest(step=50),
        BufferCheckpoint: BufferCheckpoint(
            step=50,
            source=PromptSourceState(
                epoch=2,
                loader={"_num_yielded": 7, "_shared_seed": None,
                        "sampler": {"generator": (torch.arange(5056) % 256).to(torch.uint8)}},
                pending=[prompt],
            ),
            accepted=1600,
        ),
        WeightRequest: WeightRequest(generator_id="gen-0", have_version=4),
        WeightManifest: WeightManifest(
            version=5,
            entries=[
                WeightEntry(
                    name="model.embed_tokens.weight", dtype="bfloat16", shape=[64, 128]
                )
            ],
            num_buckets=1,
            total_bytes=big.numel() * 2,
            step=50,
        ),
        WeightBucket: WeightBucket(
            version=5,
            index=0,
            names=["model.embed_tokens.weight", "model.norm.weight"],
            starts=[0, 0],
            tensors=[big, torch.ones(128)],
        ),
        EvalOffer: EvalOffer(step=40, version=4),
        StreamBeacon: StreamBeacon(),
        EvalRequest: EvalRequest(
            after_step=40,
            report=EvalReport(step=40, version=4, metrics={"eval/accuracy": 0.5}),
        ),
        ScoreRequest: ScoreRequest(
            request_id="9f2c", kind="judge",
            items=[ScoreItem(item_id="lease-3/p1", messages=[{"role": "user", "content": "1+1"}],
                             prompt_ids=[5, 6], responses=[[7], [8, 9]], texts=["2", "3"],
                             ground_truth="2")],
        ),
        ScoreReply: ScoreReply(
            request_id="9f2c",
            results=[ScoreResult(item_id="lease-3/p1", scores=[1.0, 0.0],
                                 errors=["", "judge: no number"])],
        ),
        Metrics: Metrics(
            source="learner",
            step=50,
            values={"loss/policy": -0.01, "reward/mean": 0.62},
        ),
        Shutdown: Shutdown(reason="run finished"),
        Ack: Ack(detail="ok"),
        ErrorReply: ErrorReply(code="schema", detail="Expected `int`, got `str` - at `$[2]`"),
    }


def assert_same(got: Any, want: Any, path: str = "msg") -> None:
    """Deep equality for structs holding tensors (tensor ``==`` is elementwise)."""
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), path
        assert torch.equal(got, want), f"{path}: values differ"
    elif isinstance(want, msgspec.Struct):
        for field in want.__struct_fields__:
            assert_same(getattr(got, field), getattr(want, field), f"{path}.{field}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), path
        for key in want:
            assert_same(got[key], want[key], f"{path}[{key!r}]")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def over_the_wire(frames: list[Any]) -> list[bytes]:
    """What a peer receives when it copies frames out of ZeroMQ: read-only bytes."""
    return [bytes(frame) for frame in frames]


def test_examples_cover_every_message_class() -> None:
    assert set(example_messages()) == set(ALL_MESSAGES)


@pytest.mark.parametrize("cls", ALL_MESSAGES, ids=lambda cls: cls.__name__)
def test_every_message_round_trips(cls: type[Message]) -> None:
    msg = example_messages()[cls]
    assert_same(Decoder().decode(over_the_wire(encode(msg))), msg)


@pytest.mark.parametrize(
    "msg",
    [
        EvalRequest(after_step=-1),
        EvalRequest(after_step=10, report=EvalReport(step=10, version=3, metrics={})),
        EvalRequest(
            after_step=20,
            report=EvalReport(
                step=20, version=4, metrics={"eval/accuracy": 0.75, "eval/accuracy/gsm8k": 1.0}
            ),
        ),
    ],
    ids=["no-report", "empty-metrics", "report"],
)
def test_eval_request_round_trips_with_and_without_a_report(msg: EvalRequest) -> None:
    assert Decoder(EvalRequest).decode(over_the_wire(encode(msg))) == msg


@pytest.mark.parametrize("step", [-1, 0, 7, 2**40])
def test_weight_manifest_step_round_trips(step: int) -> None:
    msg = WeightManifest(version=3, num_buckets=0, step=step)
    assert Decoder(WeightManifest).decode(over_the_wire(encode(msg))).step == step


def test_weight_manifest_without_step_reads_as_step_zero(craft: Any) -> None:
    # an appended field with a default: a manifest that ends before it is still valid
    frames = [craft.preamble, craft.body("weight_manifest", 5, [], 0, 0)]
    assert Decoder().decode(frames) == WeightManifest(version=5, step=0)


def test_lineage_is_appended_to_attach_and_old_peers_read_around_it(craft: Any) -> None:
    # an older generator's attach ends before the field: it reads as empty
    old_body = ["gen-0", "torch", "cpu", "node-1", 42, 3]
    assert Decoder().decode([craft.preamble, craft.body("attach", *old_body)]) == Attach(
        generator_id="gen-0", engine="torch", device="cpu", host="node-1", pid=42, version=3)
    # a launched generator's attach is the old fields and one more, which an older buffer
    # (a struct of the old shape) skips
    restarted = Attach(generator_id="gen-0", engine="torch", device="cpu", host="node-1",
                       pid=42, version=3, lineage="feed0001")
    body = over_the_wire(encode(restarted))[1]
    assert body == craft.body("attach", *old_body, "feed0001")
    assert Decoder(Attach).decode([craft.preamble, body]).lineage == "feed0001"

    class OldAttach(msgspec.Struct, tag="attach", array_like=True, kw_only=True):
        generator_id: str
        engine: str
        device: str
        host: str = ""
        pid: int = 0
        version: int = 0

    assert msgspec.msgpack.decode(body, type=OldAttach).pid == 42


@pytest.mark.parametrize(
    "dtype",
    [
        torch.bfloat16,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.bool,
    ],
)
@pytest.mark.parametrize("numel", [3, 5000], ids=["inline", "frame"])
def test_tensor_dtypes_round_trip_with_exact_frame_count(dtype: torch.dtype, numel: int) -> None:
    tensor = (torch.randn(numel) * 100).to(dtype).reshape(-1, 1)
    frames = encode(one_piece(tensor))
    nbytes = tensor.numel() * tensor.element_size()
    assert len(frames) == (2 if nbytes < INLINE_THRESHOLD else 3)
    got = Decoder(WeightBucket).decode(over_the_wire(frames)).tensors[0]
    assert_same(got, tensor)


def test_frame_count_is_one_per_large_tensor() -> None:
    small, large = torch.ones(10), torch.ones(2000)  # 40 B inline, 8000 B framed
    msg = WeightBucket(
        version=1, index=0, names=list("abcde"), starts=[0] * 5,
        tensors=[large, small, large, small, large],
    )
    frames = encode(msg)
    assert len(frames) == 2 + 3
    assert [len(f) for f in frames[2:]] == [8000] * 3
    assert len(encode(msg, inline_threshold=1)) == 2 + 5
    assert len(encode(msg, inline_threshold=1 << 20)) == 2


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),  # inline, transposed
        torch.randn(100, 60)[:, ::3],  # framed, strided columns
        torch.randn(40, 40).to(torch.bfloat16).t(),  # framed bf16, transposed
        torch.empty(0, dtype=torch.float32),
        torch.empty(3, 0, 5, dtype=torch.bfloat16),
        torch.tensor(3.25),  # 0-d scalar
        torch.tensor(True),
        torch.tensor(-7, dtype=torch.int32),
    ],
    ids=[
        "noncontig-inline",
        "noncontig-frame",
        "noncontig-bf16",
        "empty",
        "empty-3d",
        "scalar-f32",
        "scalar-bool",
        "scalar-i32",
    ],
)
def test_odd_tensors_round_trip(tensor: torch.Tensor) -> None:
    msg = one_piece(tensor)
    assert_same(Decoder().decode(over_the_wire(encode(msg))).tensors[0], tensor)


def test_tensor_inside_an_untyped_field_round_trips() -> None:
    msg = RolloutGroup(
        rollout_id="r",
        lease_id="l",
        prompt_id="p",
        generator_id="g",
        samples=[],
        metadata={"mask": torch.tensor([True, False]), "hidden": torch.randn(2000)},
    )
    frames = encode(msg)
    assert len(frames) == 3
    assert_same(Decoder().decode(over_the_wire(frames)), msg)


def test_large_tensor_is_sent_and_received_without_copies() -> None:
    tensor = torch.randn(256, 256)
    frames = encode(one_piece(tensor))
    assert torch.frombuffer(frames[2], dtype=torch.uint8).data_ptr() == tensor.data_ptr()

    context = zmq.Context.instance()
    with context.socket(zmq.PAIR) as tx, context.socket(zmq.PAIR) as rx:
        rx.bind("inproc://codec-zero-copy")
        tx.connect("inproc://codec-zero-copy")
        tx.send_multipart(frames, copy=False)
        received = rx.recv_multipart(copy=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the non-writable-buffer warning would fail here
        got = Decoder().decode(received).tensors[0]
    assert torch.equal(got, tensor)
    assert got.data_ptr() == torch.frombuffer(received[2].buffer, dtype=torch.uint8).data_ptr()


def test_read_only_frames_decode_to_writable_copies_without_warning() -> None:
    tensor = torch.randn(2000)
    frames = over_the_wire(encode(one_piece(tensor)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = Decoder().decode(frames).tensors[0]
    got.add_(1.0)  # must not write into the immutable bytes object
    assert torch.equal(Decoder().decode(frames).tensors[0], tensor)


def test_unsupported_tensor_dtype_is_refused_by_the_encoder() -> None:
    with pytest.raises(TypeError, match="complex64"):
        encode(
            WeightBucket(
                version=1, index=0, names=["w"], starts=[0],
                tensors=[torch.zeros(2, dtype=torch.complex64)],
            )
        )


def test_unencodable_value_is_refused_by_the_encoder() -> None:
    class Handle:
        pass

    msg = RolloutGroup(
        rollout_id="r",
        lease_id="l",
        prompt_id="p",
        generator_id="g",
        samples=[],
        metadata={"handle": Handle()},
    )
    with pytest.raises(TypeError, match="Handle"):
        encode(msg)


# ---------------------------------------------------------------------------------------
# Rejections
# ---------------------------------------------------------------------------------------


def reject(frames: list[Any], decoder: Decoder[Any] | None = None) -> WireError:
    with pytest.raises(WireError) as info:
        (decoder or Decoder()).decode(frames)
    return info.value


def test_foreign_protocol_version_is_rejected() -> None:
    frames = encode(Ack())
    error = reject([PREAMBLE + bytes([PROTOCOL_VERSION + 1]), frames[1]])
    assert error.kind == "version"
    assert str(PROTOCOL_VERSION + 1) in error.detail


@pytest.mark.parametrize(
    "frame0", [b"", b"RLX\x01", b"rly\x01", b"RLY", b"RLY\x01\x00", b"GET / HTTP/1.1"]
)
def test_bad_preamble_is_rejected(frame0: bytes) -> None:
    assert reject([frame0, encode(Ack())[1]]).kind == "preamble"


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [PREAMBLE + bytes([PROTOCOL_VERSION])],
        [PREAMBLE + bytes([PROTOCOL_VERSION]), b"\xc1"],
        [PREAMBLE + bytes([PROTOCOL_VERSION]), encode(Ack(detail="x"))[1][:-1]],
        [PREAMBLE + bytes([PROTOCOL_VERSION]), encode(Ack())[1] + b"\x00"],
    ],
    ids=["no-frames", "no-body", "reserved-byte", "truncated", "trailing-bytes"],
)
def test_malformed_frame_sets_are_rejected(frames: list[bytes]) -> None:
    assert reject(frames).kind == "malformed"


def test_unknown_extension_type_is_malformed(craft: Any) -> None:
    ext = msgspec.msgpack.Ext(42, b"")
    assert (
        reject([craft.preamble, craft.body("weight_bucket", 1, 0, ["w"], [0], [ext])]).kind
        == "malformed"
    )


@pytest.mark.parametrize(
    "body",
    [
        msgspec.msgpack.encode(["no_such_message"]),
        msgspec.msgpack.encode(["heartbeat", "gen-0", "three"]),
        msgspec.msgpack.encode(["heartbeat"]),
        msgspec.msgpack.encode({"generator_id": "gen-0"}),
        msgspec.msgpack.encode(7),
        # a list, not a tensor:
        msgspec.msgpack.encode(["weight_bucket", 1, 0, ["w"], [0], [[1.0, 2.0]]]),
    ],
    ids=["unknown-tag", "wrong-type", "missing-field", "map", "int", "tensor-as-list"],
)
def test_schema_violations_are_rejected(craft: Any, body: bytes) -> None:
    assert reject([craft.preamble, body]).kind == "schema"


def test_narrow_decoder_rejects_other_messages() -> None:
    error = reject(encode(Ack()), Decoder(VersionUpdate))
    assert error.kind == "schema"
    assert "VersionUpdate" in error.detail


@pytest.mark.parametrize(
    "body",
    [
        msgspec.msgpack.encode(["error_reply", "no_such_code", "detail"]),
        msgspec.msgpack.encode(["error_reply", "Schema"]),  # the closed set is case-sensitive
        msgspec.msgpack.encode(["rollout_ack", "roll-1", "maybe"]),
        msgspec.msgpack.encode(["rollout_ack", "roll-1", True]),  # the old ``accepted`` bool
    ],
    ids=["error-code", "error-code-case", "verdict", "verdict-as-bool"],
)
def test_choices_outside_their_closed_set_are_rejected(craft: Any, body: bytes) -> None:
    assert reject([craft.preamble, body]).kind == "schema"


@pytest.mark.parametrize("code", get_args(ErrorCode))
def test_every_error_code_is_accepted(craft: Any, code: str) -> None:
    frames = [craft.preamble, msgspec.msgpack.encode(["error_reply", code])]
    assert Decoder().decode(frames) == ErrorReply(code=code)


@pytest.mark.parametrize("verdict", get_args(RolloutVerdict))
def test_every_rollout_verdict_is_accepted(craft: Any, verdict: str) -> None:
    frames = [craft.preamble, msgspec.msgpack.encode(["rollout_ack", "roll-1", verdict])]
    ack = Decoder().decode(frames)
    assert ack == RolloutAck(rollout_id="roll-1", verdict=verdict)
    assert ack.accepted == (verdict == "accepted")


@pytest.mark.parametrize(
    "tensor, extra, needle",
    [
        (("complex64", [2], bytes(16)), (), "complex64"),
        (("float32", [-1], b""), (), "negative"),
        (("float32", [2, 2], bytes(15)), (), "needs 16 bytes"),
        (("float32", [2000], 2), (bytes(7999),), "needs 8000 bytes"),
        (("float32", [2000], 3), (bytes(8000),), "outside"),
        (("float32", [2000], 1), (bytes(8000),), "outside"),
        (("float32", [1] * 40, bytes(4)), (), "dims"),
        (("float32", [2000]), (), "header"),
        (("float32", "2000", 2), (bytes(8000),), "header"),
    ],
    ids=[
        "dtype",
        "negative-dim",
        "inline-length",
        "frame-length",
        "index-past-end",
        "index-body",
        "too-many-dims",
        "short-header",
        "shape-type",
    ],
)
@pytest.mark.parametrize("tensors_in_any", [True, False])
def test_lying_tensor_metadata_is_rejected(
    craft: Any, tensor: tuple, extra: tuple, needle: str, tensors_in_any: bool
) -> None:
    ext = msgspec.msgpack.Ext(1, msgspec.msgpack.encode(list(tensor)))
    error = reject(craft.bucket(ext, extra_frames=extra), Decoder(tensors_in_any=tensors_in_any))
    assert error.kind == "tensor"
    assert needle in error.detail


def test_frame_referenced_twice_is_rejected(craft: Any) -> None:
    ref = craft.tensor("float32", [2000], 2)
    error = reject(craft.bucket(ref, ref, extra_frames=(bytes(8000),)))
    assert (error.kind, "two tensors" in error.detail) == ("tensor", True)


def test_unreferenced_extra_frame_is_rejected() -> None:
    frames = encode(one_piece(torch.ones(2000)))
    error = reject([*frames, b"extra"])
    assert error.kind == "tensor"
    assert "[3]" in error.detail


def tensor_bomb(count: int) -> list[bytes]:
    """A rollout group whose ``metadata`` (an ``Any`` field) holds ``count`` one-byte tensors:
    15 bytes of frame each (issue 30: 1M of them in a 15 MB frame)."""
    one_byte = msgspec.msgpack.Ext(1, msgspec.msgpack.encode(["uint8", [1], b"\x07"]))
    group = RolloutGroup(rollout_id="r", lease_id="l", prompt_id="p", generator_id="g",
                         samples=[], metadata={"bomb": [one_byte] * count})
    return [PREAMBLE_FRAME, msgspec.msgpack.encode(group)]


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many tensors the decoder built from received bytes (``torch.frombuffer`` calls)."""
    calls = [0]
    frombuffer = torch.frombuffer

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        return frombuffer(*args, **kwargs)

    monkeypatch.setattr(torch, "frombuffer", counting)
    return calls


@pytest.mark.parametrize("max_tensors", [0, 1, 8])
def test_a_message_with_more_tensors_than_max_tensors_is_refused(
        built: list[int], max_tensors: int) -> None:
    assert len(Decoder(max_tensors=max_tensors).decode(tensor_bomb(max_tensors)).metadata[
        "bomb"]) == max_tensors
    error = reject(tensor_bomb(max_tensors + 1), Decoder(max_tensors=max_tensors))
    assert error.kind == "tensor"
    assert error.detail == f"more than {max_tensors} tensors in one message"
    assert built[0] == 2 * max_tensors  # the first decode's, then the second's until refused


def test_the_issues_tensor_bomb_is_refused_after_max_tensors(built: list[int]) -> None:
    frames = tensor_bomb(1_000_000)
    assert 15_000_000 <= len(frames[1]) < 15_100_000
    assert reject(frames).kind == "tensor"
    assert built[0] == MAX_TENSORS  # the default cap: not one tensor more was built


def test_max_tensors_counts_tensor_fields_and_untyped_fields_together() -> None:
    group = make_group("r-1", n=2)  # 2 samples x 4 tensor fields
    group.metadata["mask"] = torch.tensor([True])
    frames = over_the_wire(encode(group))
    assert_same(Decoder(RolloutGroup, max_tensors=9).decode(frames), group)
    assert reject(frames, Decoder(RolloutGroup, max_tensors=8)).kind == "tensor"


def test_max_tensors_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="max_tensors must be >= 0, got -1"):
        Decoder(max_tensors=-1)


def group_with(**untyped: Any) -> RolloutGroup:
    """A group of one sample whose untyped fields (``ground_truth``, ``metadata``) are
    ``untyped``."""
    return RolloutGroup(rollout_id="r", lease_id="l", prompt_id="p", generator_id="g",
                        samples=[make_sample(64, 0)], **untyped)


@pytest.mark.parametrize("untyped", [
    {"metadata": {"mask": torch.tensor([True])}},
    {"metadata": {"hidden": torch.randn(2000)}},  # in a frame of its own
    {"ground_truth": torch.tensor([7], dtype=torch.int64)},
], ids=["inline-metadata", "frame-metadata", "ground-truth"])
def test_without_tensors_in_any_a_tensor_in_an_untyped_field_is_refused_unbuilt(
        built: list[int], untyped: dict[str, Any]) -> None:
    frames = over_the_wire(encode(group_with(**untyped)))
    error = reject(frames, Decoder(RolloutGroup, tensors_in_any=False))
    assert error.kind == "tensor"
    assert error.detail.startswith("a tensor in a field that is not a tensor field")
    assert built[0] == 4  # the sample's four, not the untyped one
    assert_same(Decoder(RolloutGroup).decode(frames), group_with(**untyped))  # the default


def test_without_tensors_in_any_an_untyped_tensor_before_a_tensor_field_is_refused(
        built: list[int]) -> None:
    # the first group's metadata comes before the second group's samples on the wire
    batch = SampleBatch(groups=[group_with(metadata={"t": torch.tensor([1])}), group_with()])
    error = reject(over_the_wire(encode(batch)), Decoder(SampleBatch, tensors_in_any=False))
    assert error.kind == "tensor" and "not a tensor field" in error.detail
    assert built[0] == 4  # the first group's sample; refused at the second group's first


def test_without_tensors_in_any_tensor_fields_decode_as_before() -> None:
    group = make_group("r-1", n=3, response_len=2000)  # inline prompts, framed responses
    frames = over_the_wire(encode(group))
    assert len(frames) > 2
    assert_same(Decoder(RolloutGroup, tensors_in_any=False).decode(frames), group)
    bucket = one_piece(torch.randn(64, 64))
    assert_same(Decoder(WeightBucket, tensors_in_any=False).decode(
        over_the_wire(encode(bucket))), bucket)


def test_without_tensors_in_any_the_issues_tensor_bomb_builds_nothing(built: list[int]) -> None:
    error = reject(tensor_bomb(1_000_000), Decoder(tensors_in_any=False))
    assert error.kind == "tensor" and "not a tensor field" in error.detail
    assert built[0] == 0
