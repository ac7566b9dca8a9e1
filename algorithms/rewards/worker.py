"""The reward worker: a subprocess that calls reward functions, killed when one hangs.

Both ends of its socket live here. The caller holds a ``RewardWorker`` and calls
``score(items)``; the worker process runs ``serve``.

Protocol (msgpack via msgspec, never pickle), length-prefixed frames on a socket pair::

    caller -> worker   _Start(config, sandbox)       once, at start
    worker -> caller   _Ready(error)                 once, after loading the function
    caller -> worker   _Job(job_id, items)           a whole group in one frame
    worker -> caller   _Reply(job_id, index, result) one per item, in order, as each ends

Because results come back one by one, each sample gets its own time limit: the clock for
item ``k`` starts when the result of item ``k-1`` arrives. When it runs out, the worker's
whole process group is SIGKILLed (a hung call is really stopped, with anything it
spawned), item ``k`` gets a ``timeout`` error, and items ``k+1..`` are resent as a new job
to a fresh worker. Every reply is checked against the (job_id, index) it must answer, so
a result can never be attached to another sample. A worker that dies (killed from outside,
segfault, ``os._exit``) costs only the item it was computing.

A batch function (``RewardConfig.reward_manager = "batch"``) is called once per job; its
replies come after that call, so the caller waits ``timeout_s`` times the job's size for the
first, and a batch that hangs or kills the worker fails every sample of the job.

An ``async def`` reward function scores a job's items concurrently and enforces each
item's limit itself (``calls``); the caller's clock then runs ``REPORT_GRACE_S`` longer, a
backstop for a coroutine that blocks the event loop. The worker runs under a memory cap
(``memory_cap``, ``RewardConfig.worker_memory_gb``) set before the reward function is
imported: an item whose call runs out of memory gets an error naming the cap, and its reply
says ``retire``: the caller kills that worker and resends the items after it to a fresh
one, so whatever the function leaked goes with the old process.

The worker is a fresh interpreter (``python -c``) that imports only this package and
the reward function: forking a process that holds torch or ZeroMQ threads is unsafe, and
``multiprocessing``'s spawn would re-import the caller's ``__main__`` (breaking scripts fed
on stdin, and re-importing torch in every worker of a generator). It shares the caller's
``sys.path``, and its stdout/stderr are the caller's, so a reward function's prints show
up in the logs; the protocol runs on a separate socket, so prints cannot corrupt it. The
worker leads its own process group (a kill takes whatever it spawned along), and on Linux
it asks the kernel to kill it when its parent dies (``PR_SET_PDEATHSIG``), so a crashed
generator leaves no orphan. The kernel ties that to the thread that started the worker: a
worker started from a short-lived thread is simply respawned on the next call.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import signal
import subprocess
import sys
import weakref
from collections.abc import Sequence
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import TypeAlias

import msgspec

from relay.algorithms.rewards.calls import RewardCalls
from relay.algorithms.rewards.config import RewardConfig, build_score_fn
from relay.algorithms.rewards.custom import RewardLoadError
from relay.algorithms.rewards.memory_cap import KEY as MEMORY_KEY
from relay.algorithms.rewards.memory_cap import apply_memory_cap, is_out_of_memory, over_cap
from relay.algorithms.rewards.registry import preload_builtins
from relay.algorithms.rewards.result import RewardItem, RewardResult, failure
from relay.algorithms.sandbox import SandboxSettings
from relay.algorithms.user_code import describe

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
# ``-c`` puts the working directory first on sys.path: dropped, so a user's own ``relay/``
# folder cannot stand in for Relay's (relay.launcher.child)
_BOOT = ("import sys; sys.path[:1] = [p for p in sys.path[:1] if p]; "
         "from relay.algorithms.rewards.worker import serve; serve(*map(int, sys.argv[1:]))")
REPORT_GRACE_S = 1.0  # an async function's worker reports its own timeouts; the caller waits this


class RewardWorkerError(RuntimeError):
    """The reward worker could not be started (not a per-sample failure)."""


class _Start(msgspec.Struct, array_like=True):
    config: RewardConfig
    sandbox: SandboxSettings  # where the code rewards' programs run


class _Ready(msgspec.Struct, array_like=True):
    error: str = ""  # non-empty: loading the reward function failed, the worker exits
    concurrent: bool = False  # an async function: items run at once, timed by the worker
    batched: bool = False  # a batch function: one call per job, replies after it ends


class _Job(msgspec.Struct, array_like=True):
    job_id: int
    items: list[msgspec.Raw]  # each an encoded RewardItem, decoded one by one in the worker


class _Reply(msgspec.Struct, array_like=True):
    job_id: int
    index: int
    result: RewardResult
    retire: bool = False  # the worker ran out of memory: replace it after this reply


class _WorkerLost(Exception):
    """The worker stopped answering; ``reason`` is the in-flight sample's error."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _enc_hook(obj: object) -> object:
    tolist = getattr(obj, "tolist", None)  # numpy arrays and scalars, torch tensors
    if callable(tolist):
        return tolist()
    raise TypeError(f"cannot send a {type(obj).__name__} to the reward worker")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_ready_decoder = msgspec.msgpack.Decoder(_Ready)
