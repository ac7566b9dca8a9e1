"""Measurements for ``tools/bench-engine.py`` (``relay bench engine``): Relay's engines against
transformers' generate; nothing at run time imports this module.

Every contender decodes the same batch: ``batch`` sequences, ``batch / samples_per_prompt`` distinct
prompts of ``prompt_len`` random token ids each repeated ``samples_per_prompt`` times (a GRPO
group's samples: 1 gives all-distinct prompts), exactly ``new_tokens`` new tokens each (nothing
stops early), sampled at temperature 1, on one model in this process. The contenders: the lean
engine (``relay.generators.lean_engine``: lean forward, static cache, one prefill per distinct
prompt), the torch engine (transformers' forward in Relay's decode loop), transformers'
``generate``, and, when given one, any other engine (vLLM's CPU build:
``relay.generators.vllm_engine``, which holds its own copy of the model). The floor is transformers'
bare decode loop: one prefill and ``new_tokens - 1`` single-token forward passes with a KV cache,
greedy, with no sampling, no log-probs and no bookkeeping. Each is timed ``repeats`` times after one
warm-up run; the median is reported as generated tokens per second.

``continuous_batching`` shows the lean engine keeping its batch full: a stream of groups
whose responses end at different lengths (as eos tokens end them in training), many more
than fit at once, goes through ``max_num_seqs`` slots; it reports the mean number of
sequences in flight over the decode steps taken while groups waited, against what static
batches (each decoding until its longest sequence ends) would keep in flight.

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

from relay.generators.engine import Engine, GroupRequest
from relay.generators.lean_engine import LeanEngine
from relay.generators.sampling import SamplingParams
from relay.generators.torch_engine import TorchEngine


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


class BatchOccupancy(msgspec.Struct, frozen=True):
    """Sequences in flight per decode step of one stream of groups (``continuous_batching``)."""

    max_num_seqs: int
    groups: int
    samples_per_prompt: int
    continuous: float  # the lean engine's mean in flight while groups waited
    static: float  # static batches of max_num_seqs sequences: sum(lengths) / sum(longest)
    tokens_per_s: float

    @property
    def continuous_fraction(self) -> float:
        return self.continuous / self.max_num_seqs

    @property
    def static_fraction(self) -> float:
        return self.static / self.max_num_seqs


def continuous_batching(model: PreTrainedModel, *, max_num_seqs: int, prompt_len: int,
                        new_tokens: int, samples_per_prompt: int, groups: int,
                        seed: int = 0) -> BatchOccupancy:
    """Run ``groups`` groups of ``samples_per_prompt`` samples through the lean engine's
    ``max_num_seqs`` slots, each group's samples ending after a length drawn uniformly from
    1..``new_tokens`` (as if an eos token ended them), and measure the batch's occupancy."""
    if groups * samples_per_prompt < 2 * max_num_seqs:
        raise ValueError(f"{groups} groups of {samples_per_prompt} do not fill "
                         f"{max_num_seqs} slots twice: nothing would wait for a slot")
    rng = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, model.config.vocab_size, (groups, prompt_len), generator=rng)
    lengths = torch.randint(1, new_tokens + 1, (groups,), generator=rng).tolist()
    engine = LeanEngine.from_model(model.eval(), eos_ids=[], pad_id=0, seed=seed,
                                   max_num_seqs=max_num_seqs, max_len=prompt_len + new_tokens)
    began = time.perf_counter()
    for index, (prompt, length) in enumerate(zip(prompts.tolist(), lengths, strict=True)):
        params = SamplingParams(max_new_tokens=length, temperature=1.0)
        engine.submit(GroupRequest(index, prompt, samples_per_prompt, params))
    tokens = 0
    while engine.in_flight:
        tokens += sum(c.token_ids.numel() for g in engine.step() for c in g.completions)
    seconds = time.perf_counter() - began
    sequences = [length for length in lengths for _ in range(samples_per_prompt)]
    batches = [sequences[i:i + max_num_seqs] for i in range(0, len(sequences), max_num_seqs)]
    static = sum(sequences) / sum(max(b) for b in batches)  # each batch decodes max(b) steps
    return BatchOccupancy(max_num_seqs=max_num_seqs, groups=groups,
                     samples_per_prompt=samples_per_prompt, continuous=engine.occupancy.mean,
                     static=static, tokens_per_s=tokens / seconds)


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
