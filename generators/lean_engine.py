"""The lean engine: continuous batching over ``LeanDecoder``'s KV cache.

The engine owns ``max_num_seqs`` sequence rows. Each ``step``:

1. **Admit** queued groups, in order, while free rows remain, the KV cache has room for
   each sample's prompt plus its ``max_new_tokens`` (``relay.generators.kv_cache``: a paged
   pool reserves those blocks now, so no sequence runs out of room mid-decode and none is
   preempted or truncated) and one prefill stays within its token bound. The group's
   prompt is prefilled once, its keys and values written to the rows of all ``n`` samples
   (the samples of a prompt share one prefill); each sample's first token is drawn from the
   prefill's logits.
2. **Decode** one token for every sequence in flight, in one batched forward. Between
   steps the caller's hook may load new weights; the tokens after it carry the new version
   (in-flight weight swaps, as ``TorchEngine``).
3. **Retire** the sequences that drew an eos token or reached their ``max_new_tokens``,
   giving their cache room back; a group is returned when its last sample is done.
   Sequences in flight are kept in rows 0..active-1 (a retired row is filled by the last
   sequence), so the decode reads the first ``active`` rows.

The bookkeeping (who owns a row, what it generated) lives on the host: a step brings its
drawn tokens and log-probs to the host in one transfer, its only device sync.
Sampling is ``relay.generators.sampling.sample_next`` on the same logits a transformers forward
gives (up to float rounding), so the distribution and behavior log-probs are unchanged.
``occupancy`` records the mean number of sequences in flight over the decode steps taken
while groups were queued (when a full batch was possible).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from relay.generators.engine import (
    Completion,
    Engine,
    FinishedGroup,
    GroupRequest,
    StepHook,
    check_request,
    check_weights,
    copy_device,
)
from relay.generators.lean_model import CacheMemory, LeanDecoder
from relay.generators.sampling import SamplingParams, sample_next


@dataclass
class _Group:
    """A group in flight: its request and the completions finished so far."""

    request: GroupRequest
    done: dict[int, Completion] = field(default_factory=dict)


@dataclass
class _Output:
    """What a row generated so far, token by token."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


@dataclass
class Occupancy:
    """Sequences in flight, summed over the decode steps taken while groups were queued."""

    steps: int = 0
    sequences: int = 0

    @property
    def mean(self) -> float:
        return self.sequences / self.steps if self.steps else 0.0


