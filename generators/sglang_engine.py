"""SGLang behind Relay's ``Engine`` interface: SGLang's offline engine (``sglang.Engine``).

``sglang.Engine`` runs SGLang's scheduler in its own processes; its ``generate`` is a
blocking batch call. The adapter hands it one batch per ``generate`` (SGLang batches the
sequences continuously inside the call) and keeps the base class's ``submit`` / ``step``,
which run on top of ``generate``: a group submitted during a call waits for the next one.

What Relay needs from each completion, and where it comes from:

- **token ids**: prompts go in as ids (``skip_tokenizer_init``: SGLang loads no tokenizer)
  and eos is given as ``stop_token_ids``; ``no_stop_trim`` keeps the eos token in the
  output, as in Relay's engines. The ids are read from the per-token log-prob entries,
  which list every sampled token whether or not SGLang trimmed the stop token from
  ``output_ids``;
- **behavior log-probs**: ``meta_info["output_token_logprobs"]`` holds each sampled token's
  log-prob under the temperature-scaled distribution, without top-k / top-p (SGLang's
  sampler takes the log of its probabilities after the temperature and before the filters),
  which is Relay's convention (``relay.generators.sampling``): top-p and top-k are passed through.
  SGLang's ``SGLANG_RETURN_ORIGINAL_LOGPROB`` moves them before the temperature, which is
  the learner's distribution only at temperature 1, so the adapter refuses that pairing
  (``request_params``). Greedy tokens get 0, as in Relay's engines;
- **per-token weight versions**: weights change only between calls (the caller applies
  staged weights before each ``step``), so every token of a call carries the version the
  engine held when the call began, as in ``relay.generators.hf_engine``.

Each sampled sequence is its own SGLang request (a group's prompt is repeated ``n`` times)
with its own ``sampling_seed``: SGLang honours that seed only when started with
``enable_deterministic_inference`` (pass it in ``engine_kwargs``); otherwise draws come from
SGLang's own stream, seeded once by ``random_seed`` at start, and ``reseed`` cannot restart it.

Weights are swapped with ``update_weights_from_tensor`` (Hugging Face names; SGLang's
``load_weights`` fuses q/k/v and gate/up itself), which also flushes SGLang's prefix cache,
so no cached prompt outlives the weights that computed it while the ``n`` copies of a prompt
in one call still share one prefill. On a GPU the version goes in chunks of
``WEIGHT_CHUNK_BYTES``, each copied to the generator's GPU first: SGLang's serializer hands
CUDA tensors to its scheduler processes as CUDA IPC handles (its tensor parallel workers
read them from there), where host tensors would be copied through /dev/shm; the prefix
cache is flushed with the last chunk. On the CPU the host tensors go in one call.
``update_weights_from_distributed`` (an NCCL group between a trainer's rank and SGLang's
workers, set up by ``init_weights_update_group``) is not used: versions reach the generator
over Relay's own wire.

SGLang's packaged builds need CUDA GPUs (the sglang 0.5.23 wheel pins torch 2.14.1 and the
CUDA libraries); its CPU backend is a source build for Intel AMX CPUs. Relay does not
install it: ``import_sglang`` says how.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from relay.configs.topology_schema import SGLangOptions
from relay.generators.engine import Completion, Engine, StepHook, check_weights
from relay.generators.hf_layout import hf_tensors, parameter_shapes
from relay.generators.sampling import SamplingParams
from relay.generators.weight_chunks import chunks_of

SEED_RANGE = 2**31
"""Some SGLang versions hold ``sampling_seed`` as int32."""

WEIGHT_CHUNK_BYTES = 1 << 29
"""Bytes of a version on the GPU per ``update_weights_from_tensor`` call (0.5 GiB beside
SGLang's share of the GPU, ``mem_fraction_static``)."""


class SGLangUnavailable(RuntimeError):
    """SGLang is not installed here."""


INSTALL_HINT = ("SGLang's packaged builds run on CUDA GPUs only: on a GPU machine `pip install "
                "sglang` into Relay's environment (it pins its own CUDA torch); its CPU backend "
                "is a source build for Intel AMX CPUs. On a CPU machine use engine \"lean\", "
                "\"torch\", \"hf\" or \"vllm\" for this process in the topology.")


def import_sglang() -> Any:
    """The ``sglang`` module; ``SGLangUnavailable`` saying where it can be installed."""
    try:
        import sglang
    except ImportError as error:
        raise SGLangUnavailable(f"engine \"sglang\" needs SGLang, which is not importable "
                                f"here ({error}). {INSTALL_HINT}") from None
    return sglang


def engine_arguments(path: str, *, dtype: str, device: str, seed: int, max_num_seqs: int,
                     max_len: int, trust_remote_code: bool, options: SGLangOptions) -> dict:
    """The keyword arguments of ``sglang.Engine`` (SGLang's ``ServerArgs``) for a Relay
    generator: the model, Relay's settings (dtype, seed, batch, context length) and the
    topology's engine options, with verl's names turned into SGLang's
    (``relay.configs.topology_schema.SGLangOptions``); a device ``cuda:<i>`` becomes device
    ``cuda`` and ``base_gpu_id`` i. ``options.engine_kwargs`` are passed through last."""
    kind, _, index = device.partition(":")
    args: dict[str, Any] = dict(
        model_path=path, skip_tokenizer_init=True, dtype=dtype, random_seed=seed,
        trust_remote_code=trust_remote_code, device=kind,
        max_running_requests=max_num_seqs, context_length=options.max_model_len or max_len,
        mem_fraction_static=options.gpu_memory_utilization,
        tp_size=options.tensor_model_parallel_size,
        disable_cuda_graph=options.enforce_eager,
        chunked_prefill_size=(options.max_num_batched_tokens
                              if options.enable_chunked_prefill else -1),
    )
    if index:
        args["base_gpu_id"] = int(index)
    return args | dict(options.engine_kwargs)


def request_params(params: SamplingParams, seed: int, eos_ids: Sequence[int]) -> dict:
    """SGLang's sampling parameters (a dict) for one sequence under Relay's ``params``:
    stop at any eos id and keep it, draw from ``sampling_seed`` ``seed``, top-p and top-k
    (-1: off) when sampling. Raises ``ValueError`` naming ``SGLANG_RETURN_ORIGINAL_LOGPROB``
    when it is set and the temperature is not 1 (module docstring)."""
    args = dict(max_new_tokens=params.max_new_tokens, temperature=params.temperature,
                stop_token_ids=list(eos_ids), no_stop_trim=True,
                sampling_seed=seed % SEED_RANGE)
    if params.greedy:
        return args
    if params.temperature != 1.0 and returns_original_logprobs():
        raise ValueError(
            f"engine \"sglang\" cannot sample at temperature {params.temperature:g} with "
            "SGLANG_RETURN_ORIGINAL_LOGPROB set: SGLang then reports log-probs before the "
            "temperature, while the learner scores log softmax(logits / temperature), so "
            "every importance weight would be off. Unset SGLANG_RETURN_ORIGINAL_LOGPROB in "
            "the generator's environment, or set rollout.temperature = 1.0")
    return args | dict(top_p=params.top_p, top_k=params.top_k if params.top_k > 0 else -1)


def returns_original_logprobs() -> bool:
    """Whether SGLang reports pre-temperature log-probs: its ``SGLANG_RETURN_ORIGINAL_LOGPROB``
    read as SGLang reads a boolean variable ("true" or "1", any case)."""
    return os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "false").lower() in ("true", "1")


