"""How a local program ended, in ``Execution`` terms: a pure function of what the zygote saw.

It knows wait statuses, signals and the limits; it does not know processes or pipes.
"""

from __future__ import annotations

import os
import re
import signal

from relay.algorithms.sandbox.api import Execution, Limits


EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(: |$)")


def exception_line(stderr: str) -> str:
    """The line of ``stderr`` that names how the program failed: the last unindented
    ``Name: message`` line (a traceback's exception, even when its message runs on over
    more lines), else the last non-empty line, else ""."""
    lines = [line.rstrip() for line in stderr.strip().splitlines() if line.strip()]
    named = [line for line in lines if EXCEPTION_LINE.match(line)]
    return (named or lines or [""])[-1]


def classify(report: dict, limits: Limits, stdout: str, stderr: str,
             cut: list[str]) -> Execution:
    """The ``Execution`` for a zygote ``done`` report (``wait_status``, ``cpu_s``,
    ``wall_s``, ``timed_out``, ``ready``, ``error``). ``cut``: the streams cut at
    ``limits.output_bytes``, named in the reason."""
    status_word = report["wait_status"]
    wall = float(report["wall_s"])

    def ended(status: str, exit_code: int | None, reason: str) -> Execution:
        if cut:
            note = f"{' and '.join(cut)} cut at {limits.output_bytes} bytes"
            reason = f"{reason}; {note}" if reason else note
        return Execution(status=status, exit_code=exit_code, stdout=stdout, stderr=stderr,
                         wall_s=wall, reason=reason)

    if status_word is None:
        return ended("sandbox_error", None, report["error"] or "the program was not started")
    signum = os.WTERMSIG(status_word) if os.WIFSIGNALED(status_word) else None
    exit_code = -signum if signum is not None else os.waitstatus_to_exitcode(status_word)
    if not report["ready"] and not report["timed_out"]:
        return ended("sandbox_error", exit_code,
                     f"the sandbox could not set the program up: {exception_line(stderr)}")
    if report["timed_out"]:
        return ended("timeout", exit_code, f"wall-clock limit of {limits.wall_s:g} s exceeded; "
                     "its process group was killed")
    if signum == signal.SIGXCPU or (signum == signal.SIGKILL
                                    and report["cpu_s"] >= limits.cpu_s):
        return ended("timeout", exit_code, f"CPU time limit of {limits.cpu_s:g} s exceeded")
    if signum is not None:
        return ended("killed", exit_code, f"killed by {signal.Signals(signum).name}")
    if exit_code == 0:
        return ended("ok", 0, "")
    failure = exception_line(stderr)
    if failure.startswith("MemoryError"):
        return ended("memory", exit_code,
                     f"address-space limit of {limits.memory_mb} MB exceeded ({failure})")
    return ended("error", exit_code, f"exited with code {exit_code}"
                 + (f": {failure}" if failure else ""))
