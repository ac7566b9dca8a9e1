"""ZeroMQ sockets that speak Relay's wire: request-reply and one-way streams.

Patterns, one class per role:

- ``Server`` (ROUTER) / ``Client`` (DEALER): requests, each with one reply.
- ``Pusher`` / ``Puller`` (PUSH/PULL): one-way streams that may lose messages at the
  source, e.g. metrics to the launcher. A full queue drops the message and counts it.
- ``Publisher`` / ``Subscriber`` (PUB/SUB): one sender, any number of receivers, each
  message sent once: every subscriber's queue references the same bytes (weight versions
  to the generators). A subscriber that connects late, or whose queue is full, misses
  messages; the protocol on top must notice (see ``relay.learner.weights``).

Request-reply envelope: one frame before the codec's frames, 9 bytes = request id (u64,
big-endian) + flags (u8, reserved: 0). A client keeps only the reply to the request it
waits for, and after a timeout it also replaces its socket (lazy pirate), so a late reply
is never taken for the answer to the next request. Replies to frames whose envelope is unreadable
carry request id 0, which no client uses.

Receivers never crash on bad input: each rejected frame set is counted in ``errors`` by
``WireError`` kind (and, on a ``Server``, answered with ``ErrorReply(code=kind)``). A
``Server`` also counts ``handler`` (the handler raised or returned no message) and
``unroutable`` (a reply could not be delivered within ``send_timeout_s``). A ``Server``
hands its handler each request's ``Peer``: the connection's identity and, under CURVE, the
name of the key it authenticated with; a bound ``Puller`` tells each message's key name
(``receive_from``). With ``max_message_bytes`` ZeroMQ refuses any frame larger than that
before buffering it (``zmq.MAXMSGSIZE``) by dropping the sender's
connection; ZeroMQ does not say why a connection dropped, so the server logs each drop
with the limit (see ``Server``). ``hwm`` counts whole messages: a receiver holds at most
``hwm`` queued messages per connection (plus the one being read), but ZeroMQ hands a
message over only once all its frames arrived and bounds neither their number nor their sum,
so one message of many frames, each under ``max_message_bytes``, is held whole.

Every bind goes through ``relay.transport.security.check_bind``: loopback and ipc may be plain,
anything reachable needs CURVE ``ServerKeys``. A socket belongs to one thread: drive a
``Server`` from the owner's loop with ``serve_once`` or give it a thread with
``ServerThread``; compute loops talk to sockets through such loops, never directly.

This module knows sockets, timeouts and counters; it does not know what messages mean.
"""

from __future__ import annotations

import itertools
import logging
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import zmq
from zmq.utils.monitor import recv_monitor_message

from relay.transport.codec import Decoder, WireError, encode
from relay.transport.endpoints import needs_ipv6
from relay.transport.messages import ErrorReply, Message
from relay.transport.security import (
    ClientKeys,
    CurveAuthenticator,
    Keys,
    ServerKeys,
    check_bind,
    secure_client,
)
from relay.transport.threads import WatchedThread

logger = logging.getLogger(__name__)

DEFAULT_HWM = 1000  # messages queued per peer before a send waits or drops
_ENVELOPE = struct.Struct(">QB")
MAX_DETAIL_CHARS = 300


@dataclass(frozen=True)
class Peer:
    """Who sent a request: ``identity``, the ZeroMQ routing identity of its connection (a
    new one for every connection), and under CURVE ``key``, the name of the key file it
    authenticated with (``relay.transport.security``; "" without CURVE)."""

    identity: bytes
    key: str = ""


Handler = Callable[[Message, Peer], Message]
"""``handler(message, peer)`` returns the reply."""
M = TypeVar("M", bound=Message)


class PeerTimeout(TimeoutError):
    """The peer at ``endpoint`` did not answer ``request`` within ``timeout_s``."""

    def __init__(self, endpoint: str, request: str, timeout_s: float) -> None:
        self.endpoint, self.request, self.timeout_s = endpoint, request, timeout_s
        super().__init__(
            f"no reply from {endpoint} to {request} within {timeout_s:g}s: is the peer "
            "running and reachable, (with CURVE) does it hold the right keys, and is the "
            "request under the peer's max_message_bytes (a larger frame is dropped unanswered)?"
        )


