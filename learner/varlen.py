"""Causal attention within packed sequences: one variable-length kernel call on CUDA in half
precision, one SDPA call per sequence anywhere else.

Packed sequences are laid out as flash-attention's varlen kernels take them: the tokens of
every sequence one after the other, (T, heads, head_dim), and ``cu_seqlens`` (S + 1,), where
sequence s is tokens ``[cu_seqlens[s], cu_seqlens[s + 1])``. Ulysses' packed slices
(``relay.learner.ulysses``) and the padded rows with their padding taken out
(``relay.learner.attention``) attend this way.

The kernel (``varlen_kernel``): flash-attn's ``flash_attn_varlen_func`` when it is
installed, else torch's ``torch.nn.attention.varlen.varlen_attn`` in the form with
``scale`` and ``window_size`` (torch 2.11 on; torch 2.10's form takes neither, and falls
back), with ``enable_gqa`` where it exists (else the key/value heads are repeated). Only on
CUDA, in bf16 or fp16, heads of at most 256 and a multiple of 8, without dropout: the
flash kernels' domain. Everything else (the CPU, fp32, a torch or a head size without a
kernel) takes the per-sequence SDPA loop, the learner's path before the kernel.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable, Sequence

import msgspec
import torch
import torch.nn.functional as F

HALF_DTYPES = (torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256  # the flash kernels' largest head; heads a multiple of 8


class PackedSequences(msgspec.Struct, frozen=True):
    """Where each packed sequence starts, on the host and on the tokens' device (built once
    a forward, read by every layer)."""

    cu_seqlens: tuple[int, ...]  # (S + 1,)
    cu_seqlens_tensor: torch.Tensor  # (S + 1,) int32, on the tokens' device: the kernel's
    max_length: int  # the longest sequence's tokens

    @classmethod
    def of(cls, cu_seqlens: Sequence[int], device: torch.device) -> PackedSequences:
        bounds = tuple(int(bound) for bound in cu_seqlens)
        lengths = [end - start for start, end in itertools.pairwise(bounds)]
        return cls(cu_seqlens=bounds,
                   cu_seqlens_tensor=torch.tensor(bounds, dtype=torch.int32, device=device),
                   max_length=max(lengths, default=0))


# (query (T, H, D), key and value (T, H_kv, D), sequences, scale) -> (T, H, D), causal
# within each sequence
VarlenKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, PackedSequences, float],
                        torch.Tensor]


def varlen_kernel(device: torch.device, dtype: torch.dtype) -> VarlenKernel | None:
    """The variable-length kernel for tensors of ``device`` and ``dtype``, or None where
    the SDPA paths stay (module docstring)."""
    if device.type != "cuda" or dtype not in HALF_DTYPES:
        return None
    return installed_kernel()


@functools.cache
def installed_kernel() -> VarlenKernel | None:
    """flash-attn's varlen function, else torch's, adapted to ``VarlenKernel``; None when
    neither is there in a usable form (looked up once a process)."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        pass
    else:
        return functools.partial(flash_attn_varlen, flash_attn_varlen_func)
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    parameters = inspect.signature(varlen_attn).parameters
    if "scale" not in parameters or "window_size" not in parameters:
        return None
    return functools.partial(torch_varlen, varlen_attn, gqa="enable_gqa" in parameters)


def flash_attn_varlen(function: Callable[..., torch.Tensor], query: torch.Tensor,
                      key: torch.Tensor, value: torch.Tensor, sequences: PackedSequences,
                      scale: float) -> torch.Tensor:
    """``VarlenKernel`` through flash-attn's ``flash_attn_varlen_func`` (grouped key/value
    heads natively; the kernels read contiguous (T, heads, D) tensors)."""
    bounds, longest = sequences.cu_seqlens_tensor, sequences.max_length
    query, key, value = (states.contiguous() for states in (query, key, value))
    return function(query, key, value, bounds, bounds, longest, longest, dropout_p=0.0,
                    softmax_scale=scale, causal=True)


def torch_varlen(function: Callable[..., torch.Tensor], query: torch.Tensor,
                 key: torch.Tensor, value: torch.Tensor, sequences: PackedSequences,
                 scale: float, *, gqa: bool) -> torch.Tensor:
    """``VarlenKernel`` through torch's ``varlen_attn``: causal is the window (-1, 0); fewer
    key/value heads than query heads go as ``enable_gqa`` where ``gqa``, else repeated."""
    options: dict[str, object] = {}
    if key.shape[1] != query.shape[1]:
        if gqa:
            options["enable_gqa"] = True
        else:
            key, value = (states.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
                          for states in (key, value))
    bounds, longest = sequences.cu_seqlens_tensor, sequences.max_length
    query, key, value = (states.contiguous() for states in (query, key, value))
    return function(query, key, value, bounds, bounds, longest, longest, scale=scale,
                    window_size=(-1, 0), **options)


def packed_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            sequences: PackedSequences, *, scale: float,
                            dropout: float = 0.0) -> torch.Tensor:
    """softmax(q k^T * scale, causal within each sequence) v for packed sequences:
    ``query`` (T, H, D), ``key``/``value`` (T, H_kv, D), H a multiple of H_kv (query head h
    reads key/value head h // (H / H_kv)) -> (T, H, D); ``dropout`` on the attention
    weights. The kernel where it applies, else one SDPA call per sequence (module
    docstring)."""
    kernel = varlen_kernel(query.device, query.dtype)
    dim = query.shape[-1]
    if kernel is not None and not dropout and dim % 8 == 0 and dim <= MAX_HEAD_DIM:
        return kernel(query, key, value, sequences, scale)
    out = query.new_empty(query.shape)
    grouped = key.shape[1] != query.shape[1]
    for start, end in itertools.pairwise(sequences.cu_seqlens):
        out[start:end] = F.scaled_dot_product_attention(
            *(states[start:end].transpose(0, 1) for states in (query, key, value)),
            dropout_p=dropout, is_causal=True, scale=scale, enable_gqa=grouped).transpose(0, 1)
    return out
