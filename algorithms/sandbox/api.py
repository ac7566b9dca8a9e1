"""What every sandbox takes and returns: ``Limits``, ``Execution`` and the ``Sandbox`` protocol.

A sandbox runs an untrusted Python program (``code``, run as ``__main__`` in a fresh working
directory holding ``files``, fed ``stdin``) under ``Limits`` and says how it ended. It never
raises for anything the program does: a crash, a limit hit or a broken sandbox is an
``Execution`` with a non-"ok" status and a reason. It raises only for a bad call (a file
name that leaves the directory, a wrong type).
"""

from __future__ import annotations

import asyncio
import functools
import posixpath
from abc import ABC, abstractmethod
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Annotated, Literal, Protocol

import msgspec
import msgspec.inspect

Status = Literal["ok", "error", "timeout", "memory", "killed", "sandbox_error"]


class Limits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Per-execution limits.

    ``cpu_s``: CPU time (RLIMIT_CPU, rounded up to whole seconds locally). ``wall_s``: wall
    clock, enforced by the parent, which kills the program's whole process group.
    ``memory_mb``: address space (RLIMIT_AS), the interpreter's own ~30 MB included.
    ``file_size_mb``: largest file it may write (RLIMIT_FSIZE). ``open_files``: descriptors
    (RLIMIT_NOFILE). ``processes``: processes and threads of the program's uid, itself
    included (RLIMIT_NPROC; 1 = it cannot fork or start a thread). ``output_bytes``: stdout
    and stderr kept, each; past it the pipe is closed (the program's next write fails).
    ``network``: whether the program may open network connections.
    """

    cpu_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    wall_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    memory_mb: Annotated[int, msgspec.Meta(ge=16)] = 1024
    file_size_mb: Annotated[int, msgspec.Meta(gt=0)] = 16
    open_files: Annotated[int, msgspec.Meta(ge=5)] = 64
    processes: Annotated[int, msgspec.Meta(ge=1)] = 1
    output_bytes: Annotated[int, msgspec.Meta(gt=0)] = 1 << 20
    network: bool = False

    def __post_init__(self) -> None:
        # decoding checks the bounds above field by field; this checks Limits built in code
        for field in _bounds(type(self)):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"Limits.{field.name} must be a number, got {value!r}")
            low, strict = (field.type.gt, True) if field.type.gt is not None else (
                field.type.ge, False)
            if value < low or (strict and value == low):
                raise ValueError(f"Limits.{field.name} must be {'>' if strict else '>='} "
                                 f"{low}, got {value!r}")


@functools.cache
def _bounds(struct: type[msgspec.Struct]) -> list[msgspec.inspect.Field]:
    """The fields of ``struct`` with a lower bound (``Meta(gt=...)`` or ``Meta(ge=...)``)."""
    return [field for field in msgspec.inspect.type_info(struct).fields
            if getattr(field.type, "gt", None) is not None
            or getattr(field.type, "ge", None) is not None]


class Execution(msgspec.Struct, frozen=True, kw_only=True):
    """How one program ended.

    ``status``: "ok" (exit 0), "error" (ran and exited non-zero: an exception, a refused
    syscall), "timeout" (CPU or wall-clock limit), "memory" (address-space limit),
    "killed" (ended by a signal it did not ask for), "sandbox_error" (the sandbox failed,
    not the program). ``exit_code``: its exit status, ``-signal`` when a signal ended it,
    None when it never ran. ``reason``: why, in words, for every status but "ok" (and for
    "ok" when output was cut).
    """

    status: Status
    exit_code: int | None
    stdout: str
    stderr: str
    wall_s: float
    reason: str = ""


class Sandbox(Protocol):
    """Runs programs; ``run`` is thread-safe, ``arun`` never blocks the event loop."""

    def run(self, code: str, *, stdin: str = "", limits: Limits | None = None,
            files: Mapping[str, str] | None = None) -> Execution: ...

    async def arun(self, code: str, *, stdin: str = "", limits: Limits | None = None,
                   files: Mapping[str, str] | None = None) -> Execution: ...

    def close(self) -> None: ...


class FutureSandbox(ABC):
    """A sandbox whose executions are futures (``submit``): ``run`` waits on one, ``arun``
    awaits it without blocking the event loop. Subclasses give ``submit`` and ``close``."""

    @abstractmethod
    def submit(self, code: str, *, stdin: str = "", limits: Limits | None = None,
               files: Mapping[str, str] | None = None) -> Future[Execution]:
        """Start a program; the future holds its ``Execution``."""

    @abstractmethod
    def close(self) -> None:
        """Release the workers; later calls are refused."""

    def run(self, code: str, *, stdin: str = "", limits: Limits | None = None,
            files: Mapping[str, str] | None = None) -> Execution:
        return self.submit(code, stdin=stdin, limits=limits, files=files).result()

    async def arun(self, code: str, *, stdin: str = "", limits: Limits | None = None,
                   files: Mapping[str, str] | None = None) -> Execution:
        return await asyncio.wrap_future(self.submit(code, stdin=stdin, limits=limits,
                                                     files=files))


def check_request(code: str, stdin: str, files: Mapping[str, str] | None) -> dict[str, str]:
    """The call's arguments checked; returns ``files`` as a plain dict.

    Raises TypeError or ValueError naming the argument (a file name must be a relative path
    that stays inside the working directory).
    """
    for name, value in (("code", code), ("stdin", stdin)):
        if not isinstance(value, str):
            raise TypeError(f"sandbox {name} must be a str, got {type(value).__name__}")
    checked: dict[str, str] = {}
    for name, text in (files or {}).items():
        if not isinstance(name, str) or not isinstance(text, str):
            raise TypeError(f"sandbox files must map str names to str contents, got {name!r}")
        normal = posixpath.normpath(name)
        if (not name or name.startswith("/") or normal == "." or normal.startswith("../")
                or normal == ".." or "\0" in name):
            raise ValueError(f"sandbox file name {name!r} must be a relative path inside the "
                             "working directory")
        checked[normal] = text
    return checked