class RemoteError(RuntimeError):
    """The peer at ``endpoint`` refused a request (``ErrorReply``) or answered off-type."""

    def __init__(self, endpoint: str, code: str, detail: str) -> None:
        self.endpoint, self.code, self.detail = endpoint, code, detail
        super().__init__(f"{endpoint} answered {code}: {detail}")


# ---------------------------------------------------------------------------------------
# Socket set-up shared by every role
# ---------------------------------------------------------------------------------------


class _Socket:
    """One configured socket, bound or connected, plus the CURVE authenticator it owns.
    ``max_message_bytes`` bounds the frames it accepts (set before binding: a listener's
    connections take its options as they were at bind time)."""

    def __init__(
        self, kind: int, endpoint: str, *, bind: bool, keys: Keys | None, hwm: int,
        max_message_bytes: int | None = None,
    ) -> None:
        self.authenticator: CurveAuthenticator | None = None
        if bind:
            check_bind(endpoint, keys)
            if isinstance(keys, ServerKeys):
                self.authenticator = CurveAuthenticator(keys)
        elif keys is not None and not isinstance(keys, ClientKeys):
            raise TypeError(f"connecting to {endpoint} needs ClientKeys, got {type(keys).__name__}")
        context = self.authenticator.context if self.authenticator else zmq.Context.instance()
        try:
            self.zmq = context.socket(kind)
        except BaseException:
            if self.authenticator is not None:
                self.authenticator.close()
            raise
        try:
            self.zmq.linger = 0
            self.zmq.sndhwm = self.zmq.rcvhwm = hwm
            self.zmq.ipv6 = needs_ipv6(endpoint)
            if max_message_bytes is not None:
                self.zmq.maxmsgsize = max_message_bytes
            if self.authenticator is not None:
                self.authenticator.secure(self.zmq)
            elif isinstance(keys, ClientKeys):
                secure_client(self.zmq, keys)
            (self.zmq.bind if bind else self.zmq.connect)(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            verb = "bind" if bind else "connect to"
            raise OSError(exc.errno, f"cannot {verb} {endpoint}: {exc.strerror}") from exc
        except BaseException:
            self.close()
            raise
        self.endpoint = self.zmq.getsockopt_string(zmq.LAST_ENDPOINT) if bind else endpoint

    def close(self, linger_s: float = 0.0) -> None:
        self.zmq.close(linger=int(linger_s * 1000))
        if self.authenticator is not None:
            self.authenticator.close()
            self.authenticator = None

    def poll_in(self, timeout_s: float) -> bool:
        return bool(self.zmq.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN))


def _detail(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:MAX_DETAIL_CHARS]


def _request_id(frames: Sequence[zmq.Frame]) -> int:
    """The request id in a request's envelope frame, or ``WireError("envelope")``."""
    if not frames or len(frames[0]) != _ENVELOPE.size:
        size = len(frames[0]) if frames else "no"
        raise WireError(
            "envelope", f"expected a {_ENVELOPE.size}-byte envelope frame, got {size} bytes"
        )
    request_id, flags = _ENVELOPE.unpack(frames[0].bytes)
    if flags != 0:
        raise WireError("envelope", f"request flags must be 0, got {flags:#04x}")
    return request_id


# ---------------------------------------------------------------------------------------
# Request-reply
# ---------------------------------------------------------------------------------------


