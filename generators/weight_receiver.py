"""Receiving weight versions from the learner's stream in the background, staged for the
engine.

A daemon thread subscribes to the learner's weight stream (``relay.learner.weights``) and builds
each version from its ``WeightManifest`` and ``WeightBucket``s (``VersionAssembler``); a
version is staged only when every row of every parameter arrived, in order, with the
announced dtype and shape, so the engine applies a version whole or not at all. Every
``poll_s`` seconds the thread also asks the learner's weight server which version is
newest; when it is behind at two polls in a row with nothing heard on the stream between
them (it subscribed after the version went by, or lost a piece), it asks for that version
again (``WeightRequest.resend``), but not in its first ``SUBSCRIBE_SETTLE_S``: a
subscription takes a moment to reach the learner, and what is streamed before it arrives
is lost. Only a message heard on the stream proves the subscription arrived
(``wait_subscribed``; the learner streams ``StreamBeacon``s while it waits for the
evaluator, whose offered versions are streamed once and never again). The generator's
compute loop never touches a socket: it takes the staged version with ``handover``.

Where a version is assembled (the engine says: ``Engine.staging_device``):

- On a CUDA engine, into a second copy of the weights on its device (``DeviceCopy``), bucket
  by bucket through one pinned bucket-sized staging buffer, on a side stream; the engine
  generates with its own weights meanwhile and copies the finished version in (a
  device-to-device copy) at a safe point, inside ``handover``, during which the receiving
  thread writes nothing into the copy. Host memory: about a bucket (the staging buffer and
  the frames in flight) instead of a version. Why not the alternatives: writing buckets into
  the live weights mixes versions within a decode step, and pausing decoding while a
  version streams in (vLLM pauses for its NCCL transfer) would stall generation for as long
  as the network takes, and leave half a version in the engine when a bucket is lost (the
  stream is lossy: a lagging subscriber drops messages and asks again). The price is a
  version's worth of device memory (without room for it, made at the first version, the
  receiver warns and goes on in host memory); a copy being filled is abandoned for a newer
  version, and one being handed over finishes first.
- Otherwise, whole in host memory (``HostVersion``): on the CPU a second copy would be a
  second host copy that stays, where a whole version is freed once loaded; engines in other
  processes (vLLM, SGLang) load host tensors. The evaluator too: it keeps each offered
  version until it is evaluated (offered versions are streamed once), so it keeps those
  whole, and the newest version only until a newer one starts (an offer names the newest
  version and comes before the next one).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Protocol

import msgspec
import torch

from relay.transport.messages import (
    EvalOffer,
    Message,
    StreamBeacon,
    WeightBucket,
    WeightEntry,
    WeightManifest,
    WeightRequest,
)
from relay.transport.security import ClientKeys
from relay.transport.sockets import Client, PeerTimeout, RemoteError, Subscriber
from relay.transport.threads import WatchedThread

logger = logging.getLogger(__name__)

SUBSCRIBE_SETTLE_S = 1.0


class StagedWeights(msgspec.Struct, frozen=True):
    version: int
    tensors: dict[str, torch.Tensor]


class IncompleteVersion(ValueError):
    """The buckets of a version do not match its manifest."""


class Placed(msgspec.Struct, frozen=True):
    """Rows ``start..`` of parameter ``entry``, as they came in a bucket."""

    entry: WeightEntry
    start: int
    piece: torch.Tensor


class VersionTarget(Protocol):
    """Where ``VersionAssembler`` puts a version's rows (module docstring)."""

    def start(self, manifest: WeightManifest) -> None:
        """A version of ``manifest``'s parameters begins."""

    def put(self, bucket: list[Placed]) -> None:
        """A bucket's pieces, checked: the rows continue their parameters."""

    def finish(self) -> dict[str, torch.Tensor]:
        """Every row arrived: the version's tensors, by name."""