def completion_of(output: Mapping[str, Any], greedy: bool, version: int) -> Completion:
    """Relay's ``Completion`` from one of SGLang's outputs (generated with
    ``return_logprob``: ``meta_info["output_token_logprobs"]`` holds one
    ``(logprob, token_id, text)`` per sampled token, the stop token included). Raises
    ``RuntimeError`` for an aborted request or outputs that disagree."""
    meta = output["meta_info"]
    entries = meta["output_token_logprobs"]
    token_ids = [int(entry[1]) for entry in entries]
    if list(output["output_ids"]) not in (token_ids, token_ids[:-1]):
        raise RuntimeError(f"SGLang's output ids {list(output['output_ids'])[:8]}... are not "
                           f"the sampled tokens of its log-probs {token_ids[:8]}...")
    reason = (meta.get("finish_reason") or {}).get("type")
    if reason not in ("stop", "length"):
        raise RuntimeError(f"SGLang ended a request with finish reason {meta.get('finish_reason')}")
    if greedy:
        logprobs = torch.zeros(len(token_ids), dtype=torch.float32)
    else:
        logprobs = torch.tensor([float(entry[0]) for entry in entries], dtype=torch.float32)
    return Completion(token_ids=torch.tensor(token_ids, dtype=torch.int32), logprobs=logprobs,
                      versions=torch.full((len(token_ids),), version, dtype=torch.int32),
                      finish_reason=reason)


