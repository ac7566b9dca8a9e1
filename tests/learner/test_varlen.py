"""Causal attention within packed sequences (relay.learner.varlen), on the CPU.

- which kernel is chosen for which device, dtype and installed library: flash-attn's varlen
  function first, torch's ``varlen_attn`` in its 2.11+ form (``scale``, ``window_size``,
  with or without ``enable_gqa``), none for torch 2.10's form, the CPU or fp32;
- the two adapters call their kernel as its documentation says (int32 ``cu_seqlens`` on the
  tokens' device, the longest sequence, causal, the scale, grouped key/value heads):
  checked against stand-ins with the kernels' signatures that compute on the CPU with one
  SDPA call per sequence and refuse what the real kernels refuse;
- ``packed_causal_attention`` equals a block-diagonal causal SDPA, through a kernel and
  through its per-sequence loop, and keeps the loop where the kernel cannot run (dropout,
  a head of 12).

What is not run here: the CUDA kernels themselves (``torch.ops.aten._flash_attention_forward``
behind ``varlen_attn``, flash-attn's ``flash_attn_varlen_func``).
"""

from __future__ import annotations

import functools
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from relay.learner import varlen
from relay.learner.varlen import PackedSequences, packed_causal_attention

LENGTHS = [5, 1, 7, 3]


def packed_case(heads: int = 4, kv_heads: int = 2, dim: int = 8,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    query = torch.randn(total, heads, dim, generator=generator).to(dtype)
    key, value = torch.randn(2, total, kv_heads, dim, generator=generator).to(dtype).unbind(0)
    return query, key, value


def block_diagonal_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """One SDPA call over all packed tokens with a dense block-diagonal causal mask."""
    sequence = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    total = len(sequence)
    attend = (sequence[:, None] == sequence[None, :]) & torch.ones(total, total).bool().tril()
    group = query.shape[1] // key.shape[1]
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1).float(), key.repeat_interleave(group, 1).transpose(0, 1).float(),
        value.repeat_interleave(group, 1).transpose(0, 1).float(), attn_mask=attend,
        scale=scale)
    return out.transpose(0, 1)


def loop_sequences(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   cu_seqlens: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    out = torch.empty_like(query)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds, bounds[1:]):
        out[start:end] = F.scaled_dot_product_attention(
            *(t[start:end].transpose(0, 1) for t in (query, key, value)), is_causal=causal,
            scale=scale, enable_gqa=True).transpose(0, 1)
    return out


def check_varlen_arguments(query: torch.Tensor, key: torch.Tensor, cu_seq_q: torch.Tensor,
                           cu_seq_k: torch.Tensor, max_q: int, max_k: int) -> None:
    """What the real kernels require of their arguments."""
    assert cu_seq_q.dtype == cu_seq_k.dtype == torch.int32
    assert cu_seq_q.device == query.device
    assert torch.equal(cu_seq_q, cu_seq_k)
    lengths = cu_seq_q.diff()
    assert max_q == max_k == int(lengths.max())
    assert int(cu_seq_q[-1]) == query.shape[0] == key.shape[0]
    assert query.dim() == key.dim() == 3 and query.is_contiguous() and key.is_contiguous()


def torch_varlen_stand_in(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *,
                          return_aux=None, scale=None, window_size=(-1, -1),
                          enable_gqa=False):
    """``torch.nn.attention.varlen.varlen_attn``'s signature (torch 2.12+), on the CPU."""
    check_varlen_arguments(query, key, cu_seq_q, cu_seq_k, max_q, max_k)
    if not enable_gqa and query.shape[1] != key.shape[1]:
        raise ValueError("Expect query and key/value to have the same number of heads")
    assert window_size in ((-1, -1), (-1, 0))
    return loop_sequences(query, key, value, cu_seq_q, window_size == (-1, 0), scale)


def torch_varlen_2_11_stand_in(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *,
                               return_aux=None, scale=None, window_size=(-1, -1)):
    """The form without ``enable_gqa``: key/value heads must equal the query's."""
    return torch_varlen_stand_in(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                                 scale=scale, window_size=window_size)


def torch_varlen_2_10_stand_in(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                               is_causal=False, return_aux=None):
    raise AssertionError("torch 2.10's varlen_attn has no scale: never called")