class HostVersion:
    """A version whole in host memory: a parameter that came whole as it came (zero-copy:
    its frame's memory), one split across buckets copied into a tensor of its own."""

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}

    def start(self, manifest: WeightManifest) -> None:
        self._tensors = {}

    def put(self, bucket: list[Placed]) -> None:
        for placed in bucket:
            entry, piece = placed.entry, placed.piece
            if list(piece.shape) == entry.shape:
                self._tensors[entry.name] = piece
                continue
            if entry.name not in self._tensors:
                self._tensors[entry.name] = torch.empty(entry.shape, dtype=piece.dtype,
                                                        device="cpu")
            self._tensors[entry.name][placed.start:placed.start + len(piece)].copy_(piece)

    def finish(self) -> dict[str, torch.Tensor]:
        tensors, self._tensors = self._tensors, {}  # the version's memory goes with it
        return tensors


class DeviceCopy:
    """A second copy of the weights on ``device``, made once (again only for another set of
    names, shapes or dtypes) and filled bucket by bucket (module docstring).

    On CUDA a bucket goes into one pinned staging buffer (grown to the largest bucket), then
    to the device on a side stream; the next bucket waits until those copies are done before
    it refills the buffer, and waits on the device for the engine's reads of the copy
    (``read_by_engine``) before it overwrites them. Elsewhere each piece is copied in.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.tensors: dict[str, torch.Tensor] = {}
        self.made = 0  # times the copy was allocated
        self._layout: list[tuple[str, list[int], str]] = []
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._staging: torch.Tensor | None = None  # pinned, CUDA only
        self._copied: torch.cuda.Event | None = None  # the last bucket left the staging
        self._read: torch.cuda.Event | None = None  # the engine's reads of the copy queued

    def start(self, manifest: WeightManifest) -> None:
        layout = [(e.name, e.shape, e.dtype) for e in manifest.entries]
        if layout == self._layout:
            return
        if self._stream is not None:  # no copy into, or read of, the old one still queued
            torch.cuda.synchronize(self.device)
        self.tensors = {}  # the old copy freed first
        self.tensors = {name: torch.empty(shape, dtype=getattr(torch, dtype),
                                          device=self.device) for name, shape, dtype in layout}
        self._layout = layout
        self.made += 1

    def put(self, bucket: list[Placed]) -> None:
        if self._stream is None:
            for placed in bucket:
                self._rows(placed).copy_(placed.piece)
            return
        self._put_staged(bucket)

    def finish(self) -> dict[str, torch.Tensor]:
        if self._copied is not None:
            self._copied.synchronize()
        return self.tensors

    def read_by_engine(self) -> None:
        """The engine's reads of the copy are queued (on this thread's current stream): the
        next bucket waits for them before it writes."""
        if self._stream is not None:
            self._read = torch.cuda.Event()
            self._read.record(torch.cuda.current_stream(self.device))

    def _rows(self, placed: Placed) -> torch.Tensor:
        full = self.tensors[placed.entry.name]
        return full if full.dim() == 0 else full[placed.start:placed.start + len(placed.piece)]

    def _put_staged(self, bucket: list[Placed]) -> None:
        """CUDA: through the pinned staging buffer, on the side stream (class docstring)."""
        offsets, end = [], 0
        for placed in bucket:
            offsets.append(end)
            end += -(-placed.piece.nbytes // STAGING_ALIGN) * STAGING_ALIGN
        if self._copied is not None:
            self._copied.synchronize()  # the staging buffer's last copies are done
        if self._staging is None or self._staging.numel() < end:
            self._staging = None
            self._staging = torch.empty(end, dtype=torch.uint8, device="cpu",
                                        pin_memory=True)
        with torch.cuda.stream(self._stream):
            if self._read is not None:
                self._stream.wait_event(self._read)
                self._read = None
            for placed, offset in zip(bucket, offsets):
                piece = placed.piece
                staged = self._staging[offset:offset + piece.nbytes].view(piece.dtype)
                staged = staged.view(piece.shape)
                staged.copy_(piece)
                self._rows(placed).copy_(staged, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record(self._stream)


STAGING_ALIGN = 64  # bytes: each piece starts aligned in the staging buffer


class VersionAssembler:
    """Builds one version at a time from the stream's messages (``feed``) in ``target``
    (default: ``HostVersion``)."""

    def __init__(self, target: VersionTarget | None = None) -> None:
        self.target = target if target is not None else HostVersion()
        self._manifest: WeightManifest | None = None
        self._skipped: int | None = None  # a version whose buckets are not wanted
        self._entries: dict[str, WeightEntry] = {}
        self._rows: dict[str, int] = {}  # rows arrived so far, by parameter
        self._next_bucket = 0

    @property
    def version(self) -> int | None:
        """The version being assembled, if any."""
        return None if self._manifest is None else self._manifest.version

    def feed(self, msg: WeightManifest | WeightBucket) -> StagedWeights | None:
        """Take the next message; the whole version once its last bucket arrived.
        ``IncompleteVersion`` when the message does not continue the version in progress
        (it is then dropped, and the next manifest starts afresh)."""
        if isinstance(msg, WeightManifest):
            self._start(msg)
            return None
        manifest = self._manifest
        if manifest is None and msg.version == self._skipped:
            return None
        if manifest is None or msg.version != manifest.version \
                or msg.index != self._next_bucket:
            expected = "no bucket" if manifest is None else \
                f"bucket {self._next_bucket} of version {manifest.version}"
            self._manifest = None
            raise IncompleteVersion(f"bucket {msg.index} of version {msg.version} where "
                                    f"{expected} was due")
        try:
            self._take_bucket(msg)
        except IncompleteVersion:
            self._manifest = None
            raise
        self._next_bucket += 1
        if self._next_bucket < manifest.num_buckets:
            return None
        self._manifest = None
        missing = [name for name, entry in self._entries.items()
                   if self._rows[name] != _rows(entry.shape)]
        if missing:
            raise IncompleteVersion(f"version {manifest.version}: {missing[0]} (and "
                                    f"{len(missing) - 1} more) incomplete after the last bucket")
        return StagedWeights(version=manifest.version, tensors=self.target.finish())

    def skip(self, manifest: WeightManifest) -> None:
        """Drop ``manifest``'s version: its buckets are ignored without a word."""
        self._manifest, self._skipped = None, manifest.version

    def _start(self, manifest: WeightManifest) -> None:
        self._manifest = manifest if manifest.num_buckets > 0 else None
        self._skipped = None
        self._entries = {entry.name: entry for entry in manifest.entries}
        if len(self._entries) != len(manifest.entries):
            self._manifest = None
            raise IncompleteVersion(f"version {manifest.version}: a parameter is named twice")
        self._rows = dict.fromkeys(self._entries, 0)
        self._next_bucket = 0
        if self._manifest is not None:
            self.target.start(manifest)

    def _take_bucket(self, bucket: WeightBucket) -> None:
        """Check every piece of ``bucket``, then put them in the target."""
        if not len(bucket.names) == len(bucket.starts) == len(bucket.tensors):
            raise IncompleteVersion(f"bucket {bucket.index}: {len(bucket.names)} names, "
                                    f"{len(bucket.starts)} starts, {len(bucket.tensors)} tensors")
        placed = []
        for name, start, piece in zip(bucket.names, bucket.starts, bucket.tensors):
            entry = self._entries.get(name)
            if entry is None:
                raise IncompleteVersion(f"bucket {bucket.index}: {name} is not in the manifest")
            self._check(entry, start, piece)
            placed.append(Placed(entry=entry, start=start, piece=piece))
        self.target.put(placed)

    def _check(self, entry: WeightEntry, start: int, piece: torch.Tensor) -> None:
        """Rows ``start..`` of ``entry``: the whole parameter, or rows that continue it."""
        whole = list(piece.shape) == entry.shape
        rows_of_it = bool(entry.shape) and list(piece.shape[1:]) == entry.shape[1:] \
            and piece.dim() == len(entry.shape)
        if str(piece.dtype).removeprefix("torch.") != entry.dtype or not (whole or rows_of_it):
            raise IncompleteVersion(f"{entry.name}: a piece of {piece.dtype} "
                                    f"{list(piece.shape)}, the manifest says {entry.dtype} "
                                    f"{entry.shape}")
        if start != self._rows[entry.name]:
            raise IncompleteVersion(f"{entry.name}: rows from {start} where row "
                                    f"{self._rows[entry.name]} was due")
        rows = _rows(entry.shape)
        length = rows if whole else piece.shape[0]
        if start + length > rows:
            raise IncompleteVersion(f"{entry.name}: rows {start}..{start + length} of {rows}")
        self._rows[entry.name] = start + length


