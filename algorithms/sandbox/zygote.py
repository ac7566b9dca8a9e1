"""The local sandbox's zygote: a fresh interpreter whose pre-forked children run one program each.

This file is run as a script (``python -I zygote.py CONFIG``) by ``relay.algorithms.sandbox
.local`` and imports only the standard library (plus ``PRELOAD``): nothing of the caller
(torch, sockets, secrets) is ever in its memory. While idle it forks *spares*, one per free
slot, each waiting on a socket of its own; a program's start is handing a spare its order,
not a fork (2-4 ms on a small VM) and never an interpreter start. It knows limits, uids and
process groups; it never sees a program's code, stdin or files: those reach the child
through pipes the caller passes in (``SCM_RIGHTS``), so no program can read another's data
from the forked memory.

Protocol on a ``SOCK_SEQPACKET`` pair (one JSON object per message)::

    zygote -> caller  {"op": "hello", "pid", "network_isolated", "uid_first", "notes"}
    caller -> zygote  {"op": "run", "id", "limits"} + fds [stdin_r, stdout_w, stderr_w, job_r]
    zygote -> caller  {"op": "done", "id", "wait_status", "cpu_s", "wall_s", "timed_out",
                       "ready", "error"}

The child: own session, stdio from the passed pipes, every other descriptor closed, a fresh
directory (``chdir``), the slot's uid when the zygote is root (from a block of uids this
zygote holds alone, ``claim_uids``), killed by the kernel if the zygote dies, rlimits, an
environment of PATH/LANG/HOME/TMPDIR and THREAD_CAPS only; it reads ``{"code", "files"}``
from ``job_r``, writes the files, signals "ready" on a private pipe, and runs the code as
``__main__``. The zygote kills the child's process group at the wall-clock deadline; after
each exit it kills whatever the slot's uid still runs, removes the directory and frees the
slot.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import io
import json
import math
import os
import resource
import selectors
import shutil
import signal
import socket
import stat
import sys
import tempfile
import time
import traceback
import types

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
UID_LOCKS = "/tmp/relay-sandbox-uids"
PR_SET_CHILD_SUBREAPER = 36
PR_SET_PDEATHSIG = 1
READY = b"R"
# Imported once here so that programs get them warm, and can import them at all when the
# sandbox uid cannot read the interpreter's files (a Python under /root, mode 0700).
PRELOAD = ("__future__ abc argparse array ast base64 bisect calendar cmath codecs collections "
           "collections.abc contextlib contextvars copy copyreg csv dataclasses datetime decimal "
           "difflib fnmatch glob pathlib pickle platform shutil tempfile zlib "
           "encodings.ascii encodings.idna encodings.latin_1 enum fractions functools gc "
           "hashlib heapq inspect io itertools json keyword math numbers operator pprint queue "
           "random re secrets statistics string struct textwrap threading time timeit "
           "typing unicodedata uuid warnings weakref").split()
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
# one thread for numeric libraries: Limits.processes counts threads, and OpenBLAS aborts
# when it cannot start the threads it wants
THREAD_CAPS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _unshare(flags: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def cut_network() -> str:
    """Move this process into a new, empty network namespace (children inherit it): no
    interface but a downed loopback, so every connect fails. Returns "" or why not."""
    try:
        _unshare(CLONE_NEWNET)
        return ""
    except OSError as root_error:
        uid, gid = os.getuid(), os.getgid()
        try:  # unprivileged: a user namespace owning the network namespace
            _unshare(CLONE_NEWUSER | CLONE_NEWNET)
            for name, text in (("uid_map", f"{uid} {uid} 1"), ("setgroups", "deny"),
                               ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
            return ""
        except OSError as user_error:
            return (f"unshare(CLONE_NEWNET) failed ({root_error.strerror}) and so did a user "
                    f"namespace ({user_error.strerror}): programs can reach the network")


def closed_to_others(path: str) -> str:
    """The first directory above ``path`` that other uids cannot enter, or ""."""
    while path not in ("/", ""):
        if not os.stat(path).st_mode & stat.S_IXOTH:
            return path
        path = os.path.dirname(path)
    return ""


def claim_uids(uid_base: int, block_size: int, blocks: int) -> int:
    """The first uid of a block of ``block_size`` that no other zygote on this machine holds
    (an flock held for this process's life), so that no two sandboxes share a uid."""
    os.makedirs(UID_LOCKS, mode=0o700, exist_ok=True)
    for block in range(blocks):
        fd = os.open(f"{UID_LOCKS}/{uid_base}-{block}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return uid_base + block * block_size  # fd stays open: the claim
        except BlockingIOError:
            os.close(fd)
    raise RuntimeError(f"all {blocks} uid blocks above {uid_base} are in use")


def set_limits(limits: dict) -> None:
    """Apply ``Limits`` (as a dict) to this process with setrlimit."""
    cpu = max(1, math.ceil(limits["cpu_s"]))
    mb = 1 << 20
    for which, soft, hard in (
            (resource.RLIMIT_CPU, cpu, cpu + 1),  # SIGXCPU at soft, SIGKILL at hard
            (resource.RLIMIT_AS, limits["memory_mb"] * mb, limits["memory_mb"] * mb),
            (resource.RLIMIT_FSIZE, limits["file_size_mb"] * mb, limits["file_size_mb"] * mb),
            (resource.RLIMIT_NOFILE, limits["open_files"], limits["open_files"]),
            (resource.RLIMIT_NPROC, limits["processes"], limits["processes"]),
            (resource.RLIMIT_CORE, 0, 0)):
        resource.setrlimit(which, (soft, hard))


def run_main(code: str, workdir: str) -> int:
    """Run ``code`` as ``__main__`` the way ``python main.py`` would; returns its exit code."""
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                  line_buffering=False)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                  errors="backslashreplace", line_buffering=True)
    main = types.ModuleType("__main__")
    main.__file__ = os.path.join(workdir, "main.py")
    sys.modules["__main__"] = main
    sys.argv = [main.__file__]
    sys.path[0:0] = [workdir]
    status = 0
    try:
        exec(compile(code, main.__file__, "exec"), main.__dict__)
    except SystemExit as stop:
        if stop.code is None:
            status = 0
        elif isinstance(stop.code, int):
            status = stop.code & 0xFF
        else:
            print(stop.code, file=sys.stderr)
            status = 1
    except BaseException as failure:  # printed as python would, without this frame
        traceback.print_exception(type(failure), failure, failure.__traceback__.tb_next)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            status = status or 120  # as CPython does when flushing stdout fails at exit
    return status


