"""The interface every inference engine implements, and what it returns.

An engine turns token-id prompts into completions with, per generated token, its
behavior log-prob (``relay.generators.sampling``) and the weight version that produced it. It
loads new weight versions whole (a version is applied completely or not at all). Engines
know models and tokens; they know nothing of sockets, leases or rewards.

Engines serve two ways. ``generate`` takes a batch and returns when every completion is
done. ``submit`` / ``step`` is continuous batching: a caller submits groups (a prompt and
its ``n`` samples) whenever it has them, and each ``step`` advances the work in flight and
returns the groups that finished. The base class runs ``submit`` / ``step`` on top of
``generate`` (one ``step`` generates everything submitted since the last); the lean engine
(``relay.generators.lean_engine``) admits new groups into free sequence slots between decode steps.

``ModelEngine`` is the shared base of the engines that run a transformers model in this
process (``torch``, ``hf``): loading, padding, weight updates, cutting at eos.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence

import msgspec
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from relay.generators.sampling import SamplingParams

StepHook = Callable[[], None]
"""Called between decode steps: the safe point to apply staged weights."""


class Completion(msgspec.Struct, kw_only=True):
    """One generated response (R tokens; the eos token included when it stopped)."""

    token_ids: torch.Tensor  # (R,) int32
    logprobs: torch.Tensor  # (R,) float32, behavior log-probs
    versions: torch.Tensor  # (R,) int32, weight version per token
    finish_reason: str  # "stop" (eos) or "length"


class GroupRequest(msgspec.Struct, frozen=True):
    """``n`` samples of one prompt, under ``key`` (the caller's name for it)."""

    key: object
    prompt_ids: Sequence[int]
    n: int
    params: SamplingParams


class FinishedGroup(msgspec.Struct, frozen=True):
    """The ``n`` completions of a submitted group, in sample order."""

    key: object
    completions: list[Completion]


class WeightMismatch(ValueError):
    """A weight version does not fit the engine's model (names or shapes)."""


def copy_device(device: torch.device) -> torch.device | None:
    """``Engine.staging_device`` of an engine whose weights are on ``device``: a CUDA
    device itself; on the CPU None, as a second copy there would be host memory that
    stays, where a whole host version is freed once loaded."""
    return device if device.type == "cuda" else None


def check_weights(shapes: Mapping[str, torch.Size], tensors: Mapping[str, torch.Tensor]) -> None:
    """Raise ``WeightMismatch`` unless ``tensors`` has exactly the names of ``shapes``, each
    with its shape."""
    missing = sorted(set(shapes) - set(tensors))
    extra = sorted(set(tensors) - set(shapes))
    if missing or extra:
        raise WeightMismatch(f"weight names differ: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, shape in shapes.items():
        if tensors[name].shape != shape:
            raise WeightMismatch(f"{name}: shape {tuple(tensors[name].shape)}, "
                                 f"the model has {tuple(shape)}")


def check_request(request: GroupRequest) -> None:
    """Raise ``ValueError`` for a group with no samples or an empty prompt."""
    if request.n < 1 or not request.prompt_ids:
        raise ValueError(f"group {request.key!r}: needs n >= 1 and a non-empty prompt")


class Engine(abc.ABC):
    """Generates completions; holds one weight version at a time."""

    name: str = "engine"

    def __init__(self) -> None:
        self.version = 0
        self._submitted: list[GroupRequest] = []

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 between_steps: StepHook | None = None) -> list[Completion]:
        """One completion per prompt (repeat a prompt to sample it several times)."""

    @abc.abstractmethod
    def reseed(self, seed: int) -> None:
        """Restart the sampling random stream at ``seed``: what is sampled next depends on
        the seed and the requests alone, not on what was sampled before."""

    @abc.abstractmethod
    def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Replace every weight with ``tensors`` (all names, right shapes) and take ``version``.

        Raises ``WeightMismatch`` and changes nothing when the set does not fit.
        """

    @property
    def staging_device(self) -> torch.device | None:
        """Where the weight receiver assembles this engine's next version: a second copy of
        the weights on that device, which ``load_weights`` gets at a safe point
        (``relay.generators.weight_receiver``); None: whole versions in host memory. None here;
        an engine whose weights are on a device of this process says ``copy_device``."""
        return None

    # -- continuous batching ------------------------------------------------------------

    def submit(self, request: GroupRequest) -> None:
        """Queue a group; a later ``step`` generates it."""
        check_request(request)
        self._submitted.append(request)

    @property
    def in_flight(self) -> int:
        """Sequences submitted and not yet returned by ``step``."""
        return sum(r.n for r in self._submitted)

    def step(self, between_steps: StepHook | None = None) -> list[FinishedGroup]:
        """Advance the work in flight; the groups that finished. Here: generate every
        group submitted so far in one ``generate`` call per sampling setting."""
        submitted, self._submitted = self._submitted, []
        finished = []
        for params in dict.fromkeys(r.params for r in submitted):
            requests = [r for r in submitted if r.params == params]
            completions = self.generate([list(r.prompt_ids) for r in requests for _ in range(r.n)],
                                        params, between_steps)
            start = 0
            for r in requests:
                finished.append(FinishedGroup(r.key, completions[start:start + r.n]))
                start += r.n
        return finished


class ModelEngine(Engine):
    """An engine around a transformers causal LM held in this process."""

    def __init__(self, model: PreTrainedModel, *, eos_ids: Sequence[int], pad_id: int,
                 seed: int = 0) -> None:
        super().__init__()
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.eos_ids = frozenset(eos_ids)
        self.pad_id = pad_id
        self.seed = seed
        self._shapes = {n: p.shape for n, p in self.model.named_parameters()}

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: torch.dtype, device: str = "cpu",
                        eos_ids: Sequence[int], pad_id: int, seed: int = 0,
                        trust_remote_code: bool = False) -> ModelEngine:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                     trust_remote_code=trust_remote_code)
        return cls(model.to(device), eos_ids=eos_ids, pad_id=pad_id, seed=seed)

    @torch.no_grad()
    def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        check_weights(self._shapes, tensors)
        for name, param in self.model.named_parameters():
            param.copy_(tensors[name])
        self.version = version

    @property
    def staging_device(self) -> torch.device | None:
        return copy_device(self.device)

    def left_pad(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids and attention_mask (B, P) on the engine's device, prompts right-aligned."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        width = max(len(p) for p in prompts)
        input_ids = [[self.pad_id] * (width - len(p)) + list(p) for p in prompts]
        attention = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
        return (torch.tensor(input_ids, dtype=torch.long, device=self.device),
                torch.tensor(attention, dtype=torch.long, device=self.device))

    def cut_at_eos(self, tokens: torch.Tensor, logprobs: torch.Tensor,
                   versions: torch.Tensor) -> list[Completion]:
        """Completions from (B, S) step outputs, each cut just after its first eos token;
        the outputs come to the host in one transfer (token ids and versions are exact in
        float64)."""
        host = torch.stack((tokens.double(), logprobs.double(), versions.double())).cpu()
        tokens, logprobs, versions = host[0].long(), host[1].float(), host[2].int()
        is_eos = torch.isin(tokens, torch.tensor(sorted(self.eos_ids), dtype=torch.long,
                                                 device="cpu"))
        out = []
        for row in range(tokens.shape[0]):
            stops = is_eos[row].nonzero()
            length = int(stops[0]) + 1 if len(stops) else tokens.shape[1]
            out.append(Completion(token_ids=tokens[row, :length].to(torch.int32),
                                  logprobs=logprobs[row, :length].clone(),
                                  versions=versions[row, :length].to(torch.int32),
                                  finish_reason="stop" if len(stops) else "length"))
        return out
