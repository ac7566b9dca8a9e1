"""The local sandbox: each program in its own forked process behind OS limits, from a warm pool.

What it isolates (Linux):

- **Process and limits.** Each program is a fresh child of a *zygote* (``zygote.py``, a
  separate interpreter that imported nothing of the caller), in its own session and process
  group, with RLIMIT_CPU / AS / FSIZE / NOFILE / NPROC / CORE set from ``Limits``; the zygote
  kills its whole process group at ``wall_s``.
- **Identity (when the caller is root).** The child runs as a uid of its own (from a block
  above ``uid_base`` that this zygote alone holds on the machine, an flock in
  /tmp/relay-sandbox-uids; no supplementary groups, no capabilities): it cannot signal the
  caller, the zygote or another program, read ``/proc/<pid>/environ`` of any of them, or
  write where that uid has no permission (the caller's files, a test's ``tmp_path``).
  After it exits, everything still running under that uid is killed. Not root: the program
  runs as the caller's uid and *can* signal it, read its ``/proc/<pid>/environ`` and write
  its files; the pool survives (a dead zygote is restarted), the caller does not.
- **Environment and descriptors.** Only PATH, LANG, HOME and TMPDIR (its own directory)
  and one-thread caps for numeric libraries; no
  descriptor but its three pipes; stdin is a pipe fed by the caller.
- **Working directory.** A fresh directory per program, removed after it ends.
- **Network.** With ``network=False`` the zygote moves into a new, empty network namespace
  (``unshare(CLONE_NEWNET)``, via ``libc`` since ``os.unshare`` needs Python 3.12; a user
  namespace when not root), so every connection fails, loopback included. Where the kernel
  refuses both, a warning is logged, ``LocalSandbox.network_isolated`` is False and
  programs *can* reach the network.

What it does not isolate: the filesystem view (it reads whatever its uid may read, and may
write world-writable places such as /tmp and /dev/shm), no seccomp filter (every syscall
is allowed), the same kernel, no cgroup (memory is capped per process by address space, not
by resident memory; CPU share is not capped). Treat it as a boundary against model-written
mistakes and casual escapes, not against a determined kernel exploit; for that, run
SandboxFusion (``fusion.py``) in containers.

Mechanics: one I/O thread owns every pipe and the zygote's control socket; ``run`` waits on a
future, ``arun`` awaits the same future, so the event loop never blocks. At most
``workers`` programs run at once; the rest queue.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path

import msgspec

from relay.algorithms.sandbox.api import Execution, FutureSandbox, Limits, check_request
from relay.algorithms.sandbox.config import DEFAULT_UID_BASE, UID_BLOCK, UID_BLOCKS
from relay.algorithms.sandbox.outcome import classify

log = logging.getLogger(__name__)
ZYGOTE_SCRIPT = Path(__file__).with_name("zygote.py")
HELLO_TIMEOUT_S = 30.0
READ_CHUNK = 1 << 16
BACKSTOP_S = 30.0  # a program the zygote never reports on fails this long after wall_s


class _Zygote:
    """One zygote process and its control socket."""

    def __init__(self, workers: int, uid_base: int, network: bool) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        config = {"fd": theirs.fileno(), "workers": workers, "uid_base": uid_base,
                  "uid_blocks": [UID_BLOCK, UID_BLOCKS], "network": network}
        self.process = subprocess.Popen(
            [sys.executable, "-I", str(ZYGOTE_SCRIPT), json.dumps(config)],
            pass_fds=(theirs.fileno(),), env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            stdin=subprocess.DEVNULL, start_new_session=True, cwd="/")
        theirs.close()
        self.control = ours
        ours.settimeout(HELLO_TIMEOUT_S)
        try:
            hello = json.loads(ours.recv(1 << 16) or b"null")
        except (OSError, ValueError) as error:
            hello = None
            log.error("sandbox zygote did not say hello: %s", error)
        if not isinstance(hello, dict) or hello.get("op") != "hello":
            self.process.kill()
            raise RuntimeError(f"the sandbox zygote ({ZYGOTE_SCRIPT}) failed to start "
                               f"(exit status {self.process.wait()}); its stderr is above")
        ours.settimeout(None)
        self.network_isolated: bool = hello["network_isolated"]
        self.uid_first: int | None = hello["uid_first"]
        for note in hello["notes"]:
            log.warning("sandbox: %s", note)

    def stop(self) -> None:
        self.control.close()  # the zygote sees EOF, kills its children and exits
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class _Run:
    """One program in flight: its pipes, what it wrote, and the zygote's report."""

    def __init__(self, run_id: int, code: str, stdin: str, limits: Limits,
                 files: dict[str, str]) -> None:
        self.id = run_id
        self.limits = limits
        self.future: Future[Execution] = Future()
        self.job = msgspec.json.encode({"code": code, "files": files})
        self.stdin = stdin.encode()
        self.out = {"stdout": bytearray(), "stderr": bytearray()}
        self.cut: list[str] = []
        self.fds: dict[int, str] = {}  # our ends: fd -> "stdin" | "job" | "stdout" | "stderr"
        self.report: dict | None = None
        self.zygote: _Zygote | None = None
        self.deadline = time.monotonic() + limits.wall_s + BACKSTOP_S


