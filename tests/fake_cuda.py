"""CUDA tensors without a GPU: real CPU values that say they are on ``cuda:0``.

``FakeTensorMode`` with fake ``cuda`` tensors checks devices the way CUDA does, and
raises ``FakeTensorDeviceMismatchError`` where an op mixes a CUDA tensor with a CPU one;
but on a CPU-only build of torch it cannot index (``t[i]``, ``t[:, :n]``, ``t[i] = v``:
Python's indexing takes a CUDA device guard, which a CPU build does not have), and a fake
tensor has no values, so nothing that reads one on the host (``tolist``, ``int``,
``torch.unique``, boolean masks) runs under it: neither the packing of the learner's passes
nor the group statistics of the advantages. Those run here instead, under ``fake_cuda()``:

- ``on_cuda(t)`` wraps a CPU tensor as a ``CudaTensor``: ``.device`` is ``cuda:0``, the
  values are ``t``'s;
- every torch function given a ``CudaTensor`` runs on the values and wraps what it returns,
  after checking its tensors' devices as CUDA would: a CUDA tensor beside a CPU tensor of
  one element or more is a ``DeviceMismatch`` (a CPU scalar, 0-dim, is allowed, as CUDA
  allows it);
- a factory given ``device="cuda"`` (or ``device=x.device``) makes a ``CudaTensor``, one
  given no device a CPU tensor, so an index or mask built without the device of the data it
  indexes is caught where it meets that data;
- ``.to("cpu")``, ``.cpu()``, ``.tolist()``, ``.item()`` and ``float()`` read the values
  back, as a host sync would.

It checks devices, not kernels: whatever runs, runs on the CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

CUDA = torch.device("cuda", 0)
# Tensor methods whose result is host data (or a CPU tensor): never wrapped
TO_HOST = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__float__,
           torch.Tensor.__int__, torch.Tensor.__bool__, torch.Tensor.__index__,
           torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__format__,
           torch.Tensor.__repr__}
# What a CudaTensor answers itself (C++ holds cuda:0 for it)
OWN = {torch.Tensor.device.__get__, torch.Tensor.is_cuda.__get__,
       torch.Tensor.get_device}


class DeviceMismatch(RuntimeError):
    """An op was given CUDA and CPU tensors (as ``FakeTensorDeviceMismatchError``)."""


class CudaTensor(torch.Tensor):
    """A CPU tensor's values, on ``cuda:0`` as far as anyone can tell (module docstring)."""

    host: torch.Tensor

    @staticmethod
    def __new__(cls, host: torch.Tensor) -> CudaTensor:
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, host.shape, strides=host.stride(), storage_offset=host.storage_offset(),
            dtype=host.dtype, device=CUDA)
        wrapper.host = host
        return wrapper

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in OWN:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        _check_devices(func, args, kwargs)
        out = func(*tree_map(_host, args), **tree_map(_host, kwargs))
        if func in TO_HOST or (func is torch.Tensor.to and _target(args, kwargs) == "cpu"):
            return out
        return tree_map(_wrap, out)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        """What reaches the dispatcher without passing ``__torch_function__`` (autograd's
        engine): on the values too."""
        kwargs = kwargs or {}
        _check_devices(func, args, kwargs)
        return tree_map(_wrap, func(*tree_map(_host, args), **tree_map(_host, kwargs)))

    def __repr__(self) -> str:
        return f"CudaTensor({self.host!r})"


def on_cuda(tensor: torch.Tensor) -> CudaTensor:
    """``tensor``'s values on (fake) ``cuda:0``."""
    return CudaTensor(tensor)


def _host(value: object) -> object:
    return value.host if isinstance(value, CudaTensor) else value


def _wrap(value: object) -> object:
    if isinstance(value, torch.Tensor) and not isinstance(value, CudaTensor):
        return CudaTensor(value)
    return value


def _check_devices(func, args: tuple, kwargs: dict) -> None:
    """``DeviceMismatch`` when ``func`` gets CUDA tensors and CPU tensors of one element or
    more (a 0-dim CPU tensor is a scalar CUDA accepts)."""
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    cpu = [t for t in tensors if not isinstance(t, CudaTensor) and t.dim() > 0]
    if cpu and len(cpu) < len(tensors):
        shapes = ", ".join(str(tuple(t.shape)) for t in cpu)
        raise DeviceMismatch(f"{getattr(func, '__qualname__', func)} got CUDA tensors and "
                             f"CPU tensors of shapes {shapes}")


def _target(args: tuple, kwargs: dict) -> str | None:
    """The device type a ``Tensor.to`` call moves to, or None (a dtype only)."""
    for value in (*args[1:], kwargs.get("device")):
        if isinstance(value, (str, torch.device)):
            return torch.device(value).type
        if isinstance(value, torch.Tensor):
            return "cuda" if isinstance(value, CudaTensor) else value.device.type
    return None


class _CudaFactories(TorchFunctionMode):
    """Makes a ``CudaTensor`` of whatever is asked for on a CUDA device: a factory's
    ``device=``, ``Tensor.to``/``Tensor.cuda`` to CUDA; pinning (``pin_memory=True``,
    ``Tensor.pin_memory``) is a no-op, as a CPU build of torch has no pinned memory."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.cuda or (func is torch.Tensor.to
                                         and _target(args, kwargs) == "cuda"):
            source = _host(args[0])
            rest = [a for a in args[1:] if not isinstance(a, (str, torch.device, torch.Tensor))]
            dtype = kwargs.get("dtype") or next(
                (a for a in rest if isinstance(a, torch.dtype)), source.dtype)
            return CudaTensor(source.to(dtype=dtype, copy=bool(kwargs.get("copy"))))
        if kwargs.get("pin_memory"):  # a CPU build has no pinned memory
            kwargs = {**kwargs, "pin_memory": False}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            return tree_map(_wrap, func(*args, **{**kwargs, "device": "cpu"}))
        return func(*args, **kwargs)


@contextmanager
def fake_cuda() -> Iterator[None]:
    """Within: factories asked for CUDA make ``CudaTensor``s (module docstring)."""
    with _CudaFactories():
        yield
