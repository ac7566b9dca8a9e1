"""The learner's attention (relay.learner.attention) on padded rows: SDPA's mask on the CPU and in
fp32, the rows' real tokens through the variable-length kernel on CUDA in half precision.

- ``unpads``: only where ``relay.learner.varlen`` has a kernel (CUDA, bf16/fp16), only for plain
  causal attention (not a sliding window);
- ``UnpaddedRows``: where the real tokens sit and where each row starts, for right and left
  padding;
- a padded forward whose mask function finds a kernel (a CPU stand-in with torch
  ``varlen_attn``'s signature, ``tests/learner/test_varlen.py``) calls it once per layer and
  gives the log-probs, entropies and gradients of the SDPA path, on the padded rows and on
  Ulysses' packed slices (one rank).

What is not run here: the CUDA kernel itself; everything around it (the mask function's
choice, the unpadding, the kernel's arguments, the scatter back) is.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

from relay.learner import varlen
from relay.learner.attention import ATTENTION, UnpaddedRows, relay_mask, unpads
from relay.learner.model import forward_logprobs
from relay.learner.ulysses import SequenceParallel

from .test_shared_prompts import random_rollouts
from .test_ulysses import save_random_qwen2
from .test_varlen import torch_varlen_stand_in

CUDA = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def real_kernel_lookup():
    varlen.installed_kernel.cache_clear()
    yield
    varlen.installed_kernel.cache_clear()


def test_padded_rows_unpad_only_where_a_kernel_runs_plain_causal_attention() -> None:
    config = Qwen2Config()
    assert unpads(CUDA, torch.bfloat16, config)  # this torch's varlen_attn
    assert unpads("cuda", torch.float16, config)
    assert not unpads(CUDA, torch.float32, config)
    assert not unpads(torch.device("cpu"), torch.bfloat16, config)
    assert not unpads(CUDA, torch.bfloat16, MistralConfig(sliding_window=16))
    assert not unpads(None, None, None)  # a transformers that passes none of them


def test_the_cpu_mask_is_sdpas() -> None:
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    built = relay_mask(attention_mask=mask.bool(), batch_size=2, q_length=3, kv_length=3,
                       device=torch.device("cpu"), dtype=torch.float32, config=Qwen2Config(),
                       allow_is_causal_skip=False)
    assert isinstance(built, torch.Tensor) and built.shape == (2, 1, 3, 3)


def test_unpadded_rows_find_the_real_tokens_of_right_and_left_padded_rows() -> None:
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]])
    rows = UnpaddedRows.of(mask.bool())
    assert rows.indices.tolist() == [0, 1, 2, 6, 7, 8, 9, 10, 11]
    assert rows.sequences.cu_seqlens == (0, 3, 5, 9, 9)
    assert rows.sequences.cu_seqlens_tensor.dtype == torch.int32
    assert rows.sequences.max_length == 4


def log_probs_and_gradients(model: torch.nn.Module, **options: object) -> list[torch.Tensor]:
    batch = random_rollouts(0)
    model.zero_grad()
    logprobs, entropy = forward_logprobs(model, batch, 0.7, True, **options)
    mask = batch.response_mask
    ((logprobs + 0.1 * entropy) * mask).sum().backward()
    return [logprobs * mask, entropy * mask, *(p.grad.clone() for p in model.parameters())]


@pytest.mark.parametrize("layout", ["padded", "ulysses"])
def test_the_kernel_path_gives_the_sdpa_path_values_and_gradients(
        layout: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        one_rank_group: None) -> None:
    model = AutoModelForCausalLM.from_pretrained(
        save_random_qwen2(tmp_path, kv_heads=2), dtype=torch.float32,
        attn_implementation=ATTENTION)
    options = {} if layout == "padded" else {
        "sp": SequenceParallel(dist.group.WORLD, size=1, rank=0)}
    expected = log_probs_and_gradients(model, **options)
    calls = []

    def kernel(*args):
        calls.append(1)
        return functools.partial(varlen.torch_varlen, torch_varlen_stand_in, gqa=True)(*args)

    monkeypatch.setattr(varlen, "varlen_kernel", lambda device, dtype: kernel)
    got = log_probs_and_gradients(model, **options)
    assert len(calls) == model.config.num_hidden_layers  # one call a layer
    for mine, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-4)