def _rows(shape: list[int]) -> int:
    return shape[0] if shape else 1


class WeightReceiver:
    """Keeps the newest complete version from the learner's stream staged until handed over.

    ``endpoint`` is the learner's weight server, ``stream_endpoint`` its weight stream;
    ``staging_device`` (the engine's ``Engine.staging_device``): assemble into a
    ``DeviceCopy`` there, else whole in host memory (module docstring). Subclasses decide
    what to keep by overriding ``_wants`` (a version announced), ``_starting`` (a wanted
    one begins), ``_arrived`` (a whole version) and ``_offered`` (an ``EvalOffer`` on the
    stream; ignored here).
    """

    def __init__(self, endpoint: str, stream_endpoint: str, generator_id: str, *,
                 keys: ClientKeys | None = None, poll_s: float = 0.5,
                 timeout_s: float = 30.0, staging_device: torch.device | None = None) -> None:
        self.endpoint, self.stream_endpoint = endpoint, stream_endpoint
        self.generator_id = generator_id
        self._keys, self._poll_s, self._timeout_s = keys, poll_s, timeout_s
        self.copy = DeviceCopy(staging_device) if staging_device is not None else None
        self._lock = threading.Lock()
        self._arrived_cv = threading.Condition(self._lock)
        # with a device copy: held while the receiving thread writes a bucket into it, and
        # while a handover reads it (a host version is the handover's own)
        self._copy_lock: AbstractContextManager = threading.Lock() if self.copy is not None \
            else nullcontext()
        self._staged: StagedWeights | None = None
        self._have = 0  # newest version staged or applied
        self._stop = threading.Event()
        self._heard = threading.Event()  # a message arrived on the stream: subscribed
        self._thread = WatchedThread(self._run, "weight-receiver", on_death=self._wake_waiters)
        self.resends = 0  # versions asked for again

    def start(self, applied_version: int) -> WeightReceiver:
        self._have = applied_version
        self._thread.start()
        return self

    def stop(self, timeout_s: float | None = None) -> None:
        """End the receiving thread; wait for a request in progress up to ``timeout_s``
        (default: a request's own timeout)."""
        self._stop.set()
        with self._arrived_cv:
            self._arrived_cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(self._timeout_s if timeout_s is None else timeout_s)

    @contextmanager
    def handover(self, at_least: int = 0, wait_s: float = 0.0
                 ) -> Iterator[StagedWeights | None]:
        """The staged version, if it is ``at_least`` (waiting up to ``wait_s`` for one),
        handed over once; until the block ends the receiving thread writes nothing into its
        tensors, so load them there. ``ThreadDied`` if the receiving thread dies meanwhile."""
        self._wait_staged(at_least, wait_s)
        if self._staged_version() < at_least:  # the usual answer: nothing to wait on
            yield None
            return
        with self._copy_lock:  # free: a staged copy is not written to, unless a newer
            with self._lock:  # version began just now
                staged = self._staged
                if staged is not None and staged.version >= at_least:
                    self._staged = None
                else:
                    staged = None
            try:
                yield staged
            finally:
                if staged is not None and self.copy is not None:
                    self.copy.read_by_engine()

    def take(self) -> StagedWeights | None:
        """The staged version, if any, handed over once to keep (a host version only: a
        device copy is refilled later, so load it inside ``handover``)."""
        self._check_keepable("take")
        with self.handover() as staged:
            return staged

    def raise_if_died(self) -> None:
        """``ThreadDied`` when the receiving thread ended on an exception."""
        self._thread.raise_if_died()

    def wait_subscribed(self, timeout_s: float) -> bool:
        """Block until a message has been heard on the stream (a ``StreamBeacon`` or a
        version): the subscription has reached the learner, and from then on no version
        streamed goes by unheard. False after ``timeout_s``; ``ThreadDied`` if the thread
        died."""
        deadline = time.monotonic() + timeout_s
        while not self._heard.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
            self.raise_if_died()
            if time.monotonic() >= deadline:
                return False
        return True

    def wait_for(self, version: int, timeout_s: float) -> StagedWeights | None:
        """Block until a version >= ``version`` is staged, then take it as ``take`` does,
        or None after ``timeout_s``; ``ThreadDied`` if the receiving thread dies meanwhile."""
        self._check_keepable("wait_for")
        with self.handover(at_least=version, wait_s=timeout_s) as staged:
            return staged

    def _check_keepable(self, method: str) -> None:
        if self.copy is not None:
            raise TypeError(f"WeightReceiver.{method} hands over a version to keep, and this "
                            f"receiver refills its copy on {self.copy.device}: load the "
                            "version inside 'with receiver.handover() as staged:'")

    def _staged_version(self) -> int:
        """The staged version's number; -1 when none is staged."""
        with self._lock:
            return -1 if self._staged is None else self._staged.version

    def _wait_staged(self, at_least: int, wait_s: float) -> None:
        """Until a version >= ``at_least`` is staged, at most ``wait_s``."""
        deadline = time.monotonic() + wait_s
        with self._arrived_cv:
            while (self._staged is None or self._staged.version < at_least) \
                    and not self._stop.is_set():
                self.raise_if_died()
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._arrived_cv.wait(left)

    # -- what to keep (the receiving thread, under the lock) -----------------------------

    def _wants(self, manifest: WeightManifest) -> bool:
        """Assemble ``manifest``'s version: only one newer than what this receiver has."""
        return manifest.version > self._have

    def _starting(self, manifest: WeightManifest) -> None:
        """A wanted version begins: a staged one in the device copy is overwritten by it."""
        if self.copy is not None:
            self._staged = None

    def _arrived(self, staged: StagedWeights) -> bool:
        """Keep ``staged`` if newer than what this receiver has; True when kept."""
        if staged.version <= self._have:
            return False
        self._staged, self._have = staged, staged.version
        return True

    def _offered(self, offer: EvalOffer) -> None:
        """An evaluation offer went by on the stream: nothing to do for a generator."""

    # -- the receiving thread ------------------------------------------------------------

    def _wake_waiters(self) -> None:
        with self._arrived_cv:
            self._arrived_cv.notify_all()

    def _run(self) -> None:
        stream = Subscriber(self.stream_endpoint, keys=self._keys)
        client = Client(self.endpoint, keys=self._keys)
        assembler = VersionAssembler(self.copy)
        heard = False  # a stream message since the last poll
        behind = False  # the last poll found a newer version than ours
        settled_at = time.monotonic() + SUBSCRIBE_SETTLE_S
        next_poll = time.monotonic() + self._poll_s
        try:
            while not self._stop.is_set():
                msg = stream.receive(timeout_s=max(0.0, min(0.05, next_poll - time.monotonic())))
                if msg is not None:
                    heard = True
                    self._heard.set()
                    self._handle(assembler, msg)
                    continue
                if time.monotonic() < next_poll:
                    continue
                resend = behind and not heard and time.monotonic() >= settled_at
                newest = self._ask_newest(client, resend=resend)
                if newest is not None:
                    behind, heard = newest > self._have, False
                next_poll = time.monotonic() + self._poll_s
        finally:
            stream.close()
            client.close()

    def _handle(self, assembler: VersionAssembler, msg: Message) -> None:
        if isinstance(msg, StreamBeacon):
            return  # it told ``wait_subscribed`` what it had to
        if isinstance(msg, EvalOffer):
            with self._lock:
                self._offered(msg)
            return
        if not isinstance(msg, WeightManifest | WeightBucket):
            logger.warning("ignored a %s on the weight stream", type(msg).__name__)
            return
        if isinstance(msg, WeightManifest):
            with self._lock:
                wanted = self._wants(msg)
                if wanted:
                    self._starting(msg)
            if not wanted:
                assembler.skip(msg)
                return
        try:
            with self._copy_lock:
                staged = assembler.feed(msg)
        except IncompleteVersion as exc:
            logger.warning("discarded a weight version from %s: %s", self.stream_endpoint, exc)
            return
        except torch.OutOfMemoryError as exc:  # making the device copy, at a manifest
            self._without_copy(assembler, exc)
            staged = assembler.feed(msg)
        if staged is None:
            return
        with self._arrived_cv:
            kept = self._arrived(staged)
            self._arrived_cv.notify_all()
        if kept:
            logger.debug("staged weights version %d (%d tensors, %.1f MB)", staged.version,
                         len(staged.tensors),
                         sum(t.numel() * t.element_size() for t in staged.tensors.values()) / 1e6)

    def _without_copy(self, assembler: VersionAssembler, exc: torch.OutOfMemoryError) -> None:
        """The device has no room for the copy: assemble whole in host memory from now on."""
        assert self.copy is not None
        logger.warning("no room on %s for a second copy of the weights (%s): assembling each "
                       "version whole in host memory instead; a lower gpu_memory_utilization "
                       "for the engine leaves room for it", self.copy.device,
                       str(exc).splitlines()[0])
        self.copy, self._copy_lock = None, nullcontext()
        assembler.target = HostVersion()

    def _ask_newest(self, client: Client, resend: bool) -> int | None:
        """The newest version the learner has published (None: no answer); with
        ``resend``, ask it to stream that version again."""
        if resend:
            self.resends += 1
            logger.info("weight version newer than %d went by unheard: asking for it again",
                        self._have)
        try:
            reply = client.request(WeightRequest(generator_id=self.generator_id,
                                                 have_version=self._have, resend=resend),
                                   self._timeout_s, expect=WeightManifest)
        except PeerTimeout:
            logger.debug("weight server %s did not answer; retrying", self.endpoint)
            return None
        except RemoteError as exc:
            logger.warning("the weight server refused a version request: %s", exc)
            return None
        return reply.version