class LeanEngine(Engine):
    """Continuous batching with a lean Llama/Qwen2/Qwen3 forward; see the module docstring."""

    name = "lean"

    def __init__(self, decoder: LeanDecoder, *, eos_ids: Sequence[int], pad_id: int,
                 seed: int = 0) -> None:
        super().__init__()
        self.decoder = decoder
        self.cache = decoder.cache
        self.device = decoder.device
        self.max_num_seqs = decoder.slots
        self.eos_ids = frozenset(eos_ids)
        self.pad_id = pad_id
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._queue: deque[GroupRequest] = deque()
        slots = decoder.slots
        # per row, on the device for the forward: the position to write next, the token to feed
        self._positions = torch.zeros(slots, dtype=torch.long, device=self.device)
        self._tokens = torch.zeros(slots, dtype=torch.long, device=self.device)
        # per row, on the host for the bookkeeping (no device sync): who owns it, its prompt
        # length, max_new_tokens and what it generated so far
        self._owner: list[tuple[_Group, int] | None] = [None] * slots  # group, sample index
        self._prompt_len = [0] * slots
        self._limits = [0] * slots
        self._out: list[_Output] = [_Output() for _ in range(slots)]
        self._active = 0
        self.occupancy = Occupancy()

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: torch.dtype, device: str = "cpu",
                        eos_ids: Sequence[int], pad_id: int, seed: int = 0,
                        trust_remote_code: bool = False, max_num_seqs: int = 256,
                        max_len: int = 2048, memory: CacheMemory | None = None) -> LeanEngine:
        """Load a Hugging Face checkpoint with transformers and copy its weights in; the KV
        cache as ``memory`` allows (``relay.generators.lean_model.CacheMemory``).

        Raises ``relay.generators.lean_model.UnsupportedModel`` for architectures the lean
        forward does not implement (before loading any weights).
        """
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        decoder = LeanDecoder(config, slots=max_num_seqs, max_len=max_len, dtype=dtype,
                              device=device, memory=memory)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                     trust_remote_code=trust_remote_code)
        engine = cls(decoder, eos_ids=eos_ids, pad_id=pad_id, seed=seed)
        engine.load_weights(0, dict(model.named_parameters()))
        return engine

    @classmethod
    def from_model(cls, model: PreTrainedModel, *, eos_ids: Sequence[int], pad_id: int,
                   seed: int = 0, max_num_seqs: int = 256, max_len: int = 2048,
                   memory: CacheMemory | None = None) -> LeanEngine:
        """An engine holding a copy of an in-memory transformers model's weights."""
        parameter = next(model.parameters())
        decoder = LeanDecoder(model.config, slots=max_num_seqs, max_len=max_len,
                              dtype=parameter.dtype, device=parameter.device, memory=memory)
        engine = cls(decoder, eos_ids=eos_ids, pad_id=pad_id, seed=seed)
        engine.load_weights(0, {n: p.detach() for n, p in model.named_parameters()})
        return engine

    # -- weights ------------------------------------------------------------------------

    def reseed(self, seed: int) -> None:
        self._generator.manual_seed(seed)

    def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        check_weights(self.decoder.parameter_shapes(), tensors)
        self.decoder.load(tensors)
        self.version = version

    @property
    def staging_device(self) -> torch.device | None:
        return copy_device(self.device)

    # -- batch interface ----------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 between_steps: StepHook | None = None) -> list[Completion]:
        """Runs of identical prompts become groups (sharing a prefill); the completions come
        back in prompt order."""
        runs: list[tuple[list[int], int]] = []
        for prompt in prompts:
            prompt = list(prompt)
            if runs and runs[-1][0] == prompt:
                runs[-1] = (prompt, runs[-1][1] + 1)
            else:
                runs.append((prompt, 1))
        for index, (prompt, n) in enumerate(runs):
            self.submit(GroupRequest(("generate", index), prompt, n, params))
        finished: dict[object, list[Completion]] = {}
        while len(finished) < len(runs):
            for group in self.step(between_steps):
                finished[group.key] = group.completions
        return [c for index in range(len(runs)) for c in finished[("generate", index)]]

    # -- continuous batching ------------------------------------------------------------

    def submit(self, request: GroupRequest) -> None:
        check_request(request)
        if request.n > self.max_num_seqs:
            raise ValueError(f"group {request.key!r}: n = {request.n} samples exceed the "
                             f"engine's {self.max_num_seqs} slots (rollout.max_num_seqs)")
        room = self.decoder.max_len - request.params.max_new_tokens
        if len(request.prompt_ids) > room:
            raise ValueError(f"group {request.key!r}: a {len(request.prompt_ids)}-token prompt "
                             f"and {request.params.max_new_tokens} new tokens exceed the "
                             f"engine's {self.decoder.max_len} positions")
        room = self.cache.capacity_error(request.n, len(request.prompt_ids)
                                         + request.params.max_new_tokens)
        if room is not None:
            raise ValueError(f"group {request.key!r}: {room}")
        self._queue.append(request)

    @property
    def in_flight(self) -> int:
        return self._active + sum(r.n for r in self._queue)

    def step(self, between_steps: StepHook | None = None) -> list[FinishedGroup]:
        finished: list[FinishedGroup] = []
        if self._active:
            if between_steps is not None:
                between_steps()
            self._decode(finished)
        self._admit(finished)
        return finished

    @torch.inference_mode()
    def _admit(self, finished: list[FinishedGroup]) -> None:
        """Prefill queued groups into free rows and draw their first tokens: groups are
        taken in order while rows, cache room (``KVCache.can_hold``: the prompt plus
        ``max_new_tokens`` of each sample) and the prefill's token bound allow."""
        admitted: list[_Group] = []
        used, width = self._active, 0
        bound = self.decoder.cache_plan.prefill_tokens
        while self._queue:
            request = self._queue[0]
            prompt_len = len(request.prompt_ids)
            positions = [prompt_len + request.params.max_new_tokens] * request.n
            if (used + request.n > self.max_num_seqs or not self.cache.can_hold(positions)
                    or (admitted and (len(admitted) + 1) * max(width, prompt_len) > bound)):
                break
            self._queue.popleft()
            self.cache.reserve(used, positions)
            admitted.append(_Group(request))
            used += request.n
            width = max(width, prompt_len)
        if not admitted:
            if self._queue and not self._active:  # submit() refuses what could never fit
                raise RuntimeError(f"the lean engine stalled: group {self._queue[0].key!r} "
                                   "waits for KV cache room with no sequence in flight")
            return
        prompts = [list(g.request.prompt_ids) for g in admitted]
        padded = torch.tensor([p + [self.pad_id] * (width - len(p)) for p in prompts],
                              dtype=torch.long, device=self.device)
        samples = [g.request.n for g in admitted]
        start = self._active
        logits = self.decoder.prefill(padded, [len(p) for p in prompts], start, samples)
        row = start
        for g in admitted:
            for sample in range(g.request.n):
                self._owner[row] = (g, sample)
                self._prompt_len[row] = len(g.request.prompt_ids)
                self._limits[row] = g.request.params.max_new_tokens
                self._out[row] = _Output()
                row += 1
        self._active = used
        self._positions[start:used] = torch.tensor(self._prompt_len[start:used],
                                                   dtype=torch.long, device=self.device)
        repeats = torch.tensor(samples, dtype=torch.long, device=self.device)
        self._sample(range(start, used), logits.repeat_interleave(repeats, dim=0), finished)

    @torch.inference_mode()
    def _decode(self, finished: list[FinishedGroup]) -> None:
        active = self._active
        if self._queue:
            self.occupancy.steps += 1
            self.occupancy.sequences += active
        # the fed token of a row sits at prompt length + generated - 1
        context = max(p + len(o.tokens) for p, o in zip(self._prompt_len[:active],
                                                         self._out[:active], strict=True))
        logits = self.decoder.decode(self._tokens[:active], self._positions[:active], active,
                                     context)
        self._positions[:active] += 1
        self._sample(range(active), logits, finished)

    def _sample(self, rows: range, logits: torch.Tensor, finished: list[FinishedGroup]) -> None:
        """Draw a token for each of ``rows`` from their logits, record it, and retire the
        sequences it ends. The drawn tokens and log-probs come to the host in one transfer,
        the step's only device sync."""
        tokens, logprobs = self._draw(self._owner[rows.start:rows.stop], logits)
        self._tokens[rows.start:rows.stop] = tokens
        host_tokens, host_logprobs = torch.stack((tokens.double(), logprobs.double())).tolist()
        version = self.version
        ending: list[int] = []
        stopped: list[bool] = []
        for row, token, logprob in zip(rows, host_tokens, host_logprobs, strict=True):
            out, token = self._out[row], int(token)
            out.tokens.append(token)
            out.logprobs.append(logprob)
            out.versions.append(version)
            eos = token in self.eos_ids
            if eos or len(out.tokens) >= self._limits[row]:
                ending.append(row)
                stopped.append(eos)
        if ending:
            self._retire(ending, stopped, finished)

    def _draw(self, owners: list[tuple[_Group, int] | None],
              logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens (B,) and their log-probs (B,) fp32, each row under its group's sampling
        parameters (one draw over all rows when they share them, as they usually do)."""
        by_params = _by_params(owners)
        if len(by_params) == 1:
            (params,) = by_params
            drawn, logprob = sample_next(logits, params, self._generator)
            return drawn, logprob.float()
        tokens = torch.empty(len(owners), dtype=torch.long, device=self.device)
        logprobs = torch.empty(len(owners), dtype=torch.float32, device=self.device)
        for params, members in by_params.items():
            index = torch.tensor(members, dtype=torch.long, device=self.device)
            drawn, logprob = sample_next(logits[index], params, self._generator)
            tokens[index], logprobs[index] = drawn, logprob.float()
        return tokens, logprobs

    def _retire(self, rows: list[int], stopped: list[bool],
                finished: list[FinishedGroup]) -> None:
        """Hand finished sequences to their groups, free their cache room, then refill the
        holes from the end."""
        for row, eos in zip(rows, stopped, strict=True):
            group, sample = self._owner[row]
            out = self._out[row]
            group.done[sample] = Completion(
                token_ids=torch.tensor(out.tokens, dtype=torch.int32, device="cpu"),
                logprobs=torch.tensor(out.logprobs, dtype=torch.float32, device="cpu"),
                versions=torch.tensor(out.versions, dtype=torch.int32, device="cpu"),
                finish_reason="stop" if eos else "length")
            if len(group.done) == group.request.n:
                finished.append(FinishedGroup(group.request.key,
                                              [group.done[i] for i in range(group.request.n)]))
            self._owner[row] = None
        self.cache.release(rows)
        self._compact()

    def _compact(self) -> None:
        """Move the sequences above the new ``active`` count into the holes below it."""
        live = [r for r in range(self._active) if self._owner[r] is not None]
        self._active = len(live)
        holes = [r for r in range(self._active) if self._owner[r] is None]
        sources = [r for r in live if r >= self._active]
        if not sources:
            return
        # positions 0..prompt + generated - 2 are cached (the last token is fed next)
        length = max(self._prompt_len[r] + len(self._out[r].tokens) - 1 for r in sources)
        self.cache.move(sources, holes, length)
        for hole, source in zip(holes, sources, strict=True):
            for state in (self._owner, self._prompt_len, self._limits, self._out):
                state[hole] = state[source]
            self._owner[source] = None
        src = torch.tensor(sources, dtype=torch.long, device=self.device)
        dst = torch.tensor(holes, dtype=torch.long, device=self.device)
        for state in (self._positions, self._tokens):
            state[dst] = state[src]


def _by_params(owners: list[tuple[_Group, int]]) -> dict[SamplingParams, list[int]]:
    """Row indices grouped by their group's sampling parameters (usually one setting)."""
    groups: dict[SamplingParams, list[int]] = {}
    for row, (group, _) in enumerate(owners):
        groups.setdefault(group.request.params, []).append(row)
    return groups
