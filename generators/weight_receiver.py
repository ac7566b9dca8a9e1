"""Fetching weight versions from the learner in the background, staged for the engine.

A daemon thread asks the learner's weight server (``learner.weights``) for anything
newer than what this generator has, every ``poll_s`` seconds. A version arrives as a
``WeightManifest`` and its ``WeightBucket``s; it is staged only when every tensor of the
manifest arrived with the announced dtype and shape, so the engine applies a version whole
or not at all. The generator's compute loop never touches the socket: it calls ``take``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import msgspec
import torch

from transport.messages import Message, WeightBucket, WeightManifest, WeightRequest
from transport.security import ClientKeys
from transport.sockets import Client, PeerTimeout, RemoteError
from transport.threads import WatchedThread

logger = logging.getLogger(__name__)


class StagedWeights(msgspec.Struct, frozen=True):
    version: int
    tensors: dict[str, torch.Tensor]


class IncompleteVersion(ValueError):
    """The buckets of a version do not match its manifest."""


def assemble(manifest: WeightManifest, buckets: list[WeightBucket]) -> StagedWeights:
    """Check buckets against the manifest and return the whole version."""
    if len(buckets) != manifest.num_buckets:
        raise IncompleteVersion(f"version {manifest.version}: {len(buckets)} of "
                                f"{manifest.num_buckets} buckets")
    tensors: dict[str, torch.Tensor] = {}
    arrived_in: dict[str, int] = {}
    for index, bucket in enumerate(buckets):
        if bucket.version != manifest.version or bucket.index != index:
            raise IncompleteVersion(f"bucket {bucket.index} of version {bucket.version} where "
                                    f"bucket {index} of version {manifest.version} was due")
        if len(bucket.names) != len(bucket.tensors):
            raise IncompleteVersion(f"bucket {index}: {len(bucket.names)} names, "
                                    f"{len(bucket.tensors)} tensors")
        tensors.update(zip(bucket.names, bucket.tensors))
        arrived_in.update(dict.fromkeys(bucket.names, index))
    for entry in manifest.entries:
        tensor = tensors.get(entry.name)
        if tensor is None:
            raise IncompleteVersion(f"version {manifest.version}: {entry.name} never arrived")
        if arrived_in[entry.name] != entry.bucket:
            raise IncompleteVersion(f"{entry.name} arrived in bucket {arrived_in[entry.name]}, "
                                    f"the manifest says bucket {entry.bucket}")
        dtype = str(tensor.dtype).removeprefix("torch.")
        if list(tensor.shape) != entry.shape or dtype != entry.dtype:
            raise IncompleteVersion(f"{entry.name}: got {tensor.dtype} {list(tensor.shape)}, "
                                    f"manifest says {entry.dtype} {entry.shape}")
    if len(tensors) != len(manifest.entries):
        raise IncompleteVersion(f"version {manifest.version}: {len(tensors)} tensors for "
                                f"{len(manifest.entries)} manifest entries")
    return StagedWeights(version=manifest.version, tensors=tensors)


def receive_version(first: Message,
                    rest: Iterator[Message]) -> tuple[WeightManifest, StagedWeights | None]:
    """The manifest that opens a weight server's replies and, when buckets follow it, the
    whole version they make (``IncompleteVersion`` when they do not)."""
    if not isinstance(first, WeightManifest):
        raise IncompleteVersion(f"expected a WeightManifest, got {type(first).__name__}")
    if first.num_buckets == 0:
        return first, None
    return first, assemble(first, [b for b in rest if isinstance(b, WeightBucket)])


class WeightReceiver:
    """Keeps the newest complete version from the learner staged until ``take``n."""

    def __init__(self, endpoint: str, generator_id: str, *, keys: ClientKeys | None = None,
                 poll_s: float = 0.5, timeout_s: float = 30.0) -> None:
        self.endpoint, self.generator_id = endpoint, generator_id
        self._keys, self._poll_s, self._timeout_s = keys, poll_s, timeout_s
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._staged: StagedWeights | None = None
        self._have = 0  # newest version staged or applied
        self._stop = threading.Event()
        self._thread = WatchedThread(self._run, "weight-receiver", on_death=self._wake_waiters)

    def start(self, applied_version: int) -> WeightReceiver:
        self._have = applied_version
        self._thread.start()
        return self

    def stop(self, timeout_s: float | None = None) -> None:
        """End the polling thread; wait for a poll in progress up to ``timeout_s`` (default:
        a request's own timeout)."""
        self._stop.set()
        with self._arrived:
            self._arrived.notify_all()
        if self._thread.is_alive():
            self._thread.join(self._timeout_s if timeout_s is None else timeout_s)

    def take(self) -> StagedWeights | None:
        """The staged version, if any, handed over once."""
        with self._lock:
            staged, self._staged = self._staged, None
            return staged

    def raise_if_died(self) -> None:
        """``ThreadDied`` when the receiving thread ended on an exception."""
        self._thread.raise_if_died()

    def wait_for(self, version: int, timeout_s: float) -> StagedWeights | None:
        """Block until a version >= ``version`` is staged (then take it) or the timeout;
        ``ThreadDied`` if the receiving thread dies meanwhile."""
        deadline = time.monotonic() + timeout_s
        with self._arrived:
            while (self._staged is None or self._staged.version < version) \
                    and not self._stop.is_set():
                self.raise_if_died()
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._arrived.wait(left)
            staged, self._staged = self._staged, None
            return staged

    def _wake_waiters(self) -> None:
        with self._arrived:
            self._arrived.notify_all()

    def _run(self) -> None:
        client = Client(self.endpoint, keys=self._keys)
        try:
            while not self._stop.wait(self._poll_s):
                self._poll(client)
        finally:
            client.close()

    def _poll(self, client: Client) -> None:
        try:
            replies = client.request_stream(WeightRequest(generator_id=self.generator_id,
                                                          have_version=self._have),
                                            self._timeout_s)
            manifest, staged = receive_version(next(replies), replies)
        except PeerTimeout:
            logger.debug("weight server %s did not answer; retrying", self.endpoint)
            return
        except (IncompleteVersion, RemoteError) as exc:
            logger.warning("discarded a weight version from %s: %s", self.endpoint, exc)
            return
        if staged is None:  # up to date
            return
        with self._arrived:
            if staged.version > self._have:
                self._staged, self._have = staged, staged.version
                self._arrived.notify_all()
        logger.info("staged weights version %d (%d tensors, %.1f MB)", staged.version,
                    len(staged.tensors), manifest.total_bytes / 1e6)