class SGLangEngine(Engine):
    """Relay's engine interface over an ``sglang.Engine`` started by this process."""

    name = "sglang"

    def __init__(self, engine: Any, *, shapes: Mapping[str, torch.Size], tied_embeddings: bool,
                 eos_ids: Sequence[int], seed: int = 0, device: str = "cuda") -> None:
        super().__init__()
        self.engine = engine
        self.device = device
        self.eos_ids = sorted(eos_ids)
        self._shapes = dict(shapes)
        self._tied = tied_embeddings
        self.reseed(seed)

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: torch.dtype, device: str = "cuda",
                        eos_ids: Sequence[int], pad_id: int, seed: int = 0,
                        trust_remote_code: bool = False, max_num_seqs: int, max_len: int,
                        options: SGLangOptions | None = None) -> SGLangEngine:
        """Start SGLang on the model directory ``path``; ``SGLangUnavailable`` when SGLang is
        not installed."""
        del pad_id  # SGLang pads internally
        sglang = import_sglang()
        shapes, tied = parameter_shapes(path, trust_remote_code)
        engine = sglang.Engine(**engine_arguments(
            path, dtype=str(dtype).removeprefix("torch."), device=device, seed=seed,
            max_num_seqs=max_num_seqs, max_len=max_len, trust_remote_code=trust_remote_code,
            options=options or SGLangOptions()))
        return cls(engine, shapes=shapes, tied_embeddings=tied, eos_ids=eos_ids, seed=seed,
                   device=device)

    def reseed(self, seed: int) -> None:
        """Sequences after this draw from ``sampling_seed`` seed, seed + 1, ... in order
        (honoured only under SGLang's ``enable_deterministic_inference``)."""
        self._seeds = itertools.count(seed)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 between_steps: StepHook | None = None) -> list[Completion]:
        """One completion per prompt, from one blocking SGLang call; ``between_steps`` is
        not called (weights change only between calls)."""
        del between_steps
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if not prompts:
            return []
        sampling = [request_params(params, next(self._seeds), self.eos_ids) for _ in prompts]
        version = self.version
        outputs = self.engine.generate(input_ids=[list(p) for p in prompts],
                                       sampling_params=sampling, return_logprob=True)
        return [completion_of(output, params.greedy, version) for output in outputs]

    def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Load every weight through SGLang's ``update_weights_from_tensor`` (on a GPU as
        CUDA tensors, chunk by chunk: module docstring), flush its prefix cache and take
        ``version``; ``RuntimeError`` with SGLang's message when it fails."""
        check_weights(self._shapes, tensors)
        named = list(hf_tensors(tensors, self._tied))
        if self.device == "cpu":
            self._update(version, named, flush_cache=True)
        else:
            chunks = list(chunks_of(named, WEIGHT_CHUNK_BYTES))
            device = torch.device(self.device)
            for index, chunk in enumerate(chunks):
                on_device = [(name, tensor.to(device)) for name, tensor in chunk]
                self._update(version, on_device, flush_cache=index == len(chunks) - 1,
                             partial=index > 0)
                del on_device  # SGLang has loaded it: the next chunk may take its place
        self.version = version

    def _update(self, version: int, named: list[tuple[str, torch.Tensor]], *,
                flush_cache: bool, partial: bool = False) -> None:
        success, message = self.engine.update_weights_from_tensor(named_tensors=named,
                                                                  flush_cache=flush_cache)
        if not success:
            held = (" SGLang now holds part of it: restart this generator" if partial
                    else "")
            raise RuntimeError(f"SGLang did not load weight version {version}: "
                               f"{message}.{held}")