class Server:
    """Binds a ROUTER socket and answers each request with ``handler``'s reply.

    Backpressure: replies wait up to ``send_timeout_s`` when a peer's queue holds ``hwm``
    messages (ROUTER_MANDATORY), then count as ``unroutable``; requests beyond ``hwm``
    per peer wait in the peer's own queue.

    ``max_message_bytes`` (None: no limit) bounds every frame a peer sends: ZeroMQ drops
    the connection of a peer that sends a larger one, so its request is never answered
    (the client times out, and its ``PeerTimeout`` names the limit). The server logs every
    dropped connection at DEBUG, naming the limit: a peer closing its socket at the end of
    a run is the same event, and an orderly shutdown must not read like an error.
    """

    def __init__(
        self,
        endpoint: str,
        handler: Handler,
        *,
        decoder: Decoder[Any] | None = None,
        keys: ServerKeys | None = None,
        hwm: int = DEFAULT_HWM,
        send_timeout_s: float = 2.0,
        max_message_bytes: int | None = None,
    ) -> None:
        self._handler = handler
        self._decoder = decoder or Decoder()
        self._socket = _Socket(zmq.ROUTER, endpoint, bind=True, keys=keys, hwm=hwm,
                               max_message_bytes=max_message_bytes)
        self._socket.zmq.router_mandatory = 1
        self._socket.zmq.sndtimeo = int(send_timeout_s * 1000)
        self.endpoint = self._socket.endpoint  # with the real port when bound to ":*"
        self._drops: _DropLog | None = None
        if max_message_bytes is not None:
            self._drops = _DropLog(self._socket.zmq, self.endpoint, max_message_bytes)
        self.errors: Counter[str] = Counter()
        self.served = 0  # requests decoded and handed to the handler

    def serve_once(self, timeout_s: float) -> bool:
        """Handle at most one request, waiting up to ``timeout_s``; True if one came."""
        if self._drops is not None:
            self._drops.report()
        if not self._socket.poll_in(timeout_s):
            return False
        identity, *frames = self._socket.zmq.recv_multipart(copy=False)
        self._handle(Peer(identity.bytes, self._key_name(identity)), frames)
        return True

    def serve_until(self, stop: threading.Event, poll_s: float = 0.05) -> None:
        """Serve until ``stop`` is set, checking it at least every ``poll_s`` seconds."""
        while not stop.is_set():
            self.serve_once(poll_s)

    def close(self) -> None:
        if self._drops is not None:
            self._drops.close()
        self._socket.close()

    def _key_name(self, frame: zmq.Frame) -> str:
        """The CURVE key name ZAP gave the sender (``relay.transport.security``), or ""."""
        return frame.get("User-Id") if self._socket.authenticator is not None else ""

    def _handle(self, peer: Peer, frames: list[zmq.Frame]) -> None:
        identity = peer.identity
        request_id = 0
        try:
            request_id = _request_id(frames)
            message = self._decoder.decode(frames[1:])
        except WireError as exc:
            self.errors[exc.kind] += 1
            logger.debug("rejected frames from peer %s: %s", identity.hex(), exc)
            self._send(
                identity,
                request_id,
                ErrorReply(code=exc.kind, detail=exc.detail[:MAX_DETAIL_CHARS]),
            )
            return
        self.served += 1
        try:
            reply = self._handler(message, peer)
            if not isinstance(reply, Message):
                raise TypeError(f"handler returned {type(reply).__name__}, not a Message")
        except Exception as exc:  # a handler bug must not take the server down
            self.errors["handler"] += 1
            logger.exception(
                "handler failed on %s from peer %s", type(message).__name__, identity.hex()
            )
            reply = ErrorReply(code="handler", detail=_detail(exc))
        self._send(identity, request_id, reply)

    def _send(self, identity: bytes, request_id: int, reply: Message) -> bool:
        envelope = _ENVELOPE.pack(request_id, 0)
        try:
            self._socket.zmq.send_multipart([identity, envelope, *encode(reply)], copy=False)
        except zmq.ZMQError as exc:  # EAGAIN: peer not draining; EHOSTUNREACH: peer gone
            self.errors["unroutable"] += 1
            logger.warning("reply to peer %s dropped: %s", identity.hex(), exc)
            return False
        return True


class _DropLog:
    """Logs (DEBUG) every connection a server's socket loses, naming its frame size limit:
    ZeroMQ drops a peer that sends a frame over ``zmq.MAXMSGSIZE`` and reports only that a
    connection ended (the same event as a peer that closed its socket, which every peer
    does at an orderly shutdown)."""

    def __init__(self, socket: zmq.Socket, endpoint: str, limit: int) -> None:
        self.endpoint, self.limit = endpoint, limit
        self._socket = socket
        self._events = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    def report(self) -> None:
        """Log the connections lost since the last call; never waits."""
        while self._events.poll(0, zmq.POLLIN):
            recv_monitor_message(self._events)
            logger.debug("a peer's connection to %s ended: the peer closed it, or it sent a "
                         "frame over the %d-byte limit (max_message_bytes), which ZeroMQ "
                         "refuses by dropping the connection (that peer's request then times "
                         "out)", self.endpoint, self.limit)

    def close(self) -> None:
        self._socket.disable_monitor()
        self._events.close(linger=0)


