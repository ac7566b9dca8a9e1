"""Publishing weight versions: streamed once to every subscriber, bucket by bucket.

A publish (``publish_weights``, a collective) gathers the policy one bucket at a time
(``relay.learner.weight_buckets``) while rank 0 streams it on its ``WeightStream`` (ZeroMQ PUB,
``topology.learner.weights_stream_port``): the version's ``WeightManifest``, then its
``WeightBucket``s. Each bucket is sent once, every subscriber's queue sharing its bytes, and
rank 0 waits until ZeroMQ has written it to every subscriber's connection before its buffer
is filled again, so no rank ever holds the version: rank 0 gathers into host buffers made
once (``relay.learner.bucket_staging``: one bucket on the CPU; on CUDA two pinned ones, the next
bucket gathered while one is sent), however many generators listen. Every message is
waited for that way, so none waits in a queue when the next is sent. A subscriber that
stops reading is waited for at most ``send_wait_s(bucket)`` once per version; ZeroMQ then
holds at most ``STREAM_HWM`` messages for it (their buffers are replaced, not refilled)
and drops the rest, and it must ask again. The rest of that version is still paced
(``catch_up_s``): each bucket is waited for as long as a subscriber reading at
``MIN_SUBSCRIBER_BYTES_PER_S`` needs for it, so the subscribers that do read keep up
instead of overflowing their own queues (only the few messages the stuck queue still takes
wait that long, and all of that pacing together at most as long again as the first wait).

Generators and the evaluator subscribe (``relay.generators.weight_receiver``). One that subscribed
after a version went by, or lost part of it, learns from the ``WeightServer`` (ROUTER,
``weights_port``; ``WeightRequest``) that it is behind and asks again with ``resend``. The
learner streams its policy again while it waits for a batch (``TrainLoop``) if the policy
is still the newest version; otherwise the next publish brings everyone up to date.

The same server answers the evaluator's ``EvalRequest``s from the evaluation queue
(``relay.learner.eval_queue``); the offered weights themselves went by on the stream, followed
by an ``EvalOffer`` naming them. Only a peer in the evaluator's role may send one
(``relay.transport.roles``: under CURVE, the evaluator's or the control hosts' key; others are
answered ``forbidden``). A request frame over ``MAX_REQUEST_BYTES`` drops its
sender's connection before it is read. Who may fetch weights is decided by CURVE
(``relay.transport.security``), on both sockets. When the server's thread dies, ``published``
raises ``ThreadDied`` naming it: the learner stops rather than train on while no
generator can learn of new weights.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

import msgspec
import torch
import torch.distributed as dist
from torch import nn

from relay.learner.bucket_staging import BufferSpec, HostBuffers
from relay.learner.eval_queue import EvalQueue
from relay.learner.weight_buckets import BucketPlan, buffer_spec, gather_buckets
from relay.transport.messages import (
    ErrorReply,
    EvalOffer,
    EvalRequest,
    Message,
    StreamBeacon,
    WeightBucket,
    WeightManifest,
    WeightRequest,
)
from relay.transport.roles import PeerRoles
from relay.transport.security import ServerKeys
from relay.transport.sockets import Peer, Publisher, Server, ServerThread

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 1 << 20  # requests are small (a version number, an eval report)
STREAM_HWM = 4  # messages ZeroMQ queues for one subscriber before dropping its next ones
MIN_SUBSCRIBER_BYTES_PER_S = 20e6  # a subscriber slower than this is not waited for


def catch_up_s(nbytes: int) -> float:
    """How long a bucket of ``nbytes`` is waited for once a subscriber lags: what a
    subscriber reading at ``MIN_SUBSCRIBER_BYTES_PER_S`` needs for it."""
    return nbytes / MIN_SUBSCRIBER_BYTES_PER_S


def send_wait_s(nbytes: int) -> float:
    """How long a bucket of ``nbytes`` is waited for: 10 s, or ``catch_up_s`` for a bucket
    that takes longer."""
    return max(10.0, catch_up_s(nbytes))


class StreamStats(msgspec.Struct):
    """One streamed version: bytes sent, seconds taken, whether a subscriber lagged."""

    version: int
    total_bytes: int
    seconds: float
    lagging: bool


class WeightStream:
    """Rank 0's PUB socket for weight versions and evaluation offers."""

    def __init__(self, endpoint: str, keys: ServerKeys | None = None) -> None:
        self._publisher = Publisher(endpoint, keys=keys, hwm=STREAM_HWM)
        self.endpoint = self._publisher.endpoint
        self._buffers: HostBuffers | None = None
        logger.info("streaming weights on %s", self.endpoint)

    def host_buffers(self, spec: BufferSpec) -> HostBuffers:
        """The host buffers buckets are gathered into and sent from: made for the first
        version and kept while ``spec`` (the plan's, ``buffer_spec``) stays the same."""
        if self._buffers is None or self._buffers.spec != spec:
            self._buffers = HostBuffers(spec)
        self._buffers.reclaim()
        return self._buffers

    def send_version(self, manifest: WeightManifest, buckets: Iterable[WeightBucket | None],
                     buffers: HostBuffers | None = None) -> StreamStats:
        """Send ``manifest`` then each bucket ``buckets`` yields, waiting for each (module
        docstring); the iterator is consumed bucket by bucket, never held whole. With
        ``buffers`` (the buckets are views of them), each bucket's buffer is given back
        once its send ended, or replaced when a lagging subscriber may still read it."""
        began = time.monotonic()
        lagging = not self._publisher.send(manifest, send_wait_s(0))
        pace_until = time.monotonic() + send_wait_s(0)  # once lagging: pace until then
        for bucket in buckets:
            assert bucket is not None
            nbytes = sum(t.numel() * t.element_size() for t in bucket.tensors)
            if lagging:
                wait_s = max(0.0, min(catch_up_s(nbytes), pace_until - time.monotonic()))
            else:
                wait_s = send_wait_s(nbytes)
            written = self._publisher.send(bucket, wait_s)
            if buffers is not None:
                buffers.sent(reusable=written)
            if not written and not lagging:
                lagging, pace_until = True, time.monotonic() + wait_s
            del bucket
        if lagging:
            logger.warning("a subscriber does not read weight version %d; it will miss it and "
                           "ask again", manifest.version)
        return StreamStats(version=manifest.version, total_bytes=manifest.total_bytes,
                           seconds=time.monotonic() - began, lagging=lagging)

    def offer(self, offer: EvalOffer) -> None:
        if not self._publisher.send(offer, send_wait_s(0)):
            logger.warning("a subscriber does not read the weight stream: the evaluator may "
                           "miss the offer of step %d", offer.step)

    def beacon(self) -> None:
        """Send a ``StreamBeacon``: a subscriber that hears it knows it is subscribed."""
        self._publisher.send(StreamBeacon())

    def close(self) -> None:
        self._publisher.close()


