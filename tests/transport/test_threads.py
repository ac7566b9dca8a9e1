"""A background thread's death is kept and raised where it is checked."""

from __future__ import annotations

import threading

import pytest

from relay.transport.threads import ThreadDied, WatchedThread


def test_a_thread_that_raises_is_raised_again_by_name(caplog) -> None:
    woken = threading.Event()

    def work() -> None:
        raise ValueError("boom")

    thread = WatchedThread(work, "heartbeat", on_death=woken.set)
    thread.start()
    thread.join(5)
    assert woken.is_set() and "the heartbeat thread died" in caplog.text
    with pytest.raises(ThreadDied, match="heartbeat.*boom"):
        thread.raise_if_died()


def test_a_thread_that_returns_is_not_a_death() -> None:
    thread = WatchedThread(lambda: None, "quiet")
    thread.start()
    thread.join(5)
    thread.raise_if_died()
