"""Background threads whose death is not silent.

A daemon thread that dies on an unexpected exception leaves its process running without
it: a generator without heartbeats or weights keeps going, useless. ``WatchedThread`` keeps
the exception (logged with its traceback and the thread's name when it happens) and
``raise_if_died`` raises it as ``ThreadDied`` in the thread that checks, so the process
stops loudly, naming the thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class ThreadDied(RuntimeError):
    """A background thread ended on an exception (its ``__cause__``)."""


class WatchedThread(threading.Thread):
    """A daemon thread running ``target``; an exception that ends it is kept in
    ``failure`` (and ``on_death``, if given, is called in the dying thread)."""

    def __init__(self, target: Callable[[], None], name: str,
                 on_death: Callable[[], None] | None = None) -> None:
        super().__init__(name=name, daemon=True)
        self._work, self._on_death = target, on_death
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            self._work()
        except BaseException as exc:
            self.failure = exc
            logger.exception("the %s thread died", self.name)
            if self._on_death is not None:
                self._on_death()

    def raise_if_died(self) -> None:
        if self.failure is not None:
            raise ThreadDied(f"the {self.name} thread died: {self.failure!r}") from self.failure
