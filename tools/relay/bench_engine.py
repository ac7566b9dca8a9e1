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

``tool_episodes`` shows that tools never block decoding: two-turn episodes (a turn, a tool
call, a second turn) go through the lean engine's slots, and every ``sleepy_every``-th
episode's tool sleeps ``sleep_s``. It reports the mean number of sequences in flight over
the decode steps taken while a sleep was pending and enough other episodes were awake to
fill the slots (at the end of the stream only sleepers are left), and the wall time against the same
episodes with an instant tool: an episode awaiting its tool holds no slot, so the sleeps
overlap the other episodes' decoding (and each other), where a lockstep batcher, whose
batch of ``max_num_seqs`` waits for its slowest tool, would add ``sleep_s`` per batch
holding a sleepy episode (``lockstep_extra_s``).

``compute_ceiling`` is what the arithmetic alone would allow: this machine's measured
matmul rate in the model's dtype divided by the forward FLOPs of one decoded token,

    2 * parameters + 4 * layers * heads * head_dim * (prompt_len + new_tokens / 2)

(the weights' multiply-adds, and attention over the mean context; heads * head_dim is the
hidden size unless the config sets a wider or narrower head_dim). The gap between the
floor and this ceiling is the framework's per-call overhead.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable

import msgspec
import torch
from transformers import DynamicCache, PreTrainedModel

from relay.generators.engine import Engine, GroupRequest
from relay.generators.lean_engine import LeanEngine
from relay.generators.sampling import SamplingParams
from relay.generators.tools import BaseTool, ParsedCall, ToolSchema, ToolSession, run_calls
from relay.generators.torch_engine import TorchEngine
from relay.generators.workflow import (EngineHandle, Episode, EpisodeBuilder, EpisodeRow,
                                       WorkflowRunner, play_episodes)


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


class ToolOccupancy(msgspec.Struct, frozen=True):
    """Two-turn episodes with a sleeping tool against an instant one (``tool_episodes``)."""

    max_num_seqs: int
    episodes: int
    sleepy: int  # episodes whose tool slept
    sleep_s: float
    instant_s: float  # wall time with an instant tool
    sleepy_s: float  # wall time with the sleeping tool
    # mean sequences in flight per decode step taken while a sleep pended and enough other
    # episodes were awake to fill the slots
    occupancy_while_sleeping: float
    steps_while_sleeping: int
    lockstep_extra_s: float  # what waiting for each batch's slowest tool would add

    @property
    def extra_s(self) -> float:
        return self.sleepy_s - self.instant_s


class _SleepTool(BaseTool):
    """A tool that sleeps ``sleep_s`` when asked to (``{"sleep": true}``), else answers at
    once; ``pending`` counts the sleeps in progress."""

    def __init__(self, sleep_s: float) -> None:
        super().__init__({}, ToolSchema.parse({"type": "function", "function": {
            "name": "wait", "description": "waits",
            "parameters": {"type": "object", "properties": {}}}}))
        self.sleep_s, self.pending = sleep_s, 0

    async def execute(self, instance_id, parameters, **kwargs):
        if parameters.get("sleep"):
            self.pending += 1
            try:
                await asyncio.sleep(self.sleep_s)
            finally:
                self.pending -= 1
        return "done", 0.0, {}


def tool_episodes(model: PreTrainedModel, *, max_num_seqs: int, prompt_len: int,
                  new_tokens: int, episodes: int, sleepy_every: int, sleep_s: float,
                  seed: int = 0) -> ToolOccupancy:
    """Run ``episodes`` two-turn episodes of up to ``new_tokens`` tokens a turn through the
    lean engine's ``max_num_seqs`` slots, first with an instant tool, then with one that
    sleeps ``sleep_s`` on every ``sleepy_every``-th episode (module docstring)."""
    rng = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, model.config.vocab_size, (episodes, prompt_len),
                            generator=rng).tolist()
    lengths = torch.randint(1, new_tokens + 1, (episodes, 2), generator=rng).tolist()
    reply = torch.randint(0, model.config.vocab_size, (4,), generator=rng).tolist()
    sleepy = set(range(0, episodes, sleepy_every))

    def run(sleeping: bool) -> tuple[float, list[int]]:
        tool = _SleepTool(sleep_s)
        tools = {"wait": tool}

        async def episode(engine: EngineHandle, row: EpisodeRow) -> Episode:
            index = int(row.prompt_id)
            builder = EpisodeBuilder(engine.response_length)
            turn = await engine.generate(row.prompt_ids, max_new_tokens=lengths[index][0])
            builder.sampled(turn)
            call = ParsedCall(name="wait", arguments={"sleep": sleeping and index in sleepy},
                              raw="")
            async with ToolSession(tools) as session:
                await run_calls(session, [call], timeout_s=sleep_s + 30.0)
            builder.inserted(reply, engine.version)
            context = [*row.prompt_ids, *turn.token_ids, *reply]
            builder.sampled(await engine.generate(context, max_new_tokens=lengths[index][1]))
            return builder.episode

        engine = LeanEngine.from_model(model.eval(), eos_ids=[], pad_id=0, seed=seed,
                                       max_num_seqs=max_num_seqs,
                                       max_len=prompt_len + 2 * new_tokens + len(reply))
        in_flight_while_sleeping: list[int] = []
        plain_step = engine.step

        def recording_step(between_steps=None):
            # a step while a sleep pends and enough episodes are awake to fill the slots
            if tool.pending and runner.live - tool.pending >= max_num_seqs:
                in_flight_while_sleeping.append(min(engine.in_flight, max_num_seqs))
            return plain_step(between_steps)

        engine.step = recording_step  # type: ignore[method-assign]
        runner = WorkflowRunner(episode, tokenizer=None,
                                response_length=2 * new_tokens + len(reply),
                                engine_version=lambda: engine.version)
        params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
        groups = [(GroupRequest(i, prompt, 1, params),
                   EpisodeRow(prompt_id=str(i), messages=[], data_source="", ground_truth=None,
                              extra_info={}, prompt_ids=prompt, sample_index=0))
                  for i, prompt in enumerate(prompts)]
        began = time.perf_counter()
        try:
            play_episodes(runner, engine, groups, wait_s=0.01)
        finally:
            runner.close()
        return time.perf_counter() - began, in_flight_while_sleeping

    instant_s, _ = run(sleeping=False)
    sleepy_s, in_flight = run(sleeping=True)
    batches = [range(i, min(i + max_num_seqs, episodes)) for i in range(0, episodes, max_num_seqs)]
    lockstep = sleep_s * sum(any(i in sleepy for i in batch) for batch in batches)
    return ToolOccupancy(max_num_seqs=max_num_seqs, episodes=episodes, sleepy=len(sleepy),
                         sleep_s=sleep_s, instant_s=instant_s, sleepy_s=sleepy_s,
                         occupancy_while_sleeping=statistics.mean(in_flight) if in_flight
                         else 0.0, steps_while_sleeping=len(in_flight),
                         lockstep_extra_s=lockstep)


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
