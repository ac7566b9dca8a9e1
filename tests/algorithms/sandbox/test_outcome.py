"""How a zygote's report becomes an ``Execution``: statuses and reasons, by hand-made wait
statuses (no process started)."""

from __future__ import annotations

import signal

import pytest

from relay.algorithms.sandbox.api import Limits
from relay.algorithms.sandbox.outcome import classify, exception_line

LIMITS = Limits(cpu_s=2, wall_s=5, memory_mb=256)


def report(wait_status: int | None, *, cpu_s: float = 0.1, timed_out: bool = False,
           ready: bool = True, error: str = "") -> dict:
    return {"wait_status": wait_status, "cpu_s": cpu_s, "wall_s": 0.5,
            "timed_out": timed_out, "ready": ready, "error": error}


def exited(code: int) -> int:
    return code << 8  # a wait status for exit(code)


@pytest.mark.parametrize(("the_report", "stderr", "status", "exit_code", "reason"), [
    (report(exited(0)), "", "ok", 0, ""),
    (report(exited(3)), "", "error", 3, "exited with code 3"),
    (report(exited(1)), "Traceback...\nMemoryError\n", "memory", 1,
     "address-space limit of 256 MB exceeded (MemoryError)"),
    (report(signal.SIGXCPU), "", "timeout", -signal.SIGXCPU, "CPU time limit of 2 s exceeded"),
    (report(signal.SIGKILL, cpu_s=3.0), "", "timeout", -9, "CPU time limit of 2 s exceeded"),
    (report(signal.SIGKILL, cpu_s=0.2), "", "killed", -9, "killed by SIGKILL"),
    (report(signal.SIGKILL, timed_out=True), "", "timeout", -9,
     "wall-clock limit of 5 s exceeded; its process group was killed"),
    (report(exited(125), ready=False), "relay sandbox setup failed:\nOSError: boom",
     "sandbox_error", 125, "the sandbox could not set the program up: OSError: boom"),
    (report(None, error="could not start the program: no free worker slot"), "",
     "sandbox_error", None, "could not start the program: no free worker slot"),
])
def test_reports_map_to_statuses(the_report, stderr, status, exit_code, reason):
    result = classify(the_report, LIMITS, "", stderr, cut=[])
    assert (result.status, result.exit_code, result.reason) == (status, exit_code, reason)


def test_cut_output_is_named_even_when_ok():
    result = classify(report(exited(0)), LIMITS, "x", "", cut=["stdout"])
    assert (result.status, result.reason) == ("ok", f"stdout cut at {LIMITS.output_bytes} bytes")


def test_exception_line_finds_the_exception_of_a_multi_line_message():
    stderr = ("Traceback (most recent call last):\n  File \"main.py\", line 1\n"
              "ImportError: Error importing numpy: you should not try\n"
              "        to import numpy from its source directory.\n")
    assert exception_line(stderr) == "ImportError: Error importing numpy: you should not try"
    assert exception_line("just a line\n\n") == "just a line"
    assert exception_line("") == ""
