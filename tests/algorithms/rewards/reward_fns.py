"""Misbehaving custom reward functions for ``test_scorer.py``, loaded by file path.

``compute_score`` reads its behaviour from the completion, ``"<kind>:<arg>"``. Correct
samples (``ok:<number>``) return a value derived from the completion itself, so a reward
attached to the wrong sample is caught by the tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

NOT_A_FUNCTION = 3


def reordered(solution_str: str, ground_truth: str, data_source: str = "", **kwargs: Any) -> float:
    """verl calls reward functions with keywords, so this order must work too."""
    return float(solution_str == ground_truth and data_source == "test/custom")


def _hang() -> None:
    time.sleep(3600)


def _forge_next_reply(score: float) -> None:
    """Write a well-formed reply for the next item onto the worker's protocol socket,
    found in the worker loop's frame (private names: this is an attack on the protocol)."""
    import msgspec

    from relay.algorithms.rewards.result import RewardResult
    from relay.algorithms.rewards.worker import _Reply

    frame = sys._getframe(1)
    while "job" not in frame.f_locals:
        frame = frame.f_back
    job, index, conn = frame.f_locals["job"], frame.f_locals["index"], frame.f_locals["conn"]
    forged = _Reply(job_id=job.job_id, index=index + 1, result=RewardResult(score=score))
    conn.send_bytes(msgspec.msgpack.encode(forged))


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any]
) -> Any:
    kind, _, arg = solution_str.partition(":")
    if kind == "ok":
        return {"score": float(arg), "echo": float(arg), "label": "ignored: not a number"}
    if kind == "raise":
        raise ValueError(f"bad sample {arg}")
    if kind == "hang":
        _hang()
    if kind == "spin":  # a busy loop, not a sleep
        while True:
            pass
    if kind == "print":
        print("reward noise " * 2000, flush=True)
        os.write(1, b"\x00\xff raw bytes on fd 1\n")
        return float(arg)
    if kind == "extra":
        return float(extra_info["value"])
    if kind == "nan":
        return float("nan")
    if kind == "inf":
        return float("inf")
    if kind == "str":
        return "1.0"
    if kind == "none":
        return None
    if kind == "noscore":
        return {"value": 1.0}
    if kind == "exit":
        sys.exit(3)
    if kind == "die":
        os._exit(7)
    if kind == "forge":  # attack the protocol: a fake reply for the NEXT item, then ours
        _forge_next_reply(float(arg))
        return 0.0
    if kind == "pid_then_hang":  # arg: a file to write this worker's pid to
        Path(arg).write_text(str(os.getpid()))
        _hang()
    if kind == "spawn_then_hang":  # arg: a file to write a grandchild's pid to
        child = subprocess.Popen(["sleep", "600"])
        Path(arg).write_text(str(child.pid))
        _hang()
    if kind == "alloc":  # arg: GiB to allocate (zero pages, never touched: no RSS uncapped)
        block = bytearray(int(float(arg) * 2**30))
        return float(len(block) > 0)
    if kind == "pid":  # this worker's pid, as the score
        return float(os.getpid())
    raise AssertionError(f"unknown test kind {kind!r}")
