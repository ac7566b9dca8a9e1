"""What Relay's own code asks of torch about devices, recorded while it runs on the CPU.

On the CPU every tensor lands on the CPU whatever the code says, so a factory call that does
not name a device (``torch.zeros(n)``, ``torch.arange(n)``, ``torch.tensor(values)``) works
here and breaks on a GPU, where it puts an index or a mask on the CPU beside CUDA data. The
same goes for a host sync (``float(t)``, ``t.item()``, ``t.tolist()``, ``t.cpu()``): free
here, a stall of the GPU's queue there. ``DeviceAudit`` is a ``TorchFunctionMode`` that
records each such call made from a file of the audited folders (``learner/``,
``algorithms/``, ...), with its place in the source, so a test can run a real CPU step and
assert that every factory named its device, and count the syncs.

    with DeviceAudit(["learner", "algorithms"]) as audit:
        learner.step(batch)
    assert audit.unplaced == [], audit.report()

A factory given ``device=`` (even ``"cpu"``, which documents a deliberate host tensor) is
placed; ``*_like`` and ``Tensor.new_*`` take their device from a tensor and are not audited;
``torch.as_tensor`` of a tensor keeps its device.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

ROOT = Path(__file__).resolve().parents[1]

FACTORIES = {
    torch.zeros, torch.ones, torch.full, torch.empty, torch.arange, torch.tensor,
    torch.linspace, torch.eye, torch.rand, torch.randn, torch.randint, torch.randperm,
    torch.empty_strided, torch.as_tensor, torch.scalar_tensor,
}
SYNCS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__int__,
    torch.Tensor.__bool__, torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy,
}
# torch's Python frames between a call in Relay's code and the mode
DISPATCH_FRAMES = ("torch/overrides.py", "torch/_tensor.py", "torch/utils/_device.py")


def _name(func: object) -> str:
    tensor_method = hasattr(func, "__objclass__") or "Tensor" in getattr(func, "__qualname__", "")
    owner = "Tensor." if tensor_method else "torch."
    return owner + getattr(func, "__name__", repr(func))


class DeviceAudit(TorchFunctionMode):
    """Records factory calls without a device (``unplaced``) and host syncs (``syncs``) made
    from the Python files under ``folders`` (relative to the repository root): each entry
    ``"path:line function"``."""

    def __init__(self, folders: Iterable[str]) -> None:
        super().__init__()
        self._roots = tuple(str(ROOT / folder) + "/" for folder in folders)
        self.unplaced: list[str] = []
        self.syncs: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None and not (
                func is torch.as_tensor and args and torch.is_tensor(args[0])):
            site = self._site()
            if site:
                self.unplaced.append(f"{site} {_name(func)}")
        elif (func in SYNCS or (func is torch.Tensor.to and _to_cpu(args, kwargs))):
            site = self._site()
            if site:
                self.syncs[f"{site} {_name(func)}"] += 1
        return func(*args, **kwargs)

    def _site(self) -> str | None:
        """``path:line`` of the code that made the call, when it is in an audited folder;
        None when it came from elsewhere (torch's own functions, transformers, the tests).
        torch's dispatch frames between the call and this mode are skipped."""
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.endswith(DISPATCH_FRAMES):
            frame = frame.f_back
        if frame is None or not frame.f_code.co_filename.startswith(self._roots):
            return None
        return f"{Path(frame.f_code.co_filename).relative_to(ROOT)}:{frame.f_lineno}"

    @property
    def sync_count(self) -> int:
        return sum(self.syncs.values())

    def report(self) -> str:
        unplaced = [f"  {site}" for site in sorted(set(self.unplaced))] or ["  none"]
        syncs = [f"  {n} x {site}" for site, n in self.syncs.most_common()] or ["  none"]
        lines = ["factories without a device:", *unplaced, "host syncs:", *syncs]
        return "\n".join(lines)


def _to_cpu(args: tuple, kwargs: dict) -> bool:
    """Whether a ``Tensor.to`` call moves to the CPU."""
    targets = [*args[1:], kwargs.get("device")]
    return any(isinstance(t, (str, torch.device)) and torch.device(t).type == "cpu"
               for t in targets if t is not None and not isinstance(t, torch.dtype))
