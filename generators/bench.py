"""Measurements for ``tools/bench-engine.py``: Relay's engines against transformers' generate.

Every contender decodes the same batch: ``batch`` sequences, ``batch / samples_per_prompt``
distinct prompts of ``prompt_len`` random token ids each repeated ``samples_per_prompt``
times (a GRPO group's samples: 1 gives all-distinct prompts), exactly ``new_tokens`` new
tokens each (nothing stops early), sampled at temperature 1, on one model in this process.
The contenders: the lean engine (``generators.lean_engine``: lean forward, static cache,
one prefill per distinct prompt), the torch engine (transformers' forward in Relay's decode
loop), transformers' ``generate``, and, when given one, any other engine (vLLM's CPU build:
``generators.vllm_engine``, which holds its own copy of the model). The floor is transformers' bare decode loop: one
prefill and ``new_tokens - 1`` single-token forward passes with a KV cache, greedy, with no
sampling, no log-probs and no bookkeeping. Each is timed ``repeats`` times after one warm-up
run; the median is reported as generated tokens per second.

``compute_ceiling`` is what the arithmetic alone would allow: this machine's measured
matmul rate in the model's dtype divided by the forward FLOPs of one decoded token,

    2 * parameters + 4 * layers * heads * head_dim * (prompt_len + new_tokens / 2)

(the weights' multiply-adds, and attention over the mean context; heads * head_dim is the
hidden size unless the config sets a wider or narrower head_dim). The gap between the
floor and this ceiling is the framework's per-call overhead.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import msgspec
import torch
from transformers import DynamicCache, PreTrainedModel

from generators.engine import Engine
from generators.lean_engine import LeanEngine
from generators.sampling import SamplingParams
from generators.torch_engine import TorchEngine


class EngineComparison(msgspec.Struct, frozen=True):
    """Generated tokens per second (medians) of each contender at one shape."""

    batch: int
    prompt_len: int
    new_tokens: int
    samples_per_prompt: int
    lean: float
    torch: float
    hf_generate: float
    floor: float
    compute_ceiling: float
    other: float | None = None  # the extra engine's, when one was given

    @property
    def other_over_lean(self) -> float | None:
        return None if self.other is None else self.other / self.lean

    @property
    def lean_over_hf(self) -> float:
        return self.lean / self.hf_generate

    @property
    def floor_over_lean(self) -> float:
        return self.floor / self.lean


def _median_tokens_per_s(run: Callable[[], int], repeats: int) -> float:
    run()  # warm-up: allocator, kernels, caches
    rates = []
    for _ in range(repeats):
        began = time.perf_counter()
        tokens = run()
        rates.append(tokens / (time.perf_counter() - began))
    return statistics.median(rates)


def matmul_flops_per_s(dtype: torch.dtype, size: int = 1024, repeats: int = 5) -> float:
    """The median rate of a ``size``-cubed matmul in ``dtype`` on this machine."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b  # warm-up
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - began)
    return 2 * size ** 3 / statistics.median(times)


def forward_flops_per_token(model: PreTrainedModel, context: float) -> float:
    """2 * parameters + 4 * layers * heads * head_dim * context (see the module docstring)."""
    config = model.config
    parameters = sum(p.numel() for p in model.parameters())
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * parameters + 4 * config.num_hidden_layers * heads * head_dim * context


def compare_engines(model: PreTrainedModel, *, batch: int, prompt_len: int, new_tokens: int,
                    samples_per_prompt: int = 1, repeats: int = 5, seed: int = 0,
                    other: Engine | None = None) -> EngineComparison:
    """The lean and torch engines, transformers' ``generate``, the bare decode floor and
    ``other`` (an engine holding the same weights) when given."""
    if batch % samples_per_prompt:
        raise ValueError(f"batch {batch} is not a multiple of {samples_per_prompt} samples")
    model = model.eval()
    vocab = model.config.vocab_size
    distinct = torch.randint(0, vocab, (batch // samples_per_prompt, prompt_len),
                             generator=torch.Generator().manual_seed(seed))
    prompts = distinct.repeat_interleave(samples_per_prompt, dim=0)
    # no eos: nothing stops early
    lean = LeanEngine.from_model(model, eos_ids=[], pad_id=0, seed=seed, max_num_seqs=batch,
                                 max_len=prompt_len + new_tokens)
    plain = TorchEngine(model, eos_ids=[], pad_id=0, seed=seed)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)

    def engine_run(engine: Engine) -> Callable[[], int]:
        def run() -> int:
            completions = engine.generate(prompts.tolist(), params)
            return sum(c.token_ids.numel() for c in completions)
        return run

    @torch.inference_mode()
    def hf_generate() -> int:
        out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                             do_sample=True, temperature=1.0, top_k=None, top_p=None,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             pad_token_id=0)
        return out[:, prompt_len:].numel()

    @torch.inference_mode()
    def floor() -> int:
        cache = DynamicCache()
        logits = model(input_ids=prompts, past_key_values=cache, use_cache=True,
                       logits_to_keep=1).logits[:, -1]
        for _ in range(new_tokens - 1):
            token = logits.argmax(-1, keepdim=True)
            logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1]
        return batch * new_tokens

    dtype = next(model.parameters()).dtype
    ceiling = matmul_flops_per_s(dtype) / forward_flops_per_token(
        model, context=prompt_len + new_tokens / 2)
    return EngineComparison(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
                            samples_per_prompt=samples_per_prompt,
                            lean=_median_tokens_per_s(engine_run(lean), repeats),
                            torch=_median_tokens_per_s(engine_run(plain), repeats),
                            hf_generate=_median_tokens_per_s(hf_generate, repeats),
                            floor=_median_tokens_per_s(floor, repeats),
                            compute_ceiling=ceiling,
                            other=None if other is None else _median_tokens_per_s(
                                engine_run(other), repeats))