class ServerThread:
    """Runs a ``Server`` in a daemon thread; ``stop()`` (or leaving ``with``) closes it.
    ``raise_if_died`` raises ``ThreadDied`` if the thread ended on an exception."""

    def __init__(self, server: Server, *, poll_s: float = 0.05, name: str = "relay-server") -> None:
        self.server = server
        self._stop = threading.Event()
        self._thread = WatchedThread(lambda: server.serve_until(self._stop, poll_s), name)

    def raise_if_died(self) -> None:
        self._thread.raise_if_died()

    def start(self) -> ServerThread:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self.server.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class Client:
    """Connects a DEALER socket; one request in flight at a time (not thread-safe).

    ``request`` waits for the reply. On ``PeerTimeout`` the socket is replaced, dropping the
    unanswered request and any reply that might still arrive for it.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        keys: ClientKeys | None = None,
        decoder: Decoder[Any] | None = None,
        hwm: int = DEFAULT_HWM,
    ) -> None:
        self.endpoint = endpoint
        self._keys, self._hwm = keys, hwm
        self._decoder = decoder or Decoder()
        self._socket: _Socket | None = None
        self._ids = itertools.count(1)
        self.stale_replies = 0  # replies dropped because they answered an older request

    @overload
    def request(self, msg: Message, timeout_s: float) -> Message: ...

    @overload
    def request(self, msg: Message, timeout_s: float, expect: type[M]) -> M: ...

    def request(self, msg: Message, timeout_s: float, expect: type[M] | None = None) -> Message:
        """Send ``msg`` and return the reply.

        With ``expect``, a reply of another type raises ``RemoteError`` (an ``ErrorReply``
        keeps its code). Raises ``PeerTimeout`` when no reply comes within ``timeout_s``.
        """
        request_id = self._send(msg, timeout_s)
        reply = self._receive(request_id, type(msg).__name__, timeout_s)
        if expect is not None and not isinstance(reply, expect):
            if isinstance(reply, ErrorReply):
                raise RemoteError(self.endpoint, reply.code, reply.detail)
            raise RemoteError(
                self.endpoint,
                "unexpected_reply",
                f"expected {expect.__name__}, got {type(reply).__name__}",
            )
        return reply

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def _send(self, msg: Message, timeout_s: float) -> int:
        if self._socket is None:
            self._socket = _Socket(
                zmq.DEALER, self.endpoint, bind=False, keys=self._keys, hwm=self._hwm
            )
        request_id = next(self._ids)
        frames = [_ENVELOPE.pack(request_id, 0), *encode(msg)]
        try:
            self._socket.zmq.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:  # the queue to the peer is full: it has not been reading
            self.close()
            raise PeerTimeout(self.endpoint, type(msg).__name__, timeout_s) from None
        return request_id

    def _receive(self, request_id: int, what: str, timeout_s: float) -> Message:
        assert self._socket is not None, "_send opens the socket"
        deadline = time.monotonic() + timeout_s
        while self._socket.poll_in(deadline - time.monotonic()):
            envelope, *frames = self._socket.zmq.recv_multipart(copy=False)
            if len(envelope) != _ENVELOPE.size:
                raise WireError(
                    "envelope", f"reply envelope of {len(envelope)} bytes from {self.endpoint}"
                )
            reply_id, _flags = _ENVELOPE.unpack(envelope.bytes)
            if reply_id != request_id:
                self.stale_replies += 1
                continue
            return self._decoder.decode(frames)
        self.close()  # lazy pirate: a late reply dies with the old socket
        raise PeerTimeout(self.endpoint, what, timeout_s)


# ---------------------------------------------------------------------------------------
# One-way streams
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Received:
    """A message a PULL or SUB socket took, and the name of the CURVE key its sender
    authenticated with (``relay.transport.security``; "" without CURVE)."""

    message: Message
    key: str = ""


class _Receiver:
    """What PULL and SUB share: take the next valid message, count the rejected ones."""

    def __init__(self, socket: _Socket, endpoint: str, decoder: Decoder[Any] | None) -> None:
        self._socket, self.endpoint = socket, endpoint
        self._decoder = decoder or Decoder()
        self.errors: Counter[str] = Counter()
        self.received = 0

    def receive(self, timeout_s: float) -> Message | None:
        """The next valid message, or None when none came within ``timeout_s``."""
        received = self.receive_from(timeout_s)
        return None if received is None else received.message

    def receive_from(self, timeout_s: float) -> Received | None:
        """The next valid message with the name of the CURVE key it came with (a bound
        socket under CURVE; "" otherwise), or None when none came within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self._socket.poll_in(deadline - time.monotonic()):
            frames = self._socket.zmq.recv_multipart(copy=False)
            try:
                message = self._decoder.decode(frames)
            except WireError as exc:
                self.errors[exc.kind] += 1
                logger.debug("rejected frames on %s: %s", self.endpoint, exc)
                continue
            self.received += 1
            key = frames[0].get("User-Id") if self._socket.authenticator is not None else ""
            return Received(message=message, key=key)
        return None

    def close(self) -> None:
        self._socket.close()