class EvalWeights(WeightReceiver):
    """The evaluator's receiver: it keeps the newest version, and each version an
    ``EvalOffer`` names until it has been evaluated (``release``), at most
    ``max_waiting + 1`` of them (the oldest goes, with a warning, as the learner's
    evaluation queue skips it)."""

    def __init__(self, endpoint: str, stream_endpoint: str, *, max_waiting: int,
                 keys: ClientKeys | None = None, poll_s: float = 0.5) -> None:
        super().__init__(endpoint, stream_endpoint, "evaluator", keys=keys, poll_s=poll_s)
        self.max_waiting = max_waiting
        self._newest: StagedWeights | None = None
        self._kept: dict[int, StagedWeights] = {}  # by the step offered
        self._wanted: dict[int, int] = {}  # step -> version the evaluator waits for

    def weights_for(self, step: int, version: int, timeout_s: float) -> StagedWeights | None:
        """The weights offered as ``version`` after ``step``, waiting up to ``timeout_s``
        for them to arrive (None if they do not)."""
        deadline = time.monotonic() + timeout_s
        with self._arrived_cv:
            self._wanted[step] = version
            if self._newest is not None and self._newest.version == version:
                self._keep(step, self._newest)
            while step not in self._kept and not self._stop.is_set():
                self.raise_if_died()
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._arrived_cv.wait(left)
            del self._wanted[step]
            return self._kept.get(step)

    def release(self, step: int) -> None:
        """The weights offered after ``step`` are evaluated: drop them."""
        with self._lock:
            self._kept.pop(step, None)

    def _wants(self, manifest: WeightManifest) -> bool:
        """Every version: an older one may be wanted for a step (``weights_for``)."""
        return True

    def _starting(self, manifest: WeightManifest) -> None:
        """The newest version is no longer kept for an offer once a newer one begins: an
        offer names the newest version, and the learner streams it before the next."""
        if self._newest is not None and self._newest.version < manifest.version:
            self._newest = None

    def _arrived(self, staged: StagedWeights) -> bool:
        for step, version in self._wanted.items():
            if version == staged.version:
                self._keep(step, staged)
        if staged.version <= self._have:
            return False
        self._newest, self._have = staged, staged.version
        return True

    def _offered(self, offer: EvalOffer) -> None:
        if offer.version == 0:  # the initial checkpoint: the evaluator loaded it itself
            return
        if self._newest is None or self._newest.version != offer.version:
            logger.warning("step %d is offered for evaluation as version %d, which did not "
                           "arrive whole here", offer.step, offer.version)
            return
        self._keep(offer.step, self._newest)

    def _keep(self, step: int, staged: StagedWeights) -> None:
        self._kept[step] = staged
        while len(self._kept) > self.max_waiting + 1:
            oldest = min(self._kept)
            del self._kept[oldest]
            logger.warning("dropped the weights offered after step %d: more than %d wait "
                           "(trainer.max_waiting_evals)", oldest, self.max_waiting)