def die_with(parent: int) -> None:
    """Have the kernel SIGKILL this process when its parent (the zygote) dies."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(125)


def child(fds: list[int], ready_w: int, limits: dict, workdir: str, uid: int | None,
          parent: int) -> None:
    """In the forked child: set the boundary up, then run the program. Never returns."""
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        stdin_r, stdout_w, stderr_w, job_r = fds
        for target, fd in ((0, stdin_r), (1, stdout_w), (2, stderr_w), (3, job_r), (4, ready_w)):
            os.dup2(fd, target)
        os.closerange(5, os.sysconf("SC_OPEN_MAX"))
        os.chdir(workdir)
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            die_with(parent)  # a change of uid clears the parent-death signal
        with os.fdopen(3, "rb") as job_file:
            job = json.loads(job_file.read())
        for name, text in job["files"].items():
            path = os.path.join(workdir, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        sys.dont_write_bytecode = True  # no __pycache__ in its directory
        os.environ.clear()
        os.environ.update(PATH=SAFE_PATH, LANG="C.UTF-8", HOME=workdir, TMPDIR=workdir,
                          **THREAD_CAPS)
        tempfile.tempdir = None
        set_limits(limits)
        os.write(4, READY)
        os.close(4)
    except BaseException:
        os.write(2, f"relay sandbox setup failed:\n{traceback.format_exc()}".encode())
        os._exit(125)
    os._exit(run_main(job["code"], workdir))


def spare(order_socket: socket.socket) -> None:
    """In a pre-forked child: wait for one program's order, then become it. Never returns."""
    try:
        parent = os.getppid()
        die_with(parent)
        signal.set_wakeup_fd(-1)
        keep = order_socket.fileno()
        os.closerange(3, keep)  # the zygote's control socket, pipes, other spares' sockets
        os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
        data, fds, _, _ = socket.recv_fds(order_socket, 1 << 16, 5)
        if not data:  # the zygote is gone or shutting down
            os._exit(0)
        order = json.loads(data)
    except BaseException:
        os._exit(125)
    child(fds[:4], fds[4], order["limits"], order["workdir"], order["uid"], parent)


