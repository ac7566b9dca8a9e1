"""Messages to ZeroMQ frames and back, tensors as raw zero-copy frames.

Frames of one message (see ``relay.transport.messages``)::

    frame 0    b"RLY" + PROTOCOL_VERSION (one byte)
    frame 1    msgpack of the struct
    frame 2+   raw bytes of each large tensor, in the order the encoder met them

A tensor, wherever it sits in a message (a ``torch.Tensor`` field, or a value inside an
``Any`` field), is a msgpack extension of type ``TENSOR_EXT`` whose payload is the msgpack
array ``[dtype, shape, data]``: ``data`` is the raw bytes for tensors under the inline
threshold, else the index of the frame that holds them. Sending is zero-copy for large
tensors (a memoryview of the contiguous CPU tensor); so is receiving when the frames are
writable buffers such as ``zmq.Frame``: the tensor is a view over the received frame and
keeps it alive. A read-only frame (``bytes``) is copied once instead, so that no tensor
ever aliases immutable memory (this is why torch's non-writable-buffer warning never fires).

Decoding is strict: anything but a well-formed frame set of the expected message type
raises ``WireError`` with a ``kind`` and a detail naming the fault. Never pickle, never eval.
A decoder builds at most ``max_tensors`` tensors per message: each costs host memory and
time whatever its size (~0.5 KiB and ~4 us for a one-byte tensor, so a 15 MB frame of 1M of
them took 526 MiB and 4 s), so a receiver that faces untrusted peers passes the most its
own messages hold, and ``tensors_in_any=False`` when it expects tensors only in tensor
fields (the buffer: ``relay.buffer.main.request_decoder``).

This module knows bytes and tensors; it knows nothing of sockets, peers or request ids.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any, Generic, Protocol, TypeVar, get_args

import msgspec
import torch

from relay.transport.messages import PROTOCOL_VERSION, AnyMessage, Message, WireErrorKind

PREAMBLE = b"RLY"
PREAMBLE_FRAME = PREAMBLE + bytes([PROTOCOL_VERSION])
INLINE_THRESHOLD = 4096  # bytes; smaller tensors travel inside frame 1
TENSOR_EXT = 1  # msgpack extension type code of a tensor
MAX_TENSOR_DIMS = 32
MAX_TENSORS = 1 << 18
"""Tensors one message may hold unless its decoder says otherwise. The largest honest
message is a ``SampleBatch`` (train_batch_size x n samples, 4 tensors each): 262,144 covers
65,536 samples a batch, 4x verl's largest usual (1024 prompts x 16); a message at the cap
costs a receiver about 130 MiB of tensor objects (measured), however few bytes it had."""

_UNTYPED_TENSOR = "a tensor in a field that is not a tensor field (this receiver takes none there)"

WIRE_ERROR_KINDS: tuple[str, ...] = get_args(WireErrorKind)
"""Why a frame set was rejected. ``envelope``: the request-reply envelope frame is wrong
(raised by ``relay.transport.sockets``); ``preamble``: frame 0 is not ``b"RLY"`` + one byte;
``version``: another protocol version; ``malformed``: too few frames or the body is not
valid msgpack; ``schema``: valid msgpack but not an expected message (unknown tag, wrong
field type, missing field); ``tensor``: bad tensor metadata or tensor frames."""

ALLOWED_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "bool int8 int16 int32 int64 uint8 float16 bfloat16 float32 float64 "
        "float8_e4m3fn float8_e5m2"
    ).split()
}
_DTYPE_NAMES = {dtype: name for name, dtype in ALLOWED_DTYPES.items()}
_NOT_IN_NUMPY = {torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2}

M = TypeVar("M", bound=Message)


class WireError(Exception):
    """A received frame set was rejected; ``kind`` is one of ``WIRE_ERROR_KINDS``."""

    def __init__(self, kind: WireErrorKind, detail: str) -> None:
        self.kind = kind
        self.detail = detail
        super().__init__(f"{kind}: {detail}")


class _HasBuffer(Protocol):
    """A zmq.Frame, or anything else exposing its bytes as ``.buffer``."""

    @property
    def buffer(self) -> memoryview: ...


FrameLike = bytes | bytearray | memoryview | _HasBuffer
_HEADER_ENCODER = msgspec.msgpack.Encoder()
_HEADER_DECODER = msgspec.msgpack.Decoder(tuple[str, list[int], bytearray | int])


# ---------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------


def encode(msg: Message, *, inline_threshold: int = INLINE_THRESHOLD) -> list[bytes | memoryview]:
    """Frames of ``msg``: preamble, msgpack body, then one raw frame per large tensor.

    Tensors of ``inline_threshold`` bytes or more go as separate frames that alias the
    tensor's memory (non-contiguous tensors are made contiguous, non-CPU ones copied to
    CPU first); do not modify them until the frames are sent. Raises ``TypeError`` for a
    value msgpack cannot carry or a tensor dtype outside ``ALLOWED_DTYPES``.
    """
    frames: list[bytes | memoryview] = [PREAMBLE_FRAME, b""]

    def enc_hook(obj: Any) -> msgspec.msgpack.Ext:
        if isinstance(obj, torch.Tensor):
            return _tensor_ext(obj, frames, inline_threshold)
        raise TypeError(f"{type(obj).__name__} cannot travel on the wire")

    frames[1] = msgspec.msgpack.Encoder(enc_hook=enc_hook).encode(msg)
    return frames


def _tensor_ext(
    tensor: torch.Tensor, frames: list[bytes | memoryview], inline_threshold: int
) -> msgspec.msgpack.Ext:
    torch_dtype = tensor.dtype
    dtype = _DTYPE_NAMES.get(torch_dtype)
    if dtype is None or tensor.layout != torch.strided:
        raise TypeError(
            f"tensor of dtype {torch_dtype} / layout {tensor.layout} cannot travel; "
            f"dense tensors of dtype {sorted(ALLOWED_DTYPES)} can"
        )
    shape = list(tensor.shape)
    if not (tensor.is_cpu and tensor.is_contiguous()):
        tensor = tensor.cpu().contiguous()
    if tensor.requires_grad:
        tensor = tensor.detach()
    if torch_dtype in _NOT_IN_NUMPY:  # bf16, fp8: look at the same memory as uint8
        tensor = tensor.reshape(-1).view(torch.uint8)
    # A numpy view of the tensor's memory; it keeps the tensor alive for as long as a
    # frame references it.
    raw = tensor.numpy()
    data: bytes | int
    if raw.nbytes < inline_threshold:
        data = raw.tobytes()
    else:
        frames.append(memoryview(raw).cast("B"))
        data = len(frames) - 1
    return msgspec.msgpack.Ext(TENSOR_EXT, _HEADER_ENCODER.encode((dtype, shape, data)))


# ---------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------


class Decoder(Generic[M]):
    """Decodes frame sets into messages of one type (``AnyMessage`` by default).

    ``Decoder(VersionUpdate)`` or ``Decoder(Union[Attach, Heartbeat])`` accept only those;
    any other message is a ``schema`` error. A message holding more than ``max_tensors``
    tensors, wherever they sit (a tensor field or inside an ``Any`` field), is a ``tensor``
    error raised at the first one too many, before it is built. With ``tensors_in_any=False``
    a tensor inside an ``Any`` field is a ``tensor`` error too, and it is never built: the
    decoder builds a tensor only when msgspec hands it to a ``torch.Tensor`` field, so one
    more tensor arriving while the last is still unclaimed, or one unclaimed at the end, sat
    in an untyped field. Safe to share between threads.
    """

    def __init__(self, type: Any = AnyMessage, *, max_tensors: int = MAX_TENSORS,
                 tensors_in_any: bool = True) -> None:
        if max_tensors < 0:
            raise ValueError(f"max_tensors must be >= 0, got {max_tensors}")
        self.type, self.max_tensors, self.tensors_in_any = type, max_tensors, tensors_in_any
        self._msgpack = msgspec.msgpack.Decoder(type, ext_hook=self._ext_hook,
                                                dec_hook=self._dec_hook)
        self._local = threading.local()  # the frame set being decoded by this thread

    def decode(self, frames: Sequence[FrameLike]) -> M:
        """The message in ``frames``, or ``WireError`` saying why there is none."""
        views = [_byte_view(frame) for frame in frames]
        check_preamble(views)
        if len(views) < 2:
            raise WireError(
                "malformed", f"expected at least 2 frames (preamble, body), got {len(views)}"
            )
        self._local.frames, self._local.used, self._local.tensors = views, set(), 0
        self._local.unclaimed = False  # a tensor read but not yet given to a tensor field
        try:
            msg = self._msgpack.decode(views[1])
            if self._local.unclaimed:
                raise WireError("tensor", _UNTYPED_TENSOR)
        except msgspec.ValidationError as exc:
            raise WireError("schema", f"not a {_type_name(self.type)}: {exc}") from None
        except msgspec.DecodeError as exc:
            raise WireError("malformed", f"frame 1 is not valid msgpack: {exc}") from None
        except WireError:
            raise
        except Exception as exc:  # decoding must only ever fail with WireError
            raise WireError("malformed", f"undecodable body: {type(exc).__name__}: {exc}") from exc
        finally:
            used, self._local.frames = self._local.used, ()
        unreferenced = sorted(set(range(2, len(views))) - used)
        if unreferenced:
            raise WireError("tensor", f"frames {unreferenced} are not referenced by any tensor")
        return msg

    def _ext_hook(self, code: int, payload: memoryview) -> torch.Tensor | _TensorHeader:
        if code != TENSOR_EXT:
            raise WireError(
                "malformed", f"unknown msgpack extension type {code} (tensors are {TENSOR_EXT})"
            )
        self._local.tensors += 1
        if self._local.tensors > self.max_tensors:
            raise WireError("tensor", f"more than {self.max_tensors} tensors in one message")
        header = _read_header(payload)
        if self.tensors_in_any:
            return self._build(header)
        if self._local.unclaimed:  # the last one went to a field that is not a tensor
            raise WireError("tensor", _UNTYPED_TENSOR)
        self._local.unclaimed = True
        return header

    def _dec_hook(self, type: Any, obj: Any) -> Any:
        if type is not torch.Tensor:
            raise NotImplementedError(f"no decoder for {type}")
        if isinstance(obj, torch.Tensor):
            return obj  # built by _ext_hook
        if isinstance(obj, _TensorHeader):
            self._local.unclaimed = False
            return self._build(obj)
        raise TypeError(f"Expected a tensor, got {obj.__class__.__name__}")

    def _build(self, header: _TensorHeader) -> torch.Tensor:
        dtype, shape, data = header.dtype, header.shape, header.data
        nbytes = math.prod(shape) * dtype.itemsize
        buffer = data if isinstance(data, bytearray) else self._claim_frame(data)
        if len(buffer) != nbytes:
            where = "inline data" if isinstance(data, bytearray) else f"frame {data}"
            raise WireError(
                "tensor", f"{header.dtype_name}{shape} needs {nbytes} bytes, {where} holds "
                          f"{len(buffer)}"
            )
        if nbytes == 0:
            try:
                return torch.empty(shape, dtype=dtype)
            except RuntimeError as exc:  # e.g. dims whose product overflows int64
                raise WireError("tensor", f"empty tensor of shape {shape}: {exc}") from None
        if isinstance(buffer, memoryview) and buffer.readonly:
            buffer = bytearray(buffer)  # never alias immutable memory (see module docstring)
        tensor = torch.frombuffer(buffer, dtype=dtype)  # (numel,)
        return tensor if len(shape) == 1 else tensor.view(shape)

    def _claim_frame(self, index: int) -> memoryview:
        frames, used = self._local.frames, self._local.used
        if not 2 <= index < len(frames):
            raise WireError("tensor", f"tensor frame index {index} outside 2..{len(frames) - 1}")
        if index in used:
            raise WireError("tensor", f"frame {index} is referenced by two tensors")
        used.add(index)
        return frames[index]


def check_preamble(frames: Sequence[memoryview]) -> None:
    """Raise ``WireError`` unless frame 0 is ``b"RLY"`` + this ``PROTOCOL_VERSION``."""
    if not frames:
        raise WireError("malformed", "empty frame set")
    head = bytes(frames[0][:8])
    if len(frames[0]) != len(PREAMBLE_FRAME) or head[: len(PREAMBLE)] != PREAMBLE:
        raise WireError("preamble", f"frame 0 is {head!r}..., expected {PREAMBLE_FRAME!r}")
    if head[-1] != PROTOCOL_VERSION:
        raise WireError(
            "version", f"peer speaks protocol version {head[-1]}, this side {PROTOCOL_VERSION}"
        )


def _check_shape(shape: list[int]) -> None:
    if len(shape) > MAX_TENSOR_DIMS:
        raise WireError("tensor", f"shape has {len(shape)} dims, at most {MAX_TENSOR_DIMS} allowed")
    if shape and not (0 <= min(shape) and max(shape) < 2**62):
        raise WireError("tensor", f"shape {shape} has a negative or absurd dimension")


class _TensorHeader:
    """A tensor's checked header (``[dtype, shape, data]``), read but not yet built."""

    __slots__ = ("data", "dtype", "dtype_name", "shape")

    def __init__(self, dtype_name: str, shape: list[int], data: bytearray | int) -> None:
        self.dtype_name, self.shape, self.data = dtype_name, shape, data
        self.dtype = ALLOWED_DTYPES[dtype_name]


def _read_header(payload: memoryview) -> _TensorHeader:
    try:
        dtype_name, shape, data = _HEADER_DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError("tensor", f"tensor header is not [dtype, shape, data]: {exc}") from None
    if dtype_name not in ALLOWED_DTYPES:
        raise WireError("tensor", f"dtype {dtype_name!r} is not one of {sorted(ALLOWED_DTYPES)}")
    _check_shape(shape)
    return _TensorHeader(dtype_name, shape, data)


def _byte_view(frame: FrameLike) -> memoryview:
    view = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
    return view if view.ndim == 1 and view.itemsize == 1 else view.cast("B")


def _type_name(type: Any) -> str:
    args = get_args(type)
    return "message of the expected type" if len(args) > 1 else getattr(type, "__name__", str(type))