def publish_weights(model: nn.Module, plan: BucketPlan, dtype: torch.dtype, *, version: int,
                    step: int, stream: WeightStream | None,
                    group: dist.ProcessGroup | None = None) -> StreamStats | None:
    """Gather ``model`` bucket by bucket and stream it as ``version`` taken after ``step``
    (a collective: every rank calls it; rank 0 passes its stream, the others None). Rank 0
    gathers into its stream's host buffers, made once for ``plan``."""
    if stream is None:
        for _ in gather_buckets(model, plan, dtype, version, group):
            pass
        return None
    buffers = stream.host_buffers(buffer_spec(model, plan))
    buckets = gather_buckets(model, plan, dtype, version, group, buffers)
    return stream.send_version(plan.manifest(version, step), buckets, buffers)


class WeightServer:
    """Tells generators the newest version and collects their resend wishes; serves the
    evaluation queue to the evaluator. Its own thread and socket."""

    def __init__(self, endpoint: str, keys: ServerKeys | None = None,
                 evaluation: EvalQueue | None = None) -> None:
        self._latest = WeightManifest(version=0)  # no buckets: a name for the version
        self._resend = threading.Event()
        self.evaluation = evaluation or EvalQueue()
        self.roles = PeerRoles()
        self.forbidden = 0  # EvalRequests refused: the sender is not the evaluator
        self._server = Server(endpoint, self._handle, keys=keys,
                              max_message_bytes=MAX_REQUEST_BYTES)
        self.endpoint = self._server.endpoint
        self._thread = ServerThread(self._server, name="weight-server")

    def start(self) -> WeightServer:
        self._thread.start()
        logger.info("serving weight versions on %s", self.endpoint)
        return self

    def published(self, version: int, step: int) -> None:
        """``version`` (taken after ``step``) is the newest, and has been streamed."""
        self._thread.raise_if_died()
        self._latest = WeightManifest(version=version, step=step)

    @property
    def version(self) -> int:
        return self._latest.version

    @property
    def step(self) -> int:
        return self._latest.step

    def resend_wanted(self) -> bool:
        """A subscriber asked for the newest version again since ``take_resend``."""
        return self._resend.is_set()

    def take_resend(self) -> None:
        """A stream is starting: it answers every wish made so far."""
        self._resend.clear()

    def stop(self) -> None:
        self._thread.stop()

    # -- the server thread ---------------------------------------------------------------

    def _handle(self, msg: Message, peer: Peer) -> Message:
        if isinstance(msg, EvalRequest):
            refusal = self.roles.admit(peer, "evaluator")
            if refusal:
                self.forbidden += 1
                logger.warning("refused an EvalRequest from connection %s: %s",
                               peer.identity.hex(), refusal)
                return ErrorReply(code="forbidden", detail=refusal)
            return self.evaluation.handle(msg, self.version)
        if not isinstance(msg, WeightRequest):
            return ErrorReply(code="unexpected", detail=f"the weight server does not take "
                                                        f"{type(msg).__name__}")
        latest = self._latest
        if msg.resend and msg.have_version < latest.version and not self._resend.is_set():
            logger.info("%s missed weight version %d (it has %d): streaming it again when "
                        "the learner next waits for a batch", msg.generator_id,
                        latest.version, msg.have_version)
            self._resend.set()
        return latest