class Zygote:
    """The serving loop: jobs in on the control socket, children forked, exits reported."""

    def __init__(self, control: socket.socket, workers: int, uid_base: int,
                 uid_blocks: tuple[int, int], network: bool) -> None:
        self.control = control
        self.notes: list[str] = []
        self.network_isolated = False
        if not network:
            note = cut_network()
            self.network_isolated = not note
            if note:
                self.notes.append(note)
        root = os.geteuid() == 0
        # as root, programs never run as root: a uid of their own or nothing
        self.uid_first = claim_uids(uid_base, *uid_blocks) if root else None
        closed = closed_to_others(os.path.dirname(os.__file__)) if self.uid_first else ""
        if closed:
            self.notes.append(f"the sandbox uids cannot enter {closed}: programs can import only "
                              "the standard-library modules the zygote preloads (PRELOAD)")
        if not root:
            self.notes.append("not root: programs run as the caller's uid (no uid boundary)")
        self.free_slots = list(range(workers))
        # orphans of a program (killed with its group) are reparented here and reaped
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1) != 0:
            self.notes.append("prctl(PR_SET_CHILD_SUBREAPER) failed: orphans go to init")
        self.root = tempfile.mkdtemp(prefix="relay-sandbox-")
        os.chmod(self.root, 0o711)
        self.jobs: dict[int, dict] = {}  # pid -> job
        self.spares: list[tuple[int, socket.socket]] = []  # pre-forked, waiting for an order
        self.selector = selectors.DefaultSelector()
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.wake_r = wake_r
        self.selector.register(control, selectors.EVENT_READ, "control")
        self.selector.register(wake_r, selectors.EVENT_READ, "wake")

    def send(self, message: dict) -> None:
        self.control.send(json.dumps(message).encode())

    def serve(self) -> None:
        self.send({"op": "hello", "pid": os.getpid(), "network_isolated": self.network_isolated,
                   "uid_first": self.uid_first, "notes": self.notes})
        try:
            while True:
                # fork spares while idle, one per free slot, so a program's start is no fork
                want_spare = len(self.spares) < len(self.free_slots)
                now = time.monotonic()
                deadlines = [job["deadline"] for job in self.jobs.values()
                             if not job["timed_out"]]
                timeout = max(0.0, min(deadlines) - now) if deadlines else None
                events = self.selector.select(0 if want_spare else timeout)
                for key, _ in events:
                    if key.data == "control" and not self.receive():
                        return
                    if key.data == "wake":
                        self.drain_wakeups()
                self.reap()
                self.enforce_deadlines()
                if want_spare and not events:
                    self.fork_spare()
        finally:
            for _, order_socket in self.spares:
                order_socket.close()  # each spare sees EOF and exits
            for pid in list(self.jobs):
                self.kill(pid)
            shutil.rmtree(self.root, ignore_errors=True)

    def drain_wakeups(self) -> None:
        try:
            while os.read(self.wake_r, 512):
                pass
        except BlockingIOError:
            pass

    def receive(self) -> bool:
        try:
            data, fds, _, _ = socket.recv_fds(self.control, 1 << 16, 4)
        except ConnectionError:
            return False
        if not data:
            return False
        message = json.loads(data)
        try:
            self.start(message, fds)
        except OSError as error:
            self.send({"op": "done", "id": message["id"], "wait_status": None, "cpu_s": 0.0,
                       "wall_s": 0.0, "timed_out": False, "ready": False,
                       "error": f"could not start the program: {error}"})
        finally:
            for fd in fds:
                os.close(fd)
        return True

    def start(self, message: dict, fds: list[int]) -> None:
        if len(fds) != 4:
            raise OSError(errno.EINVAL, f"expected 4 descriptors, got {len(fds)}")
        if not self.free_slots:
            raise OSError(errno.EAGAIN, "no free worker slot")
        slot = self.free_slots.pop()
        uid = None if self.uid_first is None else self.uid_first + slot
        workdir = tempfile.mkdtemp(dir=self.root)
        ready_r, ready_w = os.pipe()
        try:
            if uid is not None:
                os.chown(workdir, uid, uid)
            pid = self.dispatch(message["limits"], workdir, uid, [*fds, ready_w])
        except OSError:
            self.free_slots.append(slot)
            shutil.rmtree(workdir, ignore_errors=True)
            os.close(ready_r)
            raise
        finally:
            os.close(ready_w)
        limits = message["limits"]
        now = time.monotonic()
        self.jobs[pid] = {"id": message["id"], "slot": slot, "uid": uid, "workdir": workdir,
                          "ready_r": ready_r, "start": now, "deadline": now + limits["wall_s"],
                          "timed_out": False, "sweep": limits["processes"] > 1}

    def fork_spare(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            spare(theirs)
        theirs.close()
        self.spares.append((pid, ours))

    def dispatch(self, limits: dict, workdir: str, uid: int | None, fds: list[int]) -> int:
        """Hand the order to a spare (forking one if none waits); returns its pid."""
        order = json.dumps({"limits": limits, "workdir": workdir, "uid": uid}).encode()
        for _ in range(2):  # a spare that died while waiting: fork a fresh one, once
            if not self.spares:
                self.fork_spare()
            pid, order_socket = self.spares.pop(0)
            try:
                socket.send_fds(order_socket, [order], fds)
                return pid
            except OSError:
                self.kill(pid)
            finally:
                order_socket.close()
        raise OSError(errno.EPIPE, "two spare children in a row could not take an order")

    def enforce_deadlines(self) -> None:
        now = time.monotonic()
        for pid, job in self.jobs.items():
            if not job["timed_out"] and now >= job["deadline"]:
                job["timed_out"] = True
                self.kill(pid)

    def kill(self, pid: int) -> None:
        for target in (lambda: os.killpg(pid, signal.SIGKILL),
                       lambda: os.kill(pid, signal.SIGKILL)):
            try:
                target()
            except ProcessLookupError:
                pass

    def sweep(self, uid: int) -> None:
        """Kill every process the slot's uid still has (an escaped grandchild included):
        a forked helper takes that uid and signals -1, which reaches exactly those."""
        pid = os.fork()
        if pid == 0:
            try:
                os.setuid(uid)
                os.kill(-1, signal.SIGKILL)
            except OSError:
                pass
            os._exit(0)
        os.waitpid(pid, 0)

    def reap(self) -> None:
        while True:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            job = self.jobs.pop(pid, None)
            if job is None:
                continue
            wall = time.monotonic() - job["start"]
            self.kill(pid)  # what is left of its process group
            if job["uid"] is not None and job["sweep"]:
                self.sweep(job["uid"])
            try:
                ready = os.read(job["ready_r"], 1) == READY
            finally:
                os.close(job["ready_r"])
            error = ""
            try:
                shutil.rmtree(job["workdir"])
            except OSError as failure:
                error = f"could not remove the working directory: {failure}"
            self.free_slots.append(job["slot"])
            self.send({"op": "done", "id": job["id"], "wait_status": status,
                       "cpu_s": usage.ru_utime + usage.ru_stime, "wall_s": wall,
                       "timed_out": job["timed_out"], "ready": ready, "error": error})


def main() -> None:
    for name in PRELOAD:
        __import__(name)
    config = json.loads(sys.argv[1])
    control = socket.socket(fileno=config["fd"])
    Zygote(control, config["workers"], config["uid_base"], tuple(config["uid_blocks"]),
           config["network"]).serve()


if __name__ == "__main__":
    main()