_reply_decoder = msgspec.msgpack.Decoder(_Reply)


# ---------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------


def _exit_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux; elsewhere the
    socket's EOF still ends an idle worker)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


class _MemoryWatch:
    """Turns a call's exception into its sample's error, noting whether it ran out of memory
    under the cap (then the worker retires)."""

    def __init__(self, cap_gib: float) -> None:
        self.cap_gib = cap_gib
        self.exceeded = False

    def explain(self, exc: BaseException) -> str:
        if self.cap_gib > 0 and is_out_of_memory(exc):
            self.exceeded = True
            return over_cap(self.cap_gib, exc)
        return describe(exc)


def serve(fd: int, parent_pid: int) -> None:
    """Worker entry point: cap memory, load the reward function, then score jobs until EOF."""
    _exit_with_parent(parent_pid)
    conn = Connection(fd)
    start = msgspec.msgpack.decode(conn.recv_bytes(), type=_Start)
    config = start.config
    apply_memory_cap(config.worker_memory_gb)
    watch = _MemoryWatch(config.worker_memory_gb)
    try:
        score_fn = build_score_fn(config, start.sandbox)
    except RewardLoadError as exc:
        error = str(exc)
        if config.worker_memory_gb > 0 and exc.__cause__ is not None \
                and is_out_of_memory(exc.__cause__):
            error += f" (under the worker's memory cap {MEMORY_KEY} = {config.worker_memory_gb:g})"
        conn.send_bytes(_encoder.encode(_Ready(error=error)))
        return
    if not config.custom_function:
        preload_builtins()  # so no sample's time limit pays for importing SymPy
    calls = RewardCalls(score_fn, timeout_s=config.timeout_s,
                        max_concurrent=config.max_concurrent, explain=watch.explain)
    batched = config.reward_manager == "batch"
    conn.send_bytes(_encoder.encode(_Ready(concurrent=calls.concurrent and not batched,
                                           batched=batched)))
    job_decoder = msgspec.msgpack.Decoder(_Job)
    while True:
        try:
            job = job_decoder.decode(conn.recv_bytes())
        except EOFError:
            return
        _score_job(conn, job, calls, watch, batched)


