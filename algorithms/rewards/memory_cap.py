"""The reward worker's memory cap, ``custom_reward_function.worker_memory_gb``, as RLIMIT_DATA.

RLIMIT_DATA (Linux 4.7 and later) bounds a process's private writable memory: its heap, the
anonymous mappings NumPy and torch allocate, thread stacks. It does not count address space
reserved without access (CUDA reserves terabytes that way, which is why RLIMIT_AS, counting
it, is not used), files mapped read-only or shared memory. The worker sets it, soft and hard
limit alike, before it imports the reward function; a process the function starts inherits
it as a cap of its own. An allocation past it fails in the call that asked: Python and NumPy
raise ``MemoryError``, torch's CPU allocator a ``RuntimeError`` with the C library's ENOMEM
text, which ``is_out_of_memory`` recognizes. Code that aborts instead of raising kills the
worker, which the caller reports (and replaces) as any death.
"""

from __future__ import annotations

import errno
import os
import resource

from relay.algorithms.user_code import describe

KEY = "custom_reward_function.worker_memory_gb"
_ENOMEM_TEXTS = (os.strerror(errno.ENOMEM), "can't allocate memory")


def apply_memory_cap(gib: float) -> None:
    """Cap this process's data segment at ``gib`` GiB (2^30 bytes); 0 leaves it uncapped.
    Never raises the limit a parent or the administrator already set lower."""
    if gib <= 0:
        return
    cap = int(gib * 2**30)
    for limit in resource.getrlimit(resource.RLIMIT_DATA):  # (soft, hard)
        if limit != resource.RLIM_INFINITY:
            cap = min(cap, limit)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))  # hard too: the function cannot lift it


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says that an allocation failed: a ``MemoryError`` (NumPy's included),
    an ``OSError`` with ENOMEM, or an error carrying the C library's ENOMEM message (torch)."""
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, OSError) and exc.errno == errno.ENOMEM:
        return True
    try:
        text = str(exc)
    except Exception:  # a user's exception class may be broken
        return False
    return any(marker in text for marker in _ENOMEM_TEXTS)


def over_cap(gib: float, exc: BaseException) -> str:
    """The error of a sample whose call ran out of memory under the cap."""
    return f"reward worker exceeded {KEY} = {gib:g} (GiB; 0: no cap): {describe(exc)}"