class Puller(_Receiver):
    """PULL side of a one-way stream; rejected frame sets are counted in ``errors``."""

    def __init__(
        self,
        endpoint: str,
        *,
        bind: bool = True,
        keys: Keys | None = None,
        decoder: Decoder[Any] | None = None,
        hwm: int = DEFAULT_HWM,
    ) -> None:
        socket = _Socket(zmq.PULL, endpoint, bind=bind, keys=keys, hwm=hwm)
        super().__init__(socket, socket.endpoint, decoder)


class Pusher:
    """PUSH side of a one-way stream; ``send`` never blocks.

    When the queue to the pullers is full (``hwm`` messages, or no puller ever connected),
    ``send`` drops the message, counts it in ``dropped`` and returns False.
    """

    def __init__(
        self, endpoint: str, *, bind: bool = False, keys: Keys | None = None, hwm: int = DEFAULT_HWM
    ) -> None:
        self._socket = _Socket(zmq.PUSH, endpoint, bind=bind, keys=keys, hwm=hwm)
        self.endpoint = self._socket.endpoint
        self.sent = 0
        self.dropped = 0

    def send(self, msg: Message) -> bool:
        try:
            self._socket.zmq.send_multipart(encode(msg), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.dropped += 1
            return False
        self.sent += 1
        return True

    def close(self, linger_s: float = 1.0) -> None:
        """Close, giving queued messages up to ``linger_s`` to leave."""
        self._socket.close(linger_s)


class Publisher:
    """PUB side of a fan-out stream (binds). ``send`` queues a message for every subscriber
    connected at that moment, zero-copy: the queues share the message's tensor memory.

    ``send(msg, wait_s)`` then waits until ZeroMQ has written the message to every
    subscriber's connection, or dropped it for a subscriber whose queue (``hwm`` messages)
    is full, so that the caller's memory is free when it returns: the sender never holds
    more than the message in hand. It returns False when ``wait_s`` passed first (a
    subscriber that stopped reading); ZeroMQ then still holds the message until that
    subscriber reads it or goes away.
    """

    def __init__(self, endpoint: str, *, keys: ServerKeys | None = None, hwm: int = 8) -> None:
        self._socket = _Socket(zmq.PUB, endpoint, bind=True, keys=keys, hwm=hwm)
        self._socket.zmq.copy_threshold = 0  # small frames tracked too: else "sent" = copied
        self.endpoint = self._socket.endpoint
        self.sent = 0

    def send(self, msg: Message, wait_s: float | None = None) -> bool:
        # Let the socket hear what its subscribers read so far: a queue's fill level is
        # only updated by such commands, and a stale one drops the message as if full.
        self._socket.zmq.getsockopt(zmq.EVENTS)
        frames = encode(msg)
        trackers = [self._socket.zmq.send(frame, zmq.SNDMORE, copy=False, track=True)
                    for frame in frames[:-1]]
        trackers.append(self._socket.zmq.send(frames[-1], copy=False, track=True))
        del frames
        self.sent += 1
        if wait_s is None:
            return True
        try:
            zmq.MessageTracker(*(t for t in trackers if t is not None)).wait(wait_s)
        except zmq.NotDone:
            return False
        return True

    def close(self, linger_s: float = 0.0) -> None:
        self._socket.close(linger_s)


class Subscriber(_Receiver):
    """SUB side of a fan-out stream (connects, takes every message); rejected frame sets
    are counted in ``errors``."""

    def __init__(self, endpoint: str, *, keys: ClientKeys | None = None,
                 decoder: Decoder[Any] | None = None, hwm: int = 8) -> None:
        socket = _Socket(zmq.SUB, endpoint, bind=False, keys=keys, hwm=hwm)
        socket.zmq.setsockopt(zmq.SUBSCRIBE, b"")
        super().__init__(socket, endpoint, decoder)
