"""The lean engine: continuous batching over ``LeanDecoder``'s static KV cache.

The engine owns ``max_num_seqs`` sequence slots. Each ``step``:

1. **Admit** queued groups while free slots remain: the group's prompt is prefilled once,
   its keys and values written to the slots of all ``n`` samples (the samples of a prompt
   share one prefill); each sample's first token is drawn from the prefill's logits.
2. **Decode** one token for every sequence in flight, in one batched forward. Between
   steps the caller's hook may load new weights; the tokens after it carry the new version
   (in-flight weight swaps, as ``TorchEngine``).
3. **Retire** the sequences that drew an eos token or reached their ``max_new_tokens``;
   a group is returned when its last sample is done. Sequences in flight are kept in slots
   0..active-1 (a retired slot is filled by the last sequence), so the decode reads the
   cache as one contiguous view.

Sampling is ``generators.sampling.sample_next`` on the same logits a transformers forward
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

from generators.engine import (
    Completion,
    Engine,
    FinishedGroup,
    GroupRequest,
    StepHook,
    check_request,
    check_weights,
)
from generators.lean_model import LeanDecoder
from generators.sampling import SamplingParams, sample_next


@dataclass
class _Group:
    """A group in flight: its request and the completions finished so far."""

    request: GroupRequest
    done: dict[int, Completion] = field(default_factory=dict)


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
        self.device = decoder.device
        self.max_num_seqs = decoder.slots
        self.eos_ids = frozenset(eos_ids)
        self.pad_id = pad_id
        self._eos = torch.tensor(sorted(self.eos_ids), dtype=torch.long, device=self.device)
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._queue: deque[GroupRequest] = deque()
        slots, width = decoder.slots, decoder.max_len
        # per slot: next position to write, the token to feed, tokens generated so far
        self._positions = torch.zeros(slots, dtype=torch.long, device=self.device)
        self._tokens = torch.zeros(slots, dtype=torch.long, device=self.device)
        self._generated = torch.zeros(slots, dtype=torch.long, device=self.device)
        self._limits = torch.zeros(slots, dtype=torch.long, device=self.device)  # max_new_tokens
        self._out_tokens = torch.zeros((slots, width), dtype=torch.int32)
        self._out_logprobs = torch.zeros((slots, width), dtype=torch.float32)
        self._out_versions = torch.zeros((slots, width), dtype=torch.int32)
        self._owner: list[tuple[_Group, int] | None] = [None] * slots  # group, sample index
        self._active = 0
        self.occupancy = Occupancy()

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: torch.dtype, device: str = "cpu",
                        eos_ids: Sequence[int], pad_id: int, seed: int = 0,
                        trust_remote_code: bool = False, max_num_seqs: int = 256,
                        max_len: int = 2048) -> LeanEngine:
        """Load a Hugging Face checkpoint with transformers and copy its weights in.

        Raises ``generators.lean_model.UnsupportedModel`` for architectures the lean
        forward does not implement (before loading any weights).
        """
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        decoder = LeanDecoder(config, slots=max_num_seqs, max_len=max_len, dtype=dtype,
                              device=device)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                     trust_remote_code=trust_remote_code)
        engine = cls(decoder, eos_ids=eos_ids, pad_id=pad_id, seed=seed)
        engine.load_weights(0, dict(model.named_parameters()))
        return engine

    @classmethod
    def from_model(cls, model: PreTrainedModel, *, eos_ids: Sequence[int], pad_id: int,
                   seed: int = 0, max_num_seqs: int = 256, max_len: int = 2048) -> LeanEngine:
        """An engine holding a copy of an in-memory transformers model's weights."""
        parameter = next(model.parameters())
        decoder = LeanDecoder(model.config, slots=max_num_seqs, max_len=max_len,
                              dtype=parameter.dtype, device=parameter.device)
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
        self._queue.append(request)

    @property
    def in_flight(self) -> int:
        return self._active + sum(r.n for r in self._queue)

    @property
    def free_slots(self) -> int:
        """Slots neither generating nor promised to a queued group."""
        return self.max_num_seqs - self.in_flight

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
        """Prefill queued groups into free slots and draw their first tokens."""
        admitted: list[_Group] = []
        used = self._active
        while self._queue and used + self._queue[0].n <= self.max_num_seqs:
            request = self._queue.popleft()
            admitted.append(_Group(request))
            used += request.n
        if not admitted:
            return
        prompts = [list(g.request.prompt_ids) for g in admitted]
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        width = int(lengths.max())
        padded = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            padded[row, :len(prompt)] = torch.tensor(prompt)
        repeats = torch.tensor([g.request.n for g in admitted], device=self.device)
        logits = self.decoder.prefill(padded.to(self.device), lengths, self._active, repeats)
        slot = self._active
        for g in admitted:
            for sample in range(g.request.n):
                self._owner[slot] = (g, sample)
                slot += 1
        start, self._active = self._active, used
        rows = torch.arange(start, used, device=self.device)
        self._positions[rows] = lengths.repeat_interleave(repeats)
        self._generated[rows] = 0
        self._limits[rows] = torch.tensor([g.request.params.max_new_tokens for g in admitted],
                                          device=self.device).repeat_interleave(repeats)
        self._sample(rows, logits.repeat_interleave(repeats, dim=0), finished)

    @torch.inference_mode()
    def _decode(self, finished: list[FinishedGroup]) -> None:
        active = self._active
        if self._queue:
            self.occupancy.steps += 1
            self.occupancy.sequences += active
        logits = self.decoder.decode(self._tokens[:active], self._positions[:active], active)
        self._positions[:active] += 1
        self._sample(torch.arange(active, device=self.device), logits, finished)

    def _sample(self, rows: torch.Tensor, logits: torch.Tensor,
                finished: list[FinishedGroup]) -> None:
        """Draw a token for each of ``rows`` (slots) from their logits, record it, and retire
        the sequences it ends."""
        owners = [self._owner[r] for r in rows.tolist()]
        tokens = torch.empty(len(owners), dtype=torch.long, device=self.device)
        logprobs = torch.empty(len(owners), dtype=torch.float32, device=self.device)
        for params, members in _by_params(owners).items():
            index = torch.tensor(members, device=self.device)
            drawn, logprob = sample_next(logits[index], params, self._generator)
            tokens[index], logprobs[index] = drawn, logprob.float()
        steps = self._generated[rows]
        cpu_rows, cpu_steps = rows.cpu(), steps.cpu()
        self._out_tokens[cpu_rows, cpu_steps] = tokens.to(torch.int32).cpu()
        self._out_logprobs[cpu_rows, cpu_steps] = logprobs.cpu()
        self._out_versions[cpu_rows, cpu_steps] = self.version
        self._tokens[rows] = tokens
        self._generated[rows] = steps + 1
        stopped = torch.isin(tokens, self._eos)
        ending = (stopped | (steps + 1 >= self._limits[rows])).nonzero().squeeze(-1)
        if len(ending):
            self._retire(rows[ending].tolist(), stopped[ending].tolist(), finished)

    def _retire(self, slots: list[int], stopped: list[bool],
                finished: list[FinishedGroup]) -> None:
        """Hand finished sequences to their groups, then refill the holes from the end."""
        for slot, eos in zip(slots, stopped, strict=True):
            group, sample = self._owner[slot]
            length = int(self._generated[slot])
            group.done[sample] = Completion(
                token_ids=self._out_tokens[slot, :length].clone(),
                logprobs=self._out_logprobs[slot, :length].clone(),
                versions=self._out_versions[slot, :length].clone(),
                finish_reason="stop" if eos else "length")
            if len(group.done) == group.request.n:
                finished.append(FinishedGroup(group.request.key,
                                              [group.done[i] for i in range(group.request.n)]))
            self._owner[slot] = None
        self._compact()

    def _compact(self) -> None:
        """Move the sequences above the new ``active`` count into the holes below it."""
        live = [s for s in range(self._active) if self._owner[s] is not None]
        self._active = len(live)
        holes = [s for s in range(self._active) if self._owner[s] is None]
        sources = [s for s in live if s >= self._active]
        if not sources:
            return
        for hole, source in zip(holes, sources, strict=True):
            self._owner[hole], self._owner[source] = self._owner[source], None
        src = torch.tensor(sources, device=self.device)
        dst = torch.tensor(holes, device=self.device)
        self.decoder.copy_slots(src, dst, int(self._positions[src].max()))
        for state in (self._positions, self._tokens, self._generated, self._limits):
            state[dst] = state[src]
        cpu_src, cpu_dst = src.cpu(), dst.cpu()
        for out in (self._out_tokens, self._out_logprobs, self._out_versions):
            out[cpu_dst] = out[cpu_src]


def _by_params(owners: list[tuple[_Group, int]]) -> dict[SamplingParams, list[int]]:
    """Row indices grouped by their group's sampling parameters (usually one setting)."""
    groups: dict[SamplingParams, list[int]] = {}
    for row, (group, _) in enumerate(owners):
        groups.setdefault(group.request.params, []).append(row)
    return groups
