"""Helpers shared by the transport tests: hand-made frame sets that a real encoder never emits."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from relay.transport.codec import PREAMBLE_FRAME, TENSOR_EXT


class Craft:
    """Builds frame sets field by field, so tests can lie about any part of them."""

    preamble = PREAMBLE_FRAME

    @staticmethod
    def body(tag: str, *fields: Any) -> bytes:
        """Frame 1 for a message given as its tag and positional fields (array-like)."""
        return msgspec.msgpack.encode([tag, *fields])

    @staticmethod
    def tensor(dtype: Any, shape: Any, data: Any) -> msgspec.msgpack.Ext:
        """A tensor extension with whatever header the test wants."""
        return msgspec.msgpack.Ext(TENSOR_EXT, msgspec.msgpack.encode([dtype, shape, data]))

    @classmethod
    def bucket(
        cls, *tensors: msgspec.msgpack.Ext, extra_frames: tuple[bytes, ...] = ()
    ) -> list[bytes]:
        """A ``WeightBucket`` frame set holding the given tensor extensions."""
        names = [f"w{i}" for i in range(len(tensors))]
        starts = [0] * len(tensors)
        return [cls.preamble, cls.body("weight_bucket", 1, 0, names, starts, list(tensors)),
                *extra_frames]


@pytest.fixture
def craft() -> type[Craft]:
    return Craft