def flash_attn_stand_in(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, deterministic=False,
                        return_attn_probs=False, block_table=None):
    """flash-attn 2's ``flash_attn_varlen_func`` signature, on the CPU."""
    check_varlen_arguments(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    assert dropout_p == 0.0 and window_size == (-1, -1)
    return loop_sequences(q, k, v, cu_seqlens_q, causal, softmax_scale)


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch):
    """Install a stand-in ``flash_attn`` or ``torch.nn.attention.varlen`` module for one
    lookup of ``installed_kernel`` (its cache cleared before and after)."""
    def install(flash=None, torch_varlen=None):
        if flash is None:
            monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails
        else:
            monkeypatch.setitem(sys.modules, "flash_attn",
                                types.SimpleNamespace(flash_attn_varlen_func=flash))
        if torch_varlen is not None:
            monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen",
                                types.SimpleNamespace(varlen_attn=torch_varlen))
        varlen.installed_kernel.cache_clear()
        return varlen.installed_kernel()

    varlen.installed_kernel.cache_clear()
    yield install
    varlen.installed_kernel.cache_clear()


def test_the_kernel_runs_only_on_cuda_in_half_precision(installed) -> None:
    installed(flash=flash_attn_stand_in)
    cuda = torch.device("cuda", 0)
    assert varlen.varlen_kernel(cuda, torch.bfloat16) is not None
    assert varlen.varlen_kernel(cuda, torch.float16) is not None
    assert varlen.varlen_kernel(cuda, torch.float32) is None
    assert varlen.varlen_kernel(torch.device("cpu"), torch.bfloat16) is None


def test_flash_attn_is_preferred_when_installed(installed) -> None:
    kernel = installed(flash=flash_attn_stand_in, torch_varlen=torch_varlen_stand_in)
    assert kernel.func is varlen.flash_attn_varlen
    assert kernel.args == (flash_attn_stand_in,)


def test_torch_varlen_by_the_form_this_torch_has(installed) -> None:
    kernel = installed()  # no flash-attn: torch 2.13's own varlen_attn
    from torch.nn.attention.varlen import varlen_attn
    assert (kernel.func, kernel.args, kernel.keywords) == (
        varlen.torch_varlen, (varlen_attn,), {"gqa": True})
    kernel = installed(torch_varlen=torch_varlen_2_11_stand_in)
    assert kernel.keywords == {"gqa": False}
    assert installed(torch_varlen=torch_varlen_2_10_stand_in) is None


KERNELS = {
    "flash-attn": functools.partial(varlen.flash_attn_varlen, flash_attn_stand_in),
    "torch gqa": functools.partial(varlen.torch_varlen, torch_varlen_stand_in, gqa=True),
    "torch 2.11": functools.partial(varlen.torch_varlen, torch_varlen_2_11_stand_in, gqa=False),
}


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_each_adapter_attends_causally_within_each_sequence(
        kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def counted(*args):
        calls.append(1)
        return KERNELS[kernel](*args)

    monkeypatch.setattr(varlen, "varlen_kernel", lambda device, dtype: counted)
    query, key, value = packed_case()
    sequences = PackedSequences.of([0, 5, 6, 13, 16], device=query.device)
    # a transposed view, as Ulysses hands them over: the adapters make them contiguous
    strided = [t.transpose(0, 1).contiguous().transpose(0, 1) for t in (query, key, value)]
    out = packed_causal_attention(*strided, sequences, scale=0.3)
    assert calls == [1]
    torch.testing.assert_close(out, block_diagonal_reference(query, key, value, 0.3))


def test_the_loop_is_the_same_attention_and_stays_where_the_kernel_cannot_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_):
        raise AssertionError("the kernel was called")

    query, key, value = packed_case()
    sequences = PackedSequences.of([0, 5, 6, 13, 16], device=query.device)
    expected = block_diagonal_reference(query, key, value, 0.3)
    torch.testing.assert_close(packed_causal_attention(query, key, value, sequences,
                                                       scale=0.3), expected)  # CPU: no kernel
    monkeypatch.setattr(varlen, "varlen_kernel", lambda device, dtype: refuse)
    torch.manual_seed(0)
    dropped = packed_causal_attention(query, key, value, sequences, scale=0.3, dropout=0.5)
    assert not torch.allclose(dropped, expected)  # dropout applied by the loop's SDPA
    odd_heads = [t[..., :6].contiguous() for t in (query, key, value)]  # head_dim 6: no kernel
    torch.testing.assert_close(
        packed_causal_attention(*odd_heads, sequences, scale=0.3),
        block_diagonal_reference(*odd_heads, 0.3))


def test_packed_sequences_hold_the_bounds_on_both_sides() -> None:
    sequences = PackedSequences.of((0, 5, 6, 13), device=torch.device("cpu"))
    assert sequences.cu_seqlens == (0, 5, 6, 13)
    assert sequences.cu_seqlens_tensor.tolist() == [0, 5, 6, 13]
    assert sequences.cu_seqlens_tensor.dtype == torch.int32
    assert sequences.max_length == 7
