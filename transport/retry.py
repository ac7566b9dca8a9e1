"""Requests that ride out a stalled peer: retry with backoff, up to a stated patience.

A buffer paused for half a minute (a long garbage collection, a SIGSTOP, a slow disk) must
not kill every generator and the learner. ``patient_request`` sends a request, and when no
reply comes within ``timeout_s`` (``PeerTimeout``; the client drops the unanswered
request) sends it again after a pause that doubles from ``first_pause_s`` up to
``max_pause_s``, until ``patience_s`` have passed since the first try; then it raises
``PeerGone``. Every retry is logged. Retried requests must be safe to repeat: the hub
answers a repeated rollout as a duplicate, and a lease whose reply was lost expires back
into the pool.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from relay.transport.messages import Message
from relay.transport.sockets import Client, PeerTimeout

logger = logging.getLogger(__name__)

FIRST_PAUSE_S = 1.0
MAX_PAUSE_S = 10.0


class PeerGone(PeerTimeout):
    """The peer did not answer a request, retried, for the whole patience."""

    def __init__(self, endpoint: str, request: str, patience_s: float, tries: int) -> None:
        TimeoutError.__init__(
            self, f"no reply from {endpoint} to {request} in {patience_s:g} s ({tries} tries): "
                  "the peer is gone or stalled past the patience")
        self.endpoint, self.request, self.timeout_s = endpoint, request, patience_s


def patient_request(client: Client, message: Message, timeout_s: float, patience_s: float,
                    *, stop: threading.Event | None = None, first_pause_s: float = FIRST_PAUSE_S,
                    max_pause_s: float = MAX_PAUSE_S, **request_kwargs: Any) -> Message:
    """``client.request(message, timeout_s)``, retried through ``PeerTimeout`` for up to
    ``patience_s`` (a set ``stop`` ends the waiting early with the last ``PeerTimeout``)."""
    stop = stop or threading.Event()  # never set: the pauses are plain sleeps
    began = time.monotonic()
    pause, tries = first_pause_s, 0
    what = type(message).__name__
    while True:
        tries += 1
        try:
            reply = client.request(message, timeout_s, **request_kwargs)
        except PeerTimeout:
            waited = time.monotonic() - began
            if waited + pause >= patience_s or stop.wait(pause):
                raise PeerGone(client.endpoint, what, patience_s, tries) from None
            logger.warning("no reply from %s to %s for %.0f s; retried after %.0f s (giving "
                           "up after %.0f s)", client.endpoint, what, waited, pause, patience_s)
            pause = min(pause * 2, max_pause_s)
            continue
        if tries > 1:
            logger.info("%s answered %s after %d tries", client.endpoint, what, tries)
        return reply