def _score_job(conn: Connection, job: _Job, calls: RewardCalls, watch: _MemoryWatch,
               batched: bool = False) -> None:
    """Send one reply per item of ``job``, in order, each as soon as it is known."""
    item_decoder = msgspec.msgpack.Decoder(RewardItem)

    def reply(index: int, result: RewardResult) -> None:
        conn.send_bytes(_encoder.encode(_Reply(job_id=job.job_id, index=index, result=result,
                                               retire=watch.exceeded)))

    decoded: list[RewardItem | RewardResult] = []
    for raw in job.items:
        try:
            decoded.append(item_decoder.decode(raw))
        except msgspec.DecodeError as exc:
            decoded.append(failure(f"bad item: {describe(exc)}"))
    if batched:
        for index, result in enumerate(calls.batch(decoded)):
            reply(index, result)
        return
    if calls.concurrent:
        calls.many(decoded, reply)
        return
    for index, item in enumerate(decoded):
        reply(index, item if isinstance(item, RewardResult) else calls.one(item))


# ---------------------------------------------------------------------------------------
# Caller side
# ---------------------------------------------------------------------------------------


def _kill(process: subprocess.Popen[bytes], conn: Connection) -> int:
    """SIGKILL the worker's process group, reap the worker, close the socket; exit code."""
    conn.close()
    with contextlib.suppress(ProcessLookupError):  # the whole group has exited already
        os.killpg(process.pid, signal.SIGKILL)  # not yet reaped, so the pid is not reused
    return process.wait()


_Reaper: TypeAlias = "weakref.finalize[[subprocess.Popen[bytes], Connection], RewardWorker]"


