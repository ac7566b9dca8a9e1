"""A client for a SandboxFusion server's ``/run_code`` API, as a ``Sandbox``.

It speaks the documented HTTP API with the standard library (``urllib``) rather than the
``sandbox-fusion`` package: that client pulls in ``requests`` and pydantic v1-style models for
one POST, and its retry policy is not ours to set. A request is::

    {"code", "language": "python", "stdin", "run_timeout", "compile_timeout",
     "memory_limit_MB", "files": {name: base64}}

and the answer ``{"status": "Success" | "Failed" | "SandboxError", "message",
"run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error", "return_code",
"stdout", "stderr", "execution_time"}}``. Connection errors, timeouts and HTTP 5xx are
retried with doubling back-off; every call runs on one thread pool of ``max_concurrent``
threads, so that cap holds across threads and event loops. The server decides network
access and CPU time; ``Limits.wall_s`` becomes ``run_timeout`` and ``memory_mb``
``memory_limit_MB``.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

from relay.algorithms.sandbox.api import Execution, FutureSandbox, Limits, check_request
from relay.algorithms.sandbox.config import SandboxFusionConfig
from relay.algorithms.sandbox.outcome import exception_line

COMPILE_TIMEOUT_S = 10.0
HTTP_MARGIN_S = 30.0  # the HTTP timeout is the program's run_timeout plus this


class _Retryable(Exception):
    """A failure worth another attempt (connection, timeout, HTTP 5xx)."""


def to_execution(answer: dict, limits: Limits, wall_s: float) -> Execution:
    """The ``Execution`` for a ``/run_code`` answer, output cut at ``limits.output_bytes``."""
    run = answer.get("run_result") or {}
    cap = limits.output_bytes
    stdout, stderr = run.get("stdout") or "", run.get("stderr") or ""
    cut = [name for name, text in (("stdout", stdout), ("stderr", stderr))
           if len(text.encode()) > cap]
    stdout = stdout.encode()[:cap].decode("utf-8", "replace")
    stderr = stderr.encode()[:cap].decode("utf-8", "replace")
    code = run.get("return_code")

    def ended(status: str, reason: str) -> Execution:
        if cut:
            note = f"{' and '.join(cut)} cut at {cap} bytes"
            reason = f"{reason}; {note}" if reason else note
        return Execution(status=status, exit_code=code, stdout=stdout, stderr=stderr,
                         wall_s=wall_s, reason=reason)

    if answer.get("status") == "SandboxError" or run.get("status") == "Error":
        return ended("sandbox_error", f"SandboxFusion error: {answer.get('message') or '?'}")
    if run.get("status") == "TimeLimitExceeded":
        return ended("timeout", f"run_timeout of {limits.wall_s:g} s exceeded (SandboxFusion)")
    if not run:
        return ended("sandbox_error", f"SandboxFusion answered without a run_result: {answer}")
    if code == 0:
        return ended("ok", "")
    failure = exception_line(stderr)
    if failure.startswith("MemoryError"):
        return ended("memory", f"memory limit of {limits.memory_mb} MB exceeded ({failure})")
    return ended("error", f"exited with code {code}" + (f": {failure}" if failure else ""))


class FusionSandbox(FutureSandbox):
    """``Sandbox`` over a SandboxFusion server (module docstring)."""

    def __init__(self, config: SandboxFusionConfig, *, limits: Limits | None = None) -> None:
        if not (config.url or "").startswith(("http://", "https://")):
            raise ValueError("FusionSandbox needs sandbox_fusion.url, the http(s) URL of the "
                             f"server's /run_code endpoint; got {config.url!r}")
        self.config = config
        self.limits = limits or Limits(memory_mb=config.memory_limit_mb)
        self._pool = ThreadPoolExecutor(max_workers=config.max_concurrent,
                                        thread_name_prefix="sandbox-fusion")

    def submit(self, code: str, *, stdin: str = "", limits: Limits | None = None,
               files: Mapping[str, str] | None = None) -> Future[Execution]:
        checked = check_request(code, stdin, files)
        return self._pool.submit(self._call, code, stdin, limits or self.limits, checked)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _call(self, code: str, stdin: str, limits: Limits, files: dict[str, str]) -> Execution:
        body = json.dumps({
            "code": code, "language": "python", "stdin": stdin, "run_timeout": limits.wall_s,
            "compile_timeout": COMPILE_TIMEOUT_S, "memory_limit_MB": limits.memory_mb,
            "files": {name: base64.b64encode(text.encode()).decode()
                      for name, text in files.items()}}).encode()
        delay, failures = self.config.backoff_s, []
        for attempt in range(self.config.retries + 1):
            if attempt:
                time.sleep(delay)
                delay *= 2
            start = time.monotonic()
            try:
                answer = self._post(body, limits.wall_s + COMPILE_TIMEOUT_S + HTTP_MARGIN_S)
            except _Retryable as error:
                failures.append(str(error))
                continue
            except ValueError as error:  # a 4xx or an answer that is not JSON
                return Execution(status="sandbox_error", exit_code=None, stdout="", stderr="",
                                 wall_s=time.monotonic() - start, reason=str(error))
            return to_execution(answer, limits, time.monotonic() - start)
        return Execution(status="sandbox_error", exit_code=None, stdout="", stderr="",
                         wall_s=0.0, reason=f"SandboxFusion at {self.config.url} failed "
                         f"{len(failures)} times; last: {failures[-1]}")

    def _post(self, body: bytes, timeout: float) -> dict:
        request = urllib.request.Request(self.config.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as error:
            detail = error.read()[:500].decode("utf-8", "replace")
            if error.code >= 500:
                raise _Retryable(f"HTTP {error.code}: {detail}") from error
            raise ValueError(f"SandboxFusion refused the request: HTTP {error.code}: "
                             f"{detail}") from error
        except (urllib.error.URLError, OSError) as error:  # refused, reset, timed out
            raise _Retryable(f"{type(error).__name__}: {error}") from error
        try:
            answer = json.loads(raw)
        except ValueError as error:
            raise ValueError(f"SandboxFusion answered with something not JSON: "
                             f"{raw[:200]!r}") from error
        if not isinstance(answer, dict):
            raise ValueError(f"SandboxFusion answered {answer!r}, not a JSON object")
        return answer
