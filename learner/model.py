"""Loading the policy (and the frozen reference) and sharding them with FSDP2.

The recipe, in order (torchtitan's and verl's): rank 0 reads the checkpoint with the Auto
classes (fp32 master weights for a model that trains, the run's dtype for a frozen one),
every other rank builds the same model on the ``meta`` device, without storage or a read of
the weights; every rank ``fully_shard``s each transformer block (the classes the model
lists in ``_no_split_modules``), then the root, over ``sharding_mesh`` (all ranks, or
verl's ``fsdp_size``: HSDP), with a ``MixedPrecisionPolicy`` that computes in the run's
dtype (bf16: ~7x faster matmuls on AMX CPUs and on GPUs) and reduces gradients in fp32;
then rank 0 broadcasts each tensor and every rank keeps its own rows (``load_from_rank0``).
A host holds one full copy of the weights (rank 0's), not one per rank. One rank is still
FSDP2, so one code path serves every world size.

With ``compile_blocks`` (``actor.use_torch_compile``) the parts of each block that do not
attend (its norms and its MLP) run under ``torch.compile``, which fuses their elementwise
work (the RMSNorm's casts and scaling, SwiGLU's product) into a few kernels, forward and
backward; the attention stays eager, since the packed layouts index by data.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy,
                                    fully_shard)
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from relay.configs.run_schema import ModelConfig
from relay.learner.attention import ATTENTION, check_relay_attention
from relay.learner.batch import TrainBatch
from relay.learner.logprob_head import position_logprobs
from relay.learner.shared_prompts import pack, unsupported
from relay.learner.ulysses import SequenceParallel, gather_tokens, packed_inputs


def learner_device(setting: str, local_rank: int) -> torch.device:
    """``cpu``, ``cuda`` (one GPU per local rank) or ``auto`` (cuda when present)."""
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("topology learner.device = 'cuda' but torch sees no GPU")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def block_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The transformer block classes to shard one by one (HF's ``_no_split_modules``)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    classes = tuple({type(m) for m in model.modules() if type(m).__name__ in names})
    if not classes:
        raise ValueError(f"{type(model).__name__} lists no _no_split_modules; cannot find its "
                         "transformer blocks to shard")
    return classes


def sharding_mesh(device: torch.device, fsdp_size: int = -1,
                  key: str = "actor.fsdp_config.fsdp_size") -> DeviceMesh | None:
    """The ranks FSDP2 shards a model over, for verl's ``fsdp_size`` (``key`` names it in
    errors); None without a process group.

    -1 (or the world size W): one dimension, every rank holds 1/W of each parameter. k
    dividing W: HSDP, a (W / k) x k mesh ("replicate", "shard"): rank ``r * k + s`` holds
    shard s, 1/k of each parameter, the k ranks of replica r gather them for each block,
    and gradients are reduce-scattered within a replica then all-reduced across the W / k
    replicas (all-gathers stay within k ranks, say one host; each rank holds W / k times
    the weights, gradients and optimizer state of full sharding). Either way FSDP2
    averages gradients over all W ranks, so the update is the same, and Ulysses' ``dp x
    sp`` mesh (``relay.learner.ulysses``, verl's separate mesh too) composes with any of them: it
    only decides which rows and tokens a rank runs. ValueError naming ``key`` for a size
    that is neither."""
    if not dist.is_initialized():
        return None
    world = dist.get_world_size()
    if fsdp_size in (-1, world):
        return init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    if fsdp_size < 1 or world % fsdp_size:
        raise ValueError(f"{key} = {fsdp_size}: must be -1 (shard over every rank) or divide "
                         f"the learner's {world} ranks (topology learner: len(hosts) x "
                         "nproc_per_node)")
    return init_device_mesh(device.type, (world // fsdp_size, fsdp_size),
                            mesh_dim_names=("replicate", "shard"))


def load_sharded(path: str, *, compute_dtype: torch.dtype, device: torch.device,
                 trust_remote_code: bool = False, trainable: bool = True,
                 gradient_checkpointing: bool = False, offload: bool = False,
                 compile_blocks: bool = False, mesh: DeviceMesh | None = None,
                 lora: ModelConfig | None = None) -> nn.Module:
    """An HF causal LM from ``path``, attending with ``relay.learner.attention``, FSDP2-sharded
    over ``mesh`` (default: every rank, ``sharding_mesh``) and loaded from rank 0 (module
    docstring): fp32 master weights when ``trainable``, else frozen in ``compute_dtype`` (it
    never steps, and computes in that dtype anyway). ``gradient_checkpointing`` (trainable
    models only), ``offload`` (parameters on the CPU: ``shard``) and ``compile_blocks``
    (``compile_block_parts``) as ``model.enable_gradient_checkpointing``,
    ``actor.fsdp_config.param_offload`` and ``actor.use_torch_compile`` say. ``lora``
    (the policy's ``model`` keys, ``lora_rank`` > 0): peft LoRA adapters wrap the model
    before it is sharded (``relay.learner.lora.wrap``), so only they train."""
    options = dict(dtype=torch.float32 if trainable else compute_dtype,
                   attn_implementation=ATTENTION, trust_remote_code=trust_remote_code)

    def adapted(model: nn.Module, load_adapter: bool) -> nn.Module:
        if lora is None:
            return model
        from relay.learner.lora import wrap  # peft: the lora extra
        return wrap(model, lora, load_adapter=load_adapter)

    model, full_state = read_on_rank0(
        lambda: adapted(AutoModelForCausalLM.from_pretrained(path, **options), True),
        lambda: adapted(AutoModelForCausalLM.from_config(hf_config(path, trust_remote_code),
                                                         **options), False))
    model.config.use_cache = False
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    elif gradient_checkpointing:
        enable_activation_checkpointing(model)
    blocks = block_classes(model)
    shard(model, compute_dtype=compute_dtype, blocks=blocks, offload=offload,
          mesh=mesh if mesh is not None else sharding_mesh(device))
    load_from_rank0(model, full_state, device)
    if compile_blocks:
        compile_block_parts(model, blocks)
    return model


def hf_config(path: str, trust_remote_code: bool) -> PretrainedConfig:
    """The transformers config of the checkpoint at ``path`` (its config.json only)."""
    return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)


Model = TypeVar("Model", bound=nn.Module)


def read_on_rank0(read: Callable[[], Model], build: Callable[[], Model]
                  ) -> tuple[Model, dict[str, torch.Tensor]]:
    """On rank 0 (or without a process group): ``read()``, the model with the checkpoint's
    weights, and its full state dict (CPU tensors, kept alive until ``load_from_rank0``
    has sent them). On every other rank: ``build()`` on the ``meta`` device (the same
    modules, no storage, nothing read from disk but the config) and an empty state dict."""
    if dist.is_initialized() and dist.get_rank() != 0:
        with torch.device("meta"):
            return build(), {}
    model = read()
    return model, model.state_dict()


def load_from_rank0(model: nn.Module, full_state: dict[str, torch.Tensor],
                    device: torch.device) -> None:
    """Fill every rank's shards of ``model`` (after ``shard``) from rank 0's ``full_state``
    (``read_on_rank0``); a collective. Ranks other than 0 give their ``meta`` shards
    storage on ``device`` (``to_empty``), then ``set_model_state_dict`` sends each tensor
    from rank 0 and every rank keeps its own rows (a tied ``lm_head`` stays the embedding's
    parameter). Buffers outside the state dict (RoPE's ``inv_freq`` is not persistent) are
    broadcast whole from rank 0, which computed them. One rank's ``fully_shard`` already put
    the model on ``device``; without a process group it moves there."""
    if not dist.is_initialized():
        model.to(device)
        return
    if dist.get_world_size() == 1:
        return
    if dist.get_rank() != 0:
        model.to_empty(device=device)
    set_model_state_dict(model, full_state, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True))
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


def compile_block_parts(model: nn.Module, blocks: tuple[type[nn.Module], ...]) -> None:
    """``torch.compile`` (dynamic shapes: a batch's token count changes every step) each
    child of every ``blocks`` module that holds no attention module: in the Llama and Qwen
    families the two RMSNorms and the MLP. Measured on a 24M-parameter Qwen2, bf16, one
    rank, 2 CPU threads: a learner step 0.90 -> 0.80 s, after about 5 s of compiling in the
    first step (``tools/bench-learner.py``'s batch shape)."""
    for block in model.modules():
        if not isinstance(block, blocks):
            continue
        for child in block.children():
            if not any("Attention" in type(part).__name__ for part in child.modules()):
                child.compile(dynamic=True)


def enable_activation_checkpointing(model: nn.Module) -> None:
    """transformers' activation (gradient) checkpointing of every block, non-reentrant
    (``activation_checkpointing_enable``; its older name before transformers 5.x made it an
    alias)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def shard(model: nn.Module, *, compute_dtype: torch.dtype,
          blocks: tuple[type[nn.Module], ...], offload: bool = False,
          mesh: DeviceMesh | None = None) -> nn.Module:
    """``fully_shard`` each ``blocks`` module, then the root, over ``mesh`` (``sharding_mesh``;
    None: FSDP2's default, every rank), a no-op without a process group; ``offload`` keeps
    the shards on the CPU (FSDP2's ``CPUOffloadPolicy``)."""
    options: dict[str, object] = {
        "mp_policy": MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32),
        "mesh": mesh}
    if offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    if dist.is_initialized():
        for module in model.modules():
            if isinstance(module, blocks):
                fully_shard(module, **options)
        fully_shard(model, **options)
    return model


def back_to_shards(model: nn.Module) -> None:
    """Back to its shards, an FSDP2 model after forward passes with no backward. FSDP2 leaves
    the root module's parameters (embedding, final norm, head) gathered after a forward, for
    the backward that frees them; after no-grad passes none comes, so they stayed gathered:
    full copies on the GPU (beside the CPU shards under ``param_offload``) through the rest
    of the step, or to the next step for a frozen reference. The cost: the next forward
    gathers the root's parameters again. A model never sharded is left as it is."""
    if isinstance(model, FSDPModule):
        model.reshard()


def forward_logprobs(model: nn.Module, batch: TrainBatch, temperature: float,
                     with_entropy: bool, share_prompts: bool = False,
                     sp: SequenceParallel | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (B, L-1) of the batch's response tokens, and the entropy if
    asked: grid entry (b, j) is row b's token j + 1 under softmax(logits_j / temperature)
    where the response mask is 1, and 0 elsewhere (every loss and metric reads the grid
    under the response mask).

    Only the positions that predict a response token go through the LM head, chunk by
    chunk (``relay.learner.logprob_head``): never the prompts, never (tokens x vocabulary) logits
    whole. The rows go through the model padded; or, with ``sp``, packed and split across
    the SP group (``relay.learner.ulysses``); or, with ``share_prompts``, the rows of a group that
    share a prompt as one sequence (``relay.learner.shared_prompts``) when the model's family
    allows it. The response positions hold the same values every way. Both packed forwards
    need the model loaded to attend with ``relay.learner.attention`` (``load_sharded``).
    """
    if sp is not None:
        check_relay_attention(model)
        return _sequence_parallel_logprobs(model, batch, temperature, with_entropy, sp)
    if share_prompts and unsupported(model.config) is None:
        check_relay_attention(model)
        return _shared_prompt_logprobs(model, batch, temperature, with_entropy)
    rows, columns = batch.response_mask.nonzero(as_tuple=True)  # position j predicts j + 1
    inputs = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                  use_cache=False)
    logprobs, entropy = position_logprobs(model, inputs, rows * batch.input_ids.shape[1] + columns,
                                          batch.input_ids[rows, columns + 1], temperature,
                                          with_entropy)
    grid = batch.response_mask.shape
    return (_to_grid(logprobs, rows, columns, grid),
            None if entropy is None else _to_grid(entropy, rows, columns, grid))


def _to_grid(values: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor,
             shape: torch.Size) -> torch.Tensor:
    """(N,) values at grid entries (``rows``, ``columns``) -> ``shape``, 0 elsewhere
    (differentiable)."""
    return values.new_zeros(shape).index_put((rows, columns), values)


def _shared_prompt_logprobs(model: nn.Module, batch: TrainBatch, temperature: float,
                            with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``forward_logprobs`` with prompts shared: one packed sequence, the head at its
    ``predictors``."""
    packed = pack(batch)
    inputs = dict(input_ids=packed.input_ids, position_ids=packed.position_ids,
                  shared_prompt_rows=packed.rows, use_cache=False)
    logprobs, entropy = position_logprobs(model, inputs, packed.predictors,
                                          packed.labels(batch), temperature, with_entropy)
    grid = (batch.rows, batch.input_ids.shape[1] - 1)
    return (packed.to_grid(logprobs, grid),
            None if entropy is None else packed.to_grid(entropy, grid))


def _sequence_parallel_logprobs(model: nn.Module, batch: TrainBatch, temperature: float,
                                with_entropy: bool, sp: SequenceParallel
                                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``forward_logprobs`` under Ulysses: each SP rank computes the log-probs (and
    entropies) of its slice's positions that predict a response token, and the group
    gathers them (``relay.learner.ulysses``)."""
    packed, inputs = packed_inputs(batch, sp)
    total = packed.input_ids.shape[1]
    width = total // sp.size
    predicts = torch.zeros(total, dtype=torch.bool, device=packed.input_ids.device)
    predicts[packed.source[batch.response_mask.bool()]] = True
    local = predicts[sp.rank * width:(sp.rank + 1) * width].nonzero().squeeze(1)  # (n,)
    labels = packed.local(packed.labels, sp)[0, local]
    logprobs, entropy = position_logprobs(model, {**inputs, "use_cache": False}, local, labels,
                                          temperature, with_entropy)

    def to_grid(values: torch.Tensor) -> torch.Tensor:
        """(n,) values of this slice's positions -> (B, L - 1), the group's gathered."""
        per_token = values.new_zeros(width).index_copy(0, local, values)[None]  # (1, C)
        return packed.to_grid(gather_tokens(per_token, sp))

    return to_grid(logprobs), None if entropy is None else to_grid(entropy)
