"""The host memory rank 0 sends published buckets from, and gathering one bucket ahead.

On CUDA a bucket's gather (NCCL) and its copy to the host are queued on the device and the
host goes on at once. ``pipelined`` starts bucket i+1 that way before bucket i is handed to
the sender, so the device gathers i+1 while rank 0's host sends i; ``ahead=0`` (the CPU,
where every step is synchronous) is the plain loop.

``HostBuffers`` are bucket-sized buffers, made once for a plan and reused (pinned for a CUDA
source: then the copy is one DMA the host need not wait for). The invariant: a buffer is
refilled only after the send of the bucket in it ended. Buffers go out (``take``) and come
back (``sent``) in order, so with ``ahead`` buckets gathered beyond the one being sent,
``ahead + 1`` buffers suffice; a buffer whose send did not end (ZeroMQ still holds the
message for a lagging subscriber and reads it later) is never refilled but replaced.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import TypeVar

import msgspec
import torch

T = TypeVar("T")
Wait = Callable[[], None]


class BufferSpec(msgspec.Struct, frozen=True):
    """``count`` host buffers of ``nbytes`` each, page-locked when ``pinned``."""

    nbytes: int
    count: int
    pinned: bool


class HostBuffers:
    """The ring of ``spec.count`` host buffers (module docstring); ``made`` counts the
    buffers allocated so far: ``spec.count``, plus one for each replaced."""

    def __init__(self, spec: BufferSpec) -> None:
        if spec.count < 1 or spec.nbytes < 0:
            raise ValueError(f"host buffers need count >= 1 and nbytes >= 0, got {spec}")
        self.spec = spec
        self.made = 0
        self._free: deque[torch.Tensor] = deque(self._new() for _ in range(spec.count))
        self._out: deque[torch.Tensor] = deque()  # handed out, in order; not sent yet

    def _new(self) -> torch.Tensor:
        self.made += 1
        return torch.empty(self.spec.nbytes, dtype=torch.uint8, device="cpu",
                           pin_memory=self.spec.pinned)

    def take(self) -> torch.Tensor:
        """A buffer no send reads: the one least recently sent from."""
        if not self._free:
            raise RuntimeError(f"all {self.spec.count} host buffers hold buckets not sent yet: "
                               "the sender must call HostBuffers.sent after each bucket")
        buffer = self._free.popleft()
        self._out.append(buffer)
        return buffer

    def sent(self, reusable: bool) -> None:
        """The send of the oldest bucket handed out ended; ``reusable`` False: it may still
        be read (a lagging subscriber's queue holds it), so its buffer is replaced."""
        buffer = self._out.popleft()
        self._free.append(buffer if reusable else self._new())

    def reclaim(self) -> None:
        """Before a version: replace the buffers of one that ended before all its buckets
        were sent (their sends may not have ended)."""
        while self._out:
            self.sent(reusable=False)


def pipelined(count: int, start: Callable[[int], Callable[[], T]], ahead: int) -> Iterator[T]:
    """Yield ``start(i)()`` for ``i`` in ``range(count)``, calling ``start(j)`` for every
    ``j <= i + ahead`` before ``start(i)``'s result is waited for and yielded: what ``start``
    queues asynchronously (device gathers and copies) runs while the consumer works."""
    pending: deque[Callable[[], T]] = deque()
    started = 0
    for index in range(count):
        while started < min(count, index + 1 + ahead):
            pending.append(start(started))
            started += 1
        yield pending.popleft()()


def copy_to_host(host: list[torch.Tensor], sources: list[torch.Tensor]) -> Wait:
    """Copy each of ``sources`` into the host tensor beside it; the wait for the copies.

    From CUDA the copies are queued on the current stream, behind the work that computes
    the sources (their gathers), and the wait is the host waiting for an event recorded
    after them. The sources need no reference meanwhile: the caching allocator hands their
    memory out again only to work queued after the copies on the same stream. From the
    CPU the copies are done when this returns.
    """
    for target, source in zip(host, sources, strict=True):
        target.copy_(source, non_blocking=True)
    cuda = [s for s in sources if s.is_cuda]
    if not cuda:
        return lambda: None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(cuda[0].device))
    return event.synchronize
