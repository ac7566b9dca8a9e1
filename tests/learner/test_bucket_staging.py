"""relay.learner.bucket_staging: host buffers are made once and handed out in turn, one whose send
may still be read is replaced, never refilled; the pipeline starts buckets ahead of the one
it yields; with copies that land late (as CUDA's do) and a slow sender, a buffer being sent
is never refilled. (The gather routes that use them: test_weight_buckets.py; the stream
that gives the buffers back: test_weights.py.)"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from relay.learner.bucket_staging import BufferSpec, HostBuffers, copy_to_host, pipelined


def test_buffers_are_made_once_and_handed_out_in_turn() -> None:
    """Two buffers alternate over many buckets; none is made beyond the first two."""
    buffers = HostBuffers(BufferSpec(nbytes=64, count=2, pinned=False))
    first, second = buffers.take(), buffers.take()
    assert first.data_ptr() != second.data_ptr() and first.numel() == 64
    for _ in range(10):
        buffers.sent(reusable=True)
        assert buffers.take().data_ptr() == first.data_ptr()
        buffers.sent(reusable=True)
        assert buffers.take().data_ptr() == second.data_ptr()
    assert buffers.made == 2


def test_a_buffer_whose_send_may_still_be_read_is_replaced() -> None:
    """sent(reusable=False) retires the oldest buffer handed out, with its contents intact;
    a new one takes its turn."""
    buffers = HostBuffers(BufferSpec(nbytes=8, count=1, pinned=False))
    lagging = buffers.take()
    lagging.fill_(7)
    buffers.sent(reusable=False)
    fresh = buffers.take()
    fresh.fill_(1)
    assert fresh.data_ptr() != lagging.data_ptr() and buffers.made == 2
    assert lagging.tolist() == [7] * 8


def test_taking_more_buffers_than_sent_is_refused_and_reclaim_replaces_them() -> None:
    buffers = HostBuffers(BufferSpec(nbytes=8, count=2, pinned=False))
    held = [buffers.take(), buffers.take()]
    with pytest.raises(RuntimeError, match="must call HostBuffers.sent"):
        buffers.take()
    buffers.reclaim()  # a version that ended early: both may still be read
    assert buffers.made == 4
    assert {buffers.take().data_ptr(), buffers.take().data_ptr()}.isdisjoint(
        {t.data_ptr() for t in held})


@pytest.mark.parametrize("ahead", [0, 1, 2])
def test_the_pipeline_starts_buckets_ahead_and_yields_them_in_order(ahead: int) -> None:
    events: list[str] = []

    def start(index: int):
        events.append(f"start {index}")
        return lambda: index

    got = []
    for index in pipelined(4, start, ahead):
        events.append(f"yield {index}")
        got.append(index)
    assert got == [0, 1, 2, 3]
    for index in range(4):  # bucket i+ahead started before bucket i is yielded, no more
        started = [e for e in events[:events.index(f"yield {index}")] if e.startswith("start")]
        assert started == [f"start {j}" for j in range(min(4, index + 1 + ahead))]


def test_a_slow_sender_never_reads_a_buffer_being_refilled() -> None:
    """Copies land in a thread a little later (as CUDA's asynchronous ones do) while the
    sender takes its time with each bucket: every bucket it sends holds its own bytes from
    the start of its send to the end. Fails if ``HostBuffers.sent`` gives back the newest
    buffer instead of the oldest (bucket i+2 would then be copied into bucket i+1's)."""
    count, nbytes = 6, 4096
    buckets = [torch.full((nbytes,), index + 1, dtype=torch.uint8) for index in range(count)]
    buffers = HostBuffers(BufferSpec(nbytes=nbytes, count=2, pinned=False))

    def start(index: int):
        buffer = buffers.take()

        def copy() -> None:
            time.sleep(0.02)
            copy_to_host([buffer], [buckets[index]])()

        copier = threading.Thread(target=copy)
        copier.start()

        def finish() -> tuple[int, torch.Tensor]:
            copier.join()
            return index, buffer
        return finish

    sent = []
    for index, buffer in pipelined(count, start, ahead=1):
        at_start = buffer.clone()
        time.sleep(0.06)  # the next bucket's copy lands meanwhile
        assert torch.equal(at_start, buffer), f"bucket {index} changed while it was sent"
        assert torch.equal(buffer, buckets[index]), index
        buffers.sent(reusable=True)
        sent.append(index)
    assert sent == list(range(count)) and buffers.made == 2


def test_copies_from_the_cpu_are_done_on_return() -> None:
    host = [torch.zeros(3), torch.zeros(2, 2, dtype=torch.bfloat16)]
    sources = [torch.arange(3.0), torch.ones(2, 2, dtype=torch.bfloat16)]
    wait = copy_to_host(host, sources)
    assert torch.equal(host[0], sources[0]) and torch.equal(host[1], sources[1])
    wait()
