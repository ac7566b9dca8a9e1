"""Token log-probs and entropy against hand-computed values; the chunked LM head
(``head_logprobs``) against whole logits, values and gradients, and its memory."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from relay.algorithms.logprobs import entropy_from_logits, head_logprobs, token_logprobs


def test_token_logprobs_with_temperature() -> None:
    logits = torch.tensor([[0.0, math.log(3.0)]])
    assert token_logprobs(logits, torch.tensor([1])).item() == pytest.approx(math.log(0.75))
    p = math.sqrt(3) / (1 + math.sqrt(3))  # softmax([0, ln3 / 2])[1]
    got = token_logprobs(logits, torch.tensor([1]), temperature=2.0).item()
    assert got == pytest.approx(math.log(p), rel=1e-6)


def test_entropy() -> None:
    got = entropy_from_logits(torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)]]))
    expected = [math.log(2), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]
    torch.testing.assert_close(got, torch.tensor(expected))


def test_bf16_logits_are_computed_in_fp32() -> None:
    logits = torch.randn(3, 7, dtype=torch.bfloat16)
    assert token_logprobs(logits, torch.tensor([0, 1, 2])).dtype == torch.float32


def whole_logits_reference(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor,
                           temperature: float, weights: torch.Tensor) -> list[torch.Tensor]:
    """Log-probs, entropies, and the gradients of sum(w0 logp + w1 H) w.r.t. hidden and
    weight, through whole logits and the functions above (the learner's path before
    chunking)."""
    hidden, weight = (t.detach().requires_grad_() for t in (hidden, weight))
    logits = hidden @ weight.T
    logprobs = token_logprobs(logits, tokens, temperature)
    entropy = entropy_from_logits(logits, temperature)
    loss = (logprobs * weights[0] + entropy * weights[1]).sum()
    return [logprobs, entropy, *torch.autograd.grad(loss, (hidden, weight))]


def chunked(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor,
            temperature: float, weights: torch.Tensor, chunk_bytes: int) -> list[torch.Tensor]:
    hidden, weight = (t.detach().requires_grad_() for t in (hidden, weight))
    logprobs, entropy = head_logprobs(hidden, weight, tokens, temperature, True, chunk_bytes)
    loss = (logprobs * weights[0] + entropy * weights[1]).sum()
    return [logprobs, entropy, *torch.autograd.grad(loss, (hidden, weight))]


def head_case(dtype: torch.dtype = torch.float32, positions: int = 37, vocab: int = 50,
              dim: int = 16) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(positions, dim, generator=generator).to(dtype)
    weight = torch.randn(vocab, dim, generator=generator).to(dtype)
    tokens = torch.randint(0, vocab, (positions,), generator=generator)
    return hidden, weight, tokens, torch.randn(2, positions, generator=generator)


# one position a chunk; 5 positions (uneven: 37 = 7 x 5 + 2); everything in one chunk
CHUNK_BYTES = (1, 4 * 50 * 5, 2**30)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_bytes", CHUNK_BYTES)
def test_head_logprobs_equal_whole_logits_values_and_gradients(
        chunk_bytes: int, temperature: float) -> None:
    hidden, weight, tokens, weights = head_case()
    expected = whole_logits_reference(hidden, weight, tokens, temperature, weights)
    got = chunked(hidden, weight, tokens, temperature, weights, chunk_bytes)
    for name, mine, theirs in zip(("logp", "entropy", "d hidden", "d weight"), got, expected,
                                  strict=True):
        assert mine.dtype == theirs.dtype
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("weights", [(1.0, 0.0), (0.0, 1.0)])
def test_head_logprobs_gradient_of_one_output_alone(weights: tuple[float, float]) -> None:
    """A loss of the log-probs only (or the entropies only): the other gradient is None
    in the backward and its term is skipped, not taken as zero by mistake elsewhere."""
    hidden, weight, tokens, _ = head_case()
    per_token = torch.tensor(weights)[:, None].expand(2, len(tokens))
    expected = whole_logits_reference(hidden, weight, tokens, 0.7, per_token)[2:]
    hidden, weight = (t.requires_grad_() for t in (hidden, weight))
    logprobs, entropy = head_logprobs(hidden, weight, tokens, 0.7, True, chunk_bytes=4 * 50 * 5)
    used = logprobs if weights[0] else entropy
    got = torch.autograd.grad(used.sum(), (hidden, weight))
    for mine, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_head_logprobs_without_entropy() -> None:
    hidden, weight, tokens, weights = head_case()
    logprobs, entropy = head_logprobs(hidden, weight, tokens, 0.7, with_entropy=False)
    assert entropy is None
    expected = whole_logits_reference(hidden, weight, tokens, 0.7, weights)[0]
    torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=1e-5)


def test_head_logprobs_in_bf16_stay_within_bf16_rounding_of_fp32() -> None:
    """bf16 hidden states and weight: the chunk's logits are a bf16 matmul as the model's
    own head computes them, everything after in fp32; the weight's gradient sums the
    chunks' bf16 products in fp32."""
    hidden, weight, tokens, weights = head_case(torch.bfloat16, positions=64)
    expected = whole_logits_reference(hidden, weight, tokens, 0.7, weights)
    got = chunked(hidden, weight, tokens, 0.7, weights, chunk_bytes=4 * 50 * 4)  # 16 chunks
    assert got[0].dtype == got[1].dtype == torch.float32
    assert got[2].dtype == got[3].dtype == torch.bfloat16
    for mine, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(mine.float(), theirs.float(), atol=5e-2, rtol=2e-2)


class Float32Sizes(TorchDispatchMode):
    """The largest fp32 tensor (elements) any operation returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32:
                self.largest = max(self.largest, tensor.numel())
        return out


def test_head_logprobs_never_hold_more_than_a_chunk_of_fp32_logits() -> None:
    positions, vocab, dim = 64, 50, 4  # a logits row (50) outnumbers a weight row (4)
    hidden, weight, tokens, _ = head_case(torch.bfloat16, positions, vocab, dim)
    hidden.requires_grad_()
    with Float32Sizes() as seen:
        logprobs, entropy = head_logprobs(hidden, weight, tokens, 0.7, True,
                                          chunk_bytes=4 * vocab * 8)  # 8 positions a chunk
        (logprobs + entropy).sum().backward()
    assert seen.largest == 8 * vocab  # never all 64 positions' logits (3,200 elements)
