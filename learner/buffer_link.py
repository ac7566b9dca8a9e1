"""The learner's link to the buffer: batches in, versions and the end of the run out.

Rank 0 alone talks to the buffer; it broadcasts each batch to the other ranks as one
``relay.transport.records`` record over the CPU process group (the same codec as the wire,
never pickle).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from relay.transport.codec import Decoder, encode
from relay.transport.messages import Ack, SampleBatch, SampleRequest, Shutdown, VersionUpdate
from relay.transport.records import pack, unpack
from relay.transport.retry import patient_request
from relay.transport.security import ClientKeys
from relay.transport.sockets import Client, PeerTimeout

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 60.0
WAIT_LOG_EVERY_S = 30.0


class BufferLink:
    """Rank 0's requests to the buffer, each retried through a buffer stall for up to
    ``patience_s`` (``buffer.client_patience_s``; ``relay.transport.retry``), then ``PeerGone``."""

    def __init__(self, endpoint: str, patience_s: float, keys: ClientKeys | None = None) -> None:
        self._client = Client(endpoint, keys=keys)
        self.patience_s = patience_s

    def next_batch(self, num_groups: int, priorities: dict[str, float] | None = None, *,
                   step: int, interrupt: Callable[[], bool] = lambda: False
                   ) -> tuple[SampleBatch | None, float]:
        """Wait for a batch of ``num_groups`` groups for learner ``step``; return it and the
        seconds waited. A request retried after a lost reply names the same step, so the
        buffer sends the same batch again.

        ``priorities`` (replay priorities of the last batch, by rollout id) go with the
        first request only. When the buffer has no batch yet and ``interrupt()`` is true,
        return None instead of waiting on.
        """
        started = last_log = time.monotonic()
        request = SampleRequest(num_groups=num_groups, priorities=priorities or {}, step=step)
        while True:
            reply = patient_request(self._client, request, REQUEST_TIMEOUT_S, self.patience_s,
                                    expect=SampleBatch)
            assert isinstance(reply, SampleBatch)
            if reply.groups:
                return reply, time.monotonic() - started
            request = SampleRequest(num_groups=num_groups, step=step)
            if interrupt():
                return None, time.monotonic() - started
            now = time.monotonic()
            if now - last_log > WAIT_LOG_EVERY_S:
                last_log = now
                logger.info("waiting for rollouts for %.0f s (buffer holds %.0f groups, "
                            "%.0f generators attached)", now - started,
                            reply.buffer_stats.get("buffer/occupancy", 0),
                            reply.buffer_stats.get("buffer/generators", 0))
            time.sleep(reply.retry_after_s)

    def published(self, version: int, step: int) -> None:
        patient_request(self._client, VersionUpdate(version=version, step=step),
                        REQUEST_TIMEOUT_S, self.patience_s, expect=Ack)

    def end_run(self, reason: str) -> None:
        try:
            self._client.request(Shutdown(reason=reason), 10.0, expect=Ack)
        except PeerTimeout:
            logger.warning("the buffer did not acknowledge the end of the run")

    def close(self) -> None:
        self._client.close()


_DECODER = Decoder(SampleBatch)


def broadcast_batch(batch: SampleBatch | None,
                    group: dist.ProcessGroup | None) -> SampleBatch | None:
    """Rank 0 passes its batch, or None for no batch this time; every rank returns it."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return batch
    if dist.get_rank() == 0:
        record = None if batch is None else torch.frombuffer(
            bytearray(pack(encode(batch))), dtype=torch.uint8)
        size = torch.tensor([-1 if record is None else record.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    if int(size) < 0:
        return None
    if dist.get_rank() != 0:
        record = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(record, src=0, group=group)
    return batch if batch is not None else _DECODER.decode(
        [bytearray(f) for f in unpack(record.numpy().tobytes())])
