"""A message's frames as one contiguous record, for files and collective broadcasts.

Record layout (little-endian):

    u32 number of frames, then per frame: u64 length, the frame's bytes

The rollout log (``relay.buffer.rollout_log``) stores records back to back; the learner
broadcasts a batch as one record to its other ranks. ``unpack`` returns views into the
record, no copies.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

_COUNT = struct.Struct("<I")
_LENGTH = struct.Struct("<Q")
MAX_FRAMES = 1 << 20


class RecordError(ValueError):
    """A record is truncated or its lengths do not add up."""


def pack(frames: Sequence[bytes | bytearray | memoryview]) -> bytes:
    parts = [_COUNT.pack(len(frames))]
    for frame in frames:
        view = memoryview(frame).cast("B")
        parts += [_LENGTH.pack(view.nbytes), view]
    return b"".join(parts)


def unpack(record: bytes | bytearray | memoryview) -> list[memoryview]:
    """Frames of one whole record; raises ``RecordError`` if it is not exactly one."""
    frames, end = unpack_from(memoryview(record).cast("B"), 0)
    if end != len(memoryview(record).cast("B")):
        raise RecordError(f"{len(record) - end} trailing bytes after the record")
    return frames


def unpack_from(view: memoryview, offset: int) -> tuple[list[memoryview], int]:
    """Frames of the record starting at ``offset`` and the offset just past it."""
    if offset + _COUNT.size > len(view):
        raise RecordError(f"truncated record header at byte {offset}")
    (count,) = _COUNT.unpack_from(view, offset)
    if count > MAX_FRAMES:
        raise RecordError(f"record at byte {offset} claims {count} frames")
    offset += _COUNT.size
    frames = []
    for _ in range(count):
        if offset + _LENGTH.size > len(view):
            raise RecordError(f"truncated frame length at byte {offset}")
        (length,) = _LENGTH.unpack_from(view, offset)
        offset += _LENGTH.size
        if offset + length > len(view):
            raise RecordError(f"frame of {length} bytes at byte {offset} runs past the end")
        frames.append(view[offset:offset + length])
        offset += length
    return frames, offset