class RewardWorker:
    """Caller-side handle of one worker process: started on demand, replaced on failure.

    Not thread-safe; ``RewardScorer`` serializes calls.
    """

    def __init__(self, config: RewardConfig, sandbox: SandboxSettings | None = None) -> None:
        self._config = config
        self._sandbox = sandbox if sandbox is not None else SandboxSettings()
        self._process: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        # Kills the worker if this handle is dropped unclosed, or at interpreter exit.
        self._reaper: _Reaper | None = None
        self._job_ids = itertools.count()
        self._concurrent = False  # the worker times its own items (an async function)
        self._batched = False  # one call per job (reward_manager = "batch")

    @property
    def pid(self) -> int | None:
        """The running worker's pid (None before the first start and after ``stop``)."""
        return self._process.pid if self._process is not None else None

    def start(self) -> None:
        """Start a worker unless one is running; raises ``RewardLoadError`` (the custom
        function cannot be loaded) or ``RewardWorkerError`` (the process cannot start).

        A worker that died while idle is noticed, and replaced, by the next send.
        """
        if self._conn is not None:
            return
        parent_conn, child_conn = Pipe()
        with child_conn:  # closed here once the child holds it, so its death reads as EOF
            self._process = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(child_conn.fileno()), str(os.getpid())],
                pass_fds=(child_conn.fileno(),),
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # own process group, out of the terminal's Ctrl-C
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            )
        self._conn = parent_conn
        self._reaper = weakref.finalize(self, _kill, self._process, parent_conn)
        self._handshake()

    def _handshake(self) -> None:
        assert self._conn is not None
        limit = self._config.startup_timeout_s
        try:
            self._conn.send_bytes(_encoder.encode(_Start(self._config, self._sandbox)))
            if not self._conn.poll(limit):
                self.stop()
                raise RewardWorkerError(
                    f"the reward worker did not start within {limit:g} s "
                    "(RewardConfig.startup_timeout_s; a slow custom-function import?)"
                )
            ready = _ready_decoder.decode(self._conn.recv_bytes())
        except (EOFError, OSError, msgspec.DecodeError) as exc:
            code = self.stop()
            raise RewardWorkerError(
                f"the reward worker exited during start-up (exit code {code}); "
                f"its traceback is on stderr{self._cap_hint(code)}"
            ) from exc
        if ready.error:
            self.stop()
            raise RewardLoadError(ready.error)
        self._concurrent = ready.concurrent
        self._batched = ready.batched

    def stop(self) -> int | None:
        """Kill the worker (and its process group) if one runs; its exit code."""
        reaper, self._reaper = self._reaper, None
        self._process = self._conn = None
        return reaper() if reaper is not None else None

    def score(self, items: Sequence[RewardItem]) -> list[RewardResult]:
        """One result per item, in order. Whatever a reward call does becomes an error
        result; this raises only when no worker can be started (``start``)."""
        results: list[RewardResult | None] = [None] * len(items)
        pending: list[tuple[int, msgspec.Raw]] = []
        for position, item in enumerate(items):
            try:
                pending.append((position, msgspec.Raw(_encoder.encode(item))))
            except Exception as exc:  # e.g. an object in extra_info
                results[position] = failure(f"cannot send the item: {describe(exc)}")
        while pending:
            done = self._run_job([raw for _, raw in pending])
            for (position, _), result in zip(pending, done, strict=False):  # done: a prefix
                results[position] = result
            pending = pending[len(done):]
        return results  # type: ignore[return-value]  # every slot is filled above

    def _run_job(self, raws: list[msgspec.Raw]) -> list[RewardResult]:
        """Results for a prefix of ``raws`` (at least one); shorter when the worker is lost
        or retires."""
        self.start()
        job_id = next(self._job_ids)
        done: list[RewardResult] = []
        try:
            self._send(_encoder.encode(_Job(job_id=job_id, items=raws)))
            for index in range(len(raws)):
                # a batch call answers only when it is done: the job's whole budget first
                batch_items = len(raws) if self._batched and index == 0 else 1
                reply = self._receive(job_id, index, batch_items)
                done.append(reply.result)
                if reply.retire:  # it ran out of memory: a fresh worker takes the rest
                    self.stop()
                    break
        except _WorkerLost as lost:
            self.stop()
            # a batch call is not resent sample by sample: the job's rest fails with it
            done.extend([failure(lost.reason)] * (len(raws) - len(done) if self._batched else 1))
        except BaseException:
            self.stop()  # e.g. KeyboardInterrupt: never reuse a worker with work in flight
            raise
        return done

    def _send(self, frame: bytes) -> None:
        assert self._conn is not None
        try:
            self._conn.send_bytes(frame)
            return
        except OSError:  # it died while idle, before reading this job: nothing lost
            self.stop()
            self.start()
        try:
            self._conn.send_bytes(frame)
        except OSError as exc:
            raise _WorkerLost(f"worker died before scoring: {describe(exc)}") from exc

    def _receive(self, job_id: int, index: int, items: int = 1) -> _Reply:
        """Item ``index``'s reply, within ``timeout_s`` times ``items`` (those it waits for)."""
        assert self._conn is not None
        limit = self._config.timeout_s * items
        if not self._conn.poll(limit + (REPORT_GRACE_S if self._concurrent else 0.0)):
            raise _WorkerLost(f"timeout: no result within {limit:g} s (worker killed)")
        try:
            reply = _reply_decoder.decode(self._conn.recv_bytes())
        except (EOFError, OSError):
            code = self.stop()
            raise _WorkerLost(
                f"worker died while scoring this sample (exit code {code}){self._cap_hint(code)}"
            ) from None
        except msgspec.DecodeError as exc:
            raise _WorkerLost(f"protocol error: {describe(exc)}") from exc
        if (reply.job_id, reply.index) != (job_id, index):
            raise _WorkerLost(
                f"protocol error: expected the result of item {index} of job {job_id}, "
                f"got item {reply.index} of job {reply.job_id}"
            )
        return reply

    def _cap_hint(self, code: int | None) -> str:
        """For a death by SIGABRT or SIGSEGV (how C code that cannot allocate often ends),
        the memory cap that may have caused it."""
        cap = self._config.worker_memory_gb
        if cap <= 0 or code not in (-signal.SIGABRT, -signal.SIGSEGV):
            return ""
        return f"; if it ran out of memory: {MEMORY_KEY} = {cap:g} caps it"
