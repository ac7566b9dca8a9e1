"""The sandbox's settings: Relay's local pool and verl's ``sandbox_fusion`` keys.

Composed by ``relay.configs.run_schema`` as the ``sandbox`` section; verl's
``reward_model.sandbox_fusion.*`` keys land in ``sandbox.sandbox_fusion``.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from relay.algorithms.sandbox.api import Limits

UID_BLOCK = 1024  # uids one zygote claims (zygote.py); the most workers a pool may have
UID_BLOCKS = 4096
DEFAULT_UID_BASE = 1_800_000_000
Positive = Annotated[int, msgspec.Meta(gt=0)]
Uid = Annotated[int, msgspec.Meta(ge=1, le=(1 << 31) - 1 - UID_BLOCK * UID_BLOCKS)]


class SandboxFusionConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A SandboxFusion server (verl's ``reward_model.sandbox_fusion``).

    ``url``: its ``/run_code`` endpoint (``http://host:8080/run_code``); set, every program
    runs there instead of locally. ``max_concurrent``: requests in flight at once, across
    every thread and event loop of the process. ``memory_limit_mb``: each program's memory
    (the request's ``memory_limit_MB``) when a call passes no ``Limits``. ``retries``
    (Relay's): further attempts after a connection error, a timeout or an HTTP 5xx, with
    doubling back-off from ``backoff_s``.
    """

    url: Annotated[str, msgspec.Meta(pattern=r"^https?://")] | None = None
    max_concurrent: Positive = 64
    memory_limit_mb: Annotated[int, msgspec.Meta(ge=16)] = 1024
    retries: Annotated[int, msgspec.Meta(ge=0)] = 3
    backoff_s: Annotated[float, msgspec.Meta(ge=0)] = 0.5


class SandboxSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Where and how untrusted code runs (Relay's ``sandbox`` section).

    ``workers``: programs the local pool runs at once (the rest queue). ``uid_base``: when
    Relay runs as root, each pool claims a free block of ``UID_BLOCK`` uids from
    ``uid_base + b * UID_BLOCK`` (b < ``UID_BLOCKS``) for its life, and worker slot ``k`` runs
    programs as the block's ``k``-th uid: uids that must own no file (pick a free range).
    ``limits``: each program's ``Limits`` when a call passes none. ``sandbox_fusion``: the
    remote server, used instead of the local pool when its ``url`` is set.
    """

    workers: Annotated[int, msgspec.Meta(ge=1, le=UID_BLOCK)] = 4
    uid_base: Uid = DEFAULT_UID_BASE
    limits: Limits = msgspec.field(default_factory=Limits)
    sandbox_fusion: SandboxFusionConfig = msgspec.field(default_factory=SandboxFusionConfig)