class LocalSandbox(FutureSandbox):
    """The local sandbox (module docstring). ``limits``: used when a call passes none."""

    def __init__(self, *, workers: int = 4, limits: Limits | None = None,
                 uid_base: int = DEFAULT_UID_BASE) -> None:
        if not 1 <= workers <= UID_BLOCK:
            raise ValueError(f"LocalSandbox workers must be in 1..{UID_BLOCK}, got {workers}")
        self.workers = workers
        self.limits = limits or Limits()
        self.uid_base = uid_base
        self._zygotes: dict[bool, _Zygote] = {False: _Zygote(workers, uid_base, network=False)}
        self.network_isolated = self._zygotes[False].network_isolated
        self._ids = iter(range(1, 1 << 62))
        self._queue: collections.deque[_Run] = collections.deque()
        self._lock = threading.Lock()
        self._runs: dict[int, _Run] = {}
        self._closed = False
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
        self._register_zygote(self._zygotes[False])
        self._thread = threading.Thread(target=self._loop, name="sandbox-io", daemon=True)
        self._thread.start()

    # ---- the public side -------------------------------------------------------------
    def submit(self, code: str, *, stdin: str = "", limits: Limits | None = None,
               files: Mapping[str, str] | None = None) -> Future[Execution]:
        """Queue a program; the future holds its ``Execution``."""
        checked = check_request(code, stdin, files)
        run = _Run(next(self._ids), code, stdin, limits or self.limits, checked)
        with self._lock:
            if self._closed:
                raise RuntimeError("this sandbox is closed")
            self._queue.append(run)
        os.write(self._wake_w, b"x")
        return run.future

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        os.write(self._wake_w, b"x")
        self._thread.join()

    @property
    def uid_isolated(self) -> bool:
        """Whether programs run as uids of their own (Relay is root)."""
        return self.uids is not None

    @property
    def uids(self) -> range | None:
        """The uids the default (no-network) zygote runs programs as, or None."""
        zygote = self._zygotes.get(False)
        first = zygote.uid_first if zygote else None
        return None if first is None else range(first, first + self.workers)

    def __enter__(self) -> LocalSandbox:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ---- the I/O thread --------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not (self._closed and not self._runs):
                if self._closed:
                    for run in list(self._runs.values()):
                        self._finish(run, self._failure(run, "the sandbox was closed"))
                    for run in self._drain_queue():
                        self._finish(run, self._failure(run, "the sandbox was closed"))
                    break
                self._start_queued()
                backstop = min((r.deadline for r in self._runs.values()), default=None)
                timeout = None if backstop is None else max(0.0, backstop - time.monotonic())
                for key, mask in self._selector.select(timeout):
                    if self._selector.get_map().get(key.fd) is not key:
                        continue  # unregistered by an earlier event of this batch
                    kind, target = key.data
                    if kind == "wake":
                        self._drain_wake()
                    elif kind == "zygote":
                        self._on_control(target)
                    else:
                        self._on_pipe(key.fd, target, kind)
                self._expire_backstops()
        except BaseException as exc:  # no caller may wait forever on a dead I/O thread
            log.exception("sandbox I/O thread failed; failing its programs")
            with self._lock:
                self._closed = True  # submit refuses from now on
            for run in [*self._runs.values(), *self._drain_queue()]:
                if not run.future.done():
                    run.future.set_result(self._failure(run, f"the sandbox failed: {exc!r}"))
            raise
        finally:
            for zygote in self._zygotes.values():
                self._selector.unregister(zygote.control)
                zygote.stop()
            self._zygotes.clear()
            self._selector.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _drain_queue(self) -> list[_Run]:
        with self._lock:
            runs = list(self._queue)
            self._queue.clear()
        return runs

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 512):
                pass
        except BlockingIOError:
            pass

    def _register_zygote(self, zygote: _Zygote) -> None:
        self._selector.register(zygote.control, selectors.EVENT_READ, ("zygote", zygote))

    def _zygote_for(self, network: bool) -> _Zygote:
        zygote = self._zygotes.get(network)
        if zygote is None:
            zygote = _Zygote(self.workers, self.uid_base, network=network)
            self._zygotes[network] = zygote
            self._register_zygote(zygote)
        return zygote

    def _start_queued(self) -> None:
        while len(self._runs) < self.workers:
            with self._lock:
                if not self._queue:
                    return
                run = self._queue.popleft()
            try:
                self._start(run)
            except (OSError, RuntimeError) as error:
                self._finish(run, self._failure(run, f"could not start the program: {error}"))

    def _start(self, run: _Run) -> None:
        zygote = self._zygote_for(run.limits.network)
        pipes = {name: os.pipe() for name in ("stdin", "stdout", "stderr", "job")}
        theirs = [pipes["stdin"][0], pipes["stdout"][1], pipes["stderr"][1], pipes["job"][0]]
        ours = {pipes["stdin"][1]: "stdin", pipes["stdout"][0]: "stdout",
                pipes["stderr"][0]: "stderr", pipes["job"][1]: "job"}
        message = json.dumps({"op": "run", "id": run.id,
                              "limits": msgspec.structs.asdict(run.limits)}).encode()
        try:
            socket.send_fds(zygote.control, [message], theirs)
        except OSError:
            for fd in (*theirs, *ours):
                os.close(fd)
            raise
        for fd in theirs:
            os.close(fd)
        run.zygote = zygote
        self._runs[run.id] = run
        for fd, kind in ours.items():
            os.set_blocking(fd, False)
            run.fds[fd] = kind
            writing = kind in ("stdin", "job")
            self._selector.register(fd, selectors.EVENT_WRITE if writing else
                                    selectors.EVENT_READ, (kind, run))

    def _on_pipe(self, fd: int, run: _Run, kind: str) -> None:
        if kind in ("stdin", "job"):
            data = run.stdin if kind == "stdin" else run.job
            try:
                sent = os.write(fd, data[:READ_CHUNK])
            except (BrokenPipeError, BlockingIOError) as error:
                if isinstance(error, BlockingIOError):
                    return
                sent = len(data)  # the program stopped reading: what is left is dropped
            data = data[sent:]
            if kind == "stdin":
                run.stdin = data
            else:
                run.job = data
            if not data:
                self._close_fd(run, fd)
            return
        chunk = os.read(fd, READ_CHUNK)
        if not chunk:
            self._close_fd(run, fd)
        else:
            kept = run.out[kind]
            room = run.limits.output_bytes - len(kept)
            kept += chunk[:room]
            if len(chunk) > room:
                run.cut.append(kind)
                self._close_fd(run, fd)  # the program's next write gets EPIPE
        self._maybe_finish(run)

    def _close_fd(self, run: _Run, fd: int) -> None:
        self._selector.unregister(fd)
        os.close(fd)
        del run.fds[fd]

    def _on_control(self, zygote: _Zygote) -> None:
        try:
            data = zygote.control.recv(1 << 16)
        except OSError:
            data = b""
        if data:
            report = json.loads(data)
            run = self._runs.get(report["id"])
            if run is not None:
                run.report = report
                self._maybe_finish(run)
            return
        status = zygote.process.wait()
        log.error("sandbox zygote exited with status %s; restarting it", status)
        self._selector.unregister(zygote.control)
        zygote.control.close()
        network = next(k for k, v in self._zygotes.items() if v is zygote)
        del self._zygotes[network]
        for run in [r for r in self._runs.values() if r.zygote is zygote]:
            self._finish(run, self._failure(
                run, f"the sandbox's zygote process died (exit status {status}) while this "
                     "program ran; it was restarted"))

    def _maybe_finish(self, run: _Run) -> None:
        readers_open = any(kind in ("stdout", "stderr") for kind in run.fds.values())
        if run.report is None or readers_open:
            return
        stdout, stderr = (run.out[k].decode("utf-8", "replace") for k in ("stdout", "stderr"))
        self._finish(run, classify(run.report, run.limits, stdout, stderr, run.cut))

    def _expire_backstops(self) -> None:
        now = time.monotonic()
        for run in [r for r in self._runs.values() if now >= r.deadline]:
            self._finish(run, self._failure(
                run, f"no report from the sandbox {BACKSTOP_S:g} s after the wall-clock limit"))

    def _failure(self, run: _Run, reason: str) -> Execution:
        stdout, stderr = (run.out[k].decode("utf-8", "replace") for k in ("stdout", "stderr"))
        return Execution(status="sandbox_error", exit_code=None, stdout=stdout, stderr=stderr,
                         wall_s=0.0, reason=reason)

    def _finish(self, run: _Run, execution: Execution) -> None:
        for fd in list(run.fds):
            self._close_fd(run, fd)
        self._runs.pop(run.id, None)
        if not run.future.done():
            run.future.set_result(execution)
