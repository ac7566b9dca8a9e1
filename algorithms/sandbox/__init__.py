"""Sandboxes for untrusted, model-written code: ``local`` (a warm pool of limited processes,
the default) or ``fusion`` (a SandboxFusion server). Both follow ``api.Sandbox``; see
README.md for what the local one isolates and what it does not."""

from __future__ import annotations

import msgspec

from relay.algorithms.sandbox.api import Execution, Limits, Sandbox
from relay.algorithms.sandbox.config import SandboxFusionConfig, SandboxSettings
from relay.algorithms.sandbox.fusion import FusionSandbox
from relay.algorithms.sandbox.local import LocalSandbox

__all__ = ["Execution", "FusionSandbox", "Limits", "LocalSandbox", "Sandbox",
           "SandboxFusionConfig", "SandboxSettings", "make_sandbox"]


def make_sandbox(settings: SandboxSettings) -> Sandbox:
    """The configured sandbox: SandboxFusion when ``sandbox_fusion.url`` is set (its default
    memory from ``sandbox_fusion.memory_limit_mb``), else the local pool."""
    fusion = settings.sandbox_fusion
    if fusion.url:
        limits = msgspec.structs.replace(settings.limits, memory_mb=fusion.memory_limit_mb)
        return FusionSandbox(fusion, limits=limits)
    return LocalSandbox(workers=settings.workers, limits=settings.limits,
                        uid_base=settings.uid_base)
