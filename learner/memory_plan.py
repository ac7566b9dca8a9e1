"""What one learner rank holds on its GPU, planned from the model's config alone.

Parameters are counted exactly, tensor by tensor, on the model built on the ``meta`` device
(``count_parameters``: no weights read, no memory taken); the rest follows from the run's
knobs by the formula in each function's docstring. The plan is one rank's (every rank holds
the same on its GPU; rank 0's publish buffers are host memory) for the GPU recipe: FSDP2
over fp32 master weights computing in ``model.dtype`` (``relay.learner.model``), attention that
keeps no (tokens x tokens) scores (flash / varlen), log-probs through the LM head a chunk of
positions at a time (``relay.algorithms.logprobs.head_logprobs``). What sits on the CPU
(offloaded shards and states) is not counted.

A rank holds the ``HELD`` items throughout and, on top, the items of one phase at a time:
the phases (an update pass, a log-prob pass, an optimizer step, a publish...) never overlap,
so the peak is ``HELD`` plus the largest phase. tests/learner/test_memory_plan.py checks the
formulas on the CPU against autograd's saved tensors, a rank's real shards, gradients and
AdamW states at 8 ranks, and torch's ``MemTracker`` over a real FSDP2 pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import msgspec
import torch
from transformers import AutoModel, AutoModelForCausalLM, PretrainedConfig

from relay.algorithms.logprobs import LOGITS_CHUNK_BYTES
from relay.configs.run_schema import RunConfig
from relay.learner.critic import ValueModel
from relay.learner.logprob_head import linear_head
from relay.learner.model import block_classes
from relay.learner.weight_buckets import DEVICE_AHEAD

GIB = 1 << 30
FP32 = 4
ADAM_STATES = 2  # AdamW's exp_avg and exp_avg_sq, fp32, one element each per parameter element
GATHERED_BLOCKS = 2  # FSDP2 holds the block it runs and the one it prefetches
# the step's batch, on every rank whole, per (row, position): input ids, attention mask and
# versions (int64), response mask and behavior log-probs (fp32): relay.learner.batch.TrainBatch;
# and the step's fp32 grids (advantages, proximal and reference log-probs, returns)
BATCH_BYTES_PER_POSITION = 3 * 8 + 2 * 4 + 4 * 4
# fp32 copies and gradients per (position, vocabulary entry) when log-probs and entropies
# are taken from whole logits (unchunked_logits_bytes)
UNCHUNKED_BYTES_PER_LOGIT = 32
# head_logprobs holds about four chunk-sized tensors in its forward, three in its backward
# (relay.algorithms.logprobs.LOGITS_CHUNK_BYTES)
HEAD_CHUNKS_IN_FLIGHT = 4
# An allowance, not a measurement: the CUDA context (~0.5 GiB with torch on an H100) and
# NCCL's buffers for the learner's communicators; neither is a tensor torch counts.
CUDA_RUNTIME_BYTES = 3 * GIB // 2

BLOCK_FORMULA_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # saved_bytes_per_token's
LEARNER_ADVICE = ("model.enable_gradient_checkpointing, a smaller actor.ppo_max_token_len_per_gpu "
                  "(or ppo_micro_batch_size_per_gpu), actor.fsdp_config.param_offload or "
                  "more learner ranks lower it")

HELD = "held"
LOGPROB = "log-prob pass"  # a forward without gradients: proximal or reference log-probs
PUBLISH = "publish"


class MemoryItem(msgspec.Struct, frozen=True, kw_only=True):
    """Bytes one GPU holds for one purpose, in the phases it is held (``HELD``: always)."""

    name: str
    bytes: int
    phases: tuple[str, ...] = (HELD,)
    formula: str = ""  # how ``bytes`` was computed, for a person


class MemoryPlan(msgspec.Struct, frozen=True, kw_only=True):
    """One GPU of one process: its items, notes on what the plan assumed, and what would
    stop the process however much memory is free (a KV cache too small for one sequence)."""

    process: str
    items: list[MemoryItem]
    notes: list[str] = msgspec.field(default_factory=list)
    problems: list[str] = msgspec.field(default_factory=list)
    advice: str = ""  # the settings that lower the peak

    def phase_bytes(self) -> dict[str, int]:
        """Bytes of each phase on top of ``HELD`` (and ``HELD``'s own), in first-seen order."""
        totals: dict[str, int] = {HELD: 0}
        for item in self.items:
            for phase in item.phases:
                totals[phase] = totals.get(phase, 0) + item.bytes
        return totals

    @property
    def peak_phase(self) -> str:
        """The phase whose bytes, with ``HELD``'s, are the peak (``HELD`` if it has none)."""
        phases = {p: b for p, b in self.phase_bytes().items() if p != HELD}
        return max(phases, key=phases.__getitem__) if phases else HELD

    @property
    def peak(self) -> int:
        """``HELD`` plus the largest phase: the most the GPU holds at once."""
        totals = self.phase_bytes()
        return totals[HELD] + (totals[self.peak_phase] if self.peak_phase != HELD else 0)


class BlockShape(msgspec.Struct, frozen=True, kw_only=True):
    """The sizes of a decoder (Llama / Qwen2 / Qwen3 / Mistral family) that its activations
    depend on."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    model_type: str

    @property
    def qk_norm(self) -> bool:
        """Qwen3's RMSNorm of every query and key head."""
        return self.model_type == "qwen3"

    @classmethod
    def of(cls, config: PretrainedConfig) -> BlockShape:
        heads = config.num_attention_heads
        return cls(layers=config.num_hidden_layers, hidden=config.hidden_size,
                   intermediate=config.intermediate_size, heads=heads,
                   kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   vocab=config.vocab_size, model_type=config.model_type)


class ModelSize(msgspec.Struct, frozen=True, kw_only=True):
    """A model's parameters as FSDP2 shards and gathers them (``count_parameters``)."""

    rows: tuple[tuple[int, int], ...]  # each parameter: (dim-0 length, elements per dim-0 row)
    block: int  # elements of the largest transformer block (FSDP2 gathers one at a time)
    root: int  # elements outside the blocks (embeddings, final norm, head): the root's unit
    head: int  # elements of the output head (LM head or value head)
    # how the head's outputs are computed: "chunked" log-probs (relay.learner.logprob_head's linear
    # heads), the model's own "logits" at every position, or a critic's scalar "value"
    head_kind: Literal["chunked", "logits", "value"]
    shape: BlockShape

    @property
    def numel(self) -> int:
        return sum(length * per_row for length, per_row in self.rows)

    @property
    def tensors(self) -> int:
        return len(self.rows)

    @property
    def largest(self) -> int:
        """Elements of the largest parameter."""
        return max(length * per_row for length, per_row in self.rows)

    def shard_numel(self, shards: int) -> int:
        """Elements one rank holds when FSDP2 shards over ``shards`` ranks: each parameter
        cut along dim 0 into pieces of ``ceil(length / shards)`` rows, which FSDP2 allocates
        whole on every rank (the last ones padded)."""
        return sum(math.ceil(length / shards) * per_row for length, per_row in self.rows)


def count_parameters(config: PretrainedConfig, *, value_head: bool = False,
                     trust_remote_code: bool = False) -> ModelSize:
    """The parameters of the causal LM ``config`` describes (or, with ``value_head``, of the
    critic built on its body: ``relay.learner.critic.ValueModel``), counted on a model built on
    the ``meta`` device; tied parameters count once, as FSDP2 shards them once."""
    with torch.device("meta"):
        if value_head:
            body = AutoModel.from_config(config, trust_remote_code=trust_remote_code)
            model, blocks_of = ValueModel(body, config.hidden_size), body
            head, kind = model.value_head, "value"
        else:
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
            blocks_of, head = model, model.get_output_embeddings()
            kind = "chunked" if linear_head(model) else "logits"
    blocks = [m for m in model.modules() if isinstance(m, block_classes(blocks_of))]
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    params = list(model.parameters())
    return ModelSize(
        rows=tuple((p.shape[0], p[0].numel()) if p.dim() else (1, 1) for p in params),
        block=max(sum(p.numel() for p in block.parameters()) for block in blocks),
        root=sum(p.numel() for p in params if id(p) not in in_blocks),
        head=sum(p.numel() for p in head.parameters()),
        head_kind=kind,
        shape=BlockShape.of(config))


def saved_bytes_per_token(shape: BlockShape, compute_bytes: int) -> int:
    """Bytes one token leaves saved for the backward in one decoder block, counted tensor by
    tensor from transformers' Llama / Qwen2 / Qwen3 code the way Korthikanti et al. count
    GPT's ("Reducing Activation Recomputation in Large Transformer Models", 2022, sec. 4.1).
    With c the compute dtype's bytes, h hidden, i intermediate, q = heads x head_dim,
    k = kv heads x head_dim, a heads and g kv heads:

        2 RMSNorms   2 (4h + 4 + 2ch)       fp32 copy of the input, 1/rms (fp32), the
                                            normalised value before the weight, the output
        attention    c (2q + 2k) + 4a       q and k after rotary, v, the output; the fp32
                                            log-sum-exp of each head (flash-style kernels)
        Qwen3        (4 + c)(q + k) + 4(a + g)   its RMSNorm of every query and key head
        MLP          4ci                    gate, silu(gate), up, their product

    Kernels that keep the (tokens x tokens) scores (eager attention, SDPA's math kernel)
    would add 2 a T c per token; Relay's GPU path does not run them."""
    h, i, c = shape.hidden, shape.intermediate, compute_bytes
    q, k = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    norms = 2 * (FP32 * h + FP32 + 2 * c * h)
    attention = c * (2 * q + 2 * k) + FP32 * shape.heads
    if shape.qk_norm:
        attention += (FP32 + c) * (q + k) + FP32 * (shape.heads + shape.kv_heads)
    return norms + attention + 4 * c * i


def surrounding_bytes_per_token(shape: BlockShape, compute_bytes: int) -> int:
    """Bytes a token keeps outside the blocks: the final RMSNorm (4h + 4 + ch), the hidden
    state the head reads (ch), the rotary cos and sin (2 c head_dim) and the token's id and
    position (int64, 16)."""
    h, c = shape.hidden, compute_bytes
    return FP32 * h + FP32 + 2 * c * h + 2 * c * shape.head_dim + 16


def backward_working_bytes_per_token(shape: BlockShape, compute_bytes: int) -> int:
    """Gradients a token has in flight while one block runs its backward: 3ci + ch (the
    MLP's gradients of its product, gate and up at once, and the gradient arriving at the
    block), as FSDPMemTracker measures a Qwen2 block's backward on the CPU (its temporary
    memory grows by 3ci + ch per token)."""
    return 3 * compute_bytes * shape.intermediate + compute_bytes * shape.hidden


def forward_working_bytes_per_token(shape: BlockShape, compute_bytes: int) -> int:
    """A token's bytes in flight in a block's forward without gradients: c (3i + 2h) (the
    MLP's up and silu(gate) and their product; the residual and the normalised input)."""
    return compute_bytes * (3 * shape.intermediate + 2 * shape.hidden)


def activation_bytes(shape: BlockShape, tokens: int, compute_bytes: int,
                     checkpointing: bool) -> int:
    """Activations of a forward and backward over ``tokens`` tokens on one rank, at the
    backward's start, when they peak (s, o, w: the three functions above, per token):

        without gradient checkpointing   T (L s + o + w)
        with it                          T (L c h + s + o + w)

    With checkpointing each block keeps only its input (transformers' checkpointing of
    every block, non-reentrant) and its activations exist again only while its backward
    runs, one block at a time."""
    per_block = saved_bytes_per_token(shape, compute_bytes)
    kept = shape.layers * (compute_bytes * shape.hidden if checkpointing else per_block)
    if checkpointing:
        kept += per_block
    return tokens * (kept + surrounding_bytes_per_token(shape, compute_bytes)
                     + backward_working_bytes_per_token(shape, compute_bytes))


def unchunked_logits_bytes(shape: BlockShape, positions: int, compute_bytes: int) -> int:
    """(positions x vocabulary) logits taken whole through ``token_logprobs`` and
    ``entropy_from_logits``: P V (c + 32), the logits in the compute dtype and, per entry,
    32 bytes of fp32 copies and gradients at the backward's peak (three fp32 tensors autograd
    keeps, and the backward's gradients), as torch's ``MemTracker`` measures them in bf16
    on the CPU."""
    return positions * shape.vocab * (compute_bytes + UNCHUNKED_BYTES_PER_LOGIT)


def chunk_positions(vocab: int, positions: int) -> int:
    """Positions of one chunk of ``head_logprobs``: LOGITS_CHUNK_BYTES of fp32 logits
    (``LOGITS_CHUNK_BYTES // (4 V)``, at least one), or all of them when fewer."""
    return min(positions, max(1, LOGITS_CHUNK_BYTES // (FP32 * vocab)))


def head_bytes(size: ModelSize, positions: int, compute_bytes: int, backward: bool) -> int:
    """The head's outputs over ``positions`` positions. ``chunked`` log-probs
    (``relay.algorithms.logprobs.head_logprobs``): at most ``HEAD_CHUNKS_IN_FLIGHT`` chunks of fp32
    logits (``chunk_positions`` x V x 4) at once, and in the backward the head weight's
    gradient, summed in fp32 then cast to the compute dtype (head x (4 + c)), and the hidden
    states' (P h c). ``logits``: ``unchunked_logits_bytes``. ``value``: P x 4."""
    if size.head_kind == "value":
        return positions * FP32
    if size.head_kind == "logits":
        return unchunked_logits_bytes(size.shape, positions, compute_bytes)
    chunks = HEAD_CHUNKS_IN_FLIGHT * chunk_positions(size.shape.vocab, positions) \
        * size.shape.vocab * FP32
    if not backward:
        return chunks
    return chunks + size.head * (FP32 + compute_bytes) \
        + positions * size.shape.hidden * compute_bytes


def pass_tokens(*, use_dynamic_bsz: bool, max_token_len: int, micro_batch_size: int,
                row_length: int, sp: int) -> int:
    """Tokens one rank's forward holds at most (``relay.learner.micro_batches``): with
    ``use_dynamic_bsz`` the budget per GPU, or one longest row spread over the SP group when
    that is more (a longer row gets a pass of its own); otherwise ``micro_batch_size``
    longest rows spread over the SP group. With ``actor.share_prompts`` a pass holds fewer
    (each group's prompt once): the bound stays."""
    if use_dynamic_bsz:
        return max(max_token_len, math.ceil(row_length / sp))
    return math.ceil(micro_batch_size * row_length / sp)


def shard_count(fsdp_size: int, ranks: int, key: str) -> int:
    """Ranks a model is sharded over: every rank for -1, else ``fsdp_size`` (HSDP), which
    must divide ``ranks``; ValueError naming ``key``."""
    if fsdp_size in (-1, ranks):
        return ranks
    if fsdp_size < 1 or ranks % fsdp_size:
        raise ValueError(f"{key} = {fsdp_size}: must be -1 (shard over every rank) or divide "
                         f"the learner's {ranks} ranks")
    return fsdp_size


def update_phases(label: str) -> tuple[str, str, str]:
    """A trained model's phases: its update pass (forward and backward) at the backward's
    start, when the activations are whole; at the backward's end, when the root's gradients
    are reduce-scattered; and its optimizer step."""
    return f"{label} pass", f"{label} pass end", f"{label} step"


class LearnerModels(msgspec.Struct, frozen=True, kw_only=True):
    """The models a run's learner holds, counted (``count_parameters``): the policy (and its
    reference), the critic with ``gae``, PRIME's PRM with ``prime``; with LoRA
    (``model.lora_rank`` > 0) the policy's adapters (``count_adapters``: (dim-0 length,
    elements per row) of each), the only parameters it trains."""

    policy: ModelSize
    critic: ModelSize | None = None
    prm: ModelSize | None = None
    adapters: tuple[tuple[int, int], ...] = ()


def count_adapters(config: PretrainedConfig, run: RunConfig) -> tuple[tuple[int, int], ...]:
    """The LoRA adapters ``relay.learner.lora.wrap`` gives the policy ``config`` describes
    (``model.lora_rank`` and its siblings), counted on the ``meta`` device."""
    from relay.learner.lora import wrap  # peft: the lora extra
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, trust_remote_code=run.model.trust_remote_code)
        wrapped = wrap(model, run.model, load_adapter=False)
    return tuple((p.shape[0], p[0].numel()) for p in wrapped.parameters() if p.requires_grad)


def count_learner_models(run: RunConfig,
                         config_of: Callable[[str], PretrainedConfig]) -> LearnerModels:
    """``LearnerModels`` of ``run``, each model's config read by ``config_of(path)``."""
    trust = run.model.trust_remote_code
    critic = prm = None
    estimator = run.algorithm.estimator
    if estimator.critic:
        critic = count_parameters(config_of(run.critic.model.path or run.model.path),
                                  value_head=True, trust_remote_code=trust)
    if estimator.prm:
        prm = count_parameters(config_of(run.reward_model.model.path or run.model.path),
                               trust_remote_code=trust)
    policy_config = config_of(run.model.path)
    return LearnerModels(policy=count_parameters(policy_config, trust_remote_code=trust),
                         critic=critic, prm=prm,
                         adapters=count_adapters(policy_config, run)
                         if run.model.lora_rank > 0 else ())


def plan_learner(run: RunConfig, models: LearnerModels, ranks: int) -> MemoryPlan:
    """Each rank of a learner of ``ranks`` ranks running ``run`` (module docstring)."""
    actor, ref = run.actor, run.ref.resolve(run.actor)
    c = torch.empty((), dtype=getattr(torch, run.model.dtype)).element_size()
    row = run.data.max_prompt_length + run.rollout.response_length
    sp = actor.ulysses_sequence_parallel_size
    tokens = pass_tokens(use_dynamic_bsz=actor.use_dynamic_bsz,
                         max_token_len=actor.ppo_max_token_len_per_gpu,
                         micro_batch_size=actor.ppo_micro_batch_size_per_gpu,
                         row_length=row, sp=sp)
    shards = shard_count(actor.fsdp_config.fsdp_size, ranks, "actor.fsdp_config.fsdp_size")
    policy = models.policy
    rows = run.data.train_batch_size * run.rollout.n
    items = [
        MemoryItem(name="CUDA context and NCCL buffers", bytes=CUDA_RUNTIME_BYTES,
                   formula="an allowance"),
        MemoryItem(name="the step's batch", bytes=rows * row * BATCH_BYTES_PER_POSITION,
                   formula=f"{rows:,} rows x {row:,} positions x "
                           f"{BATCH_BYTES_PER_POSITION} B, on every rank"),
        *trained_items("policy", policy, shards=shards, compute_bytes=c, tokens=tokens,
                       checkpointing=run.model.enable_gradient_checkpointing,
                       offload_params=actor.fsdp_config.param_offload,
                       offload_optimizer=actor.fsdp_config.optimizer_offload,
                       adapters=models.adapters),
        *logprob_pass_items(policy, compute_bytes=c, tokens=pass_tokens(  # resolved: set
            use_dynamic_bsz=bool(ref.log_prob_use_dynamic_bsz),
            max_token_len=int(ref.log_prob_max_token_len_per_gpu),
            micro_batch_size=int(ref.log_prob_micro_batch_size_per_gpu),
            row_length=row, sp=sp)),
    ]
    prm_path = run.reward_model.model.path or run.model.path
    prm_shares_reference = (models.prm is not None and prm_path == run.model.path
                            and not models.adapters)  # a LoRA policy is its own reference
    if not models.adapters and (run.actor.use_kl_loss or run.algorithm.use_kl_in_reward
                                or prm_shares_reference):
        items.append(frozen_item("reference", policy, compute_bytes=c,
                                 shards=shard_count(ref.fsdp_config.fsdp_size, ranks,
                                                    "ref.fsdp_config.fsdp_size"),
                                 offloaded=bool(ref.fsdp_config.param_offload)))
    if models.critic is not None:
        items += trained_items("critic", models.critic, compute_bytes=c, tokens=tokens,
                               shards=shard_count(run.critic.model.fsdp_config.fsdp_size, ranks,
                                                  "critic.model.fsdp_config.fsdp_size"),
                               checkpointing=run.model.enable_gradient_checkpointing)
    if models.prm is not None:
        items += trained_items("PRM", models.prm, shards=shards, compute_bytes=c,
                               tokens=tokens,
                               checkpointing=run.model.enable_gradient_checkpointing)
        if not prm_shares_reference:
            items.append(frozen_item("PRM reference", models.prm, shards=shards,
                                     compute_bytes=c, offloaded=False))
    items.append(publish_item(policy, run.rollout.update_weights_bucket_megabytes << 20, c))
    return MemoryPlan(process=f"learner (each of {ranks} ranks)", items=items,
                      notes=learner_notes(run, policy, tokens, sp, c), advice=LEARNER_ADVICE)


def trained_items(label: str, size: ModelSize, *, shards: int, compute_bytes: int,
                  tokens: int, checkpointing: bool, offload_params: bool = False,
                  offload_optimizer: bool = False,
                  adapters: tuple[tuple[int, int], ...] = ()) -> list[MemoryItem]:
    """A model that trains (``update_phases(label)``): fp32 master shards and AdamW's states
    held (on the CPU with ``offload_params``; the states also with ``offload_optimizer``,
    then brought to the GPU for the step), fp32 gradient shards from its update pass to its
    step; in the pass, its gathered parameters (``gathered_items``), a block's gradients in
    the compute dtype with their fp32 reduce-scatter input (block x (c + 4)), activations
    (``activation_bytes``) and the head (``head_bytes``); at the backward's end the root's
    gradients and their reduce-scatter input (root x (c + 4)); in the step, torch's foreach
    AdamW's temporary (the square roots of the second moments: shard x 4). With LoRA
    ``adapters``, the frozen base's shards stay (fp32), and the adapters' alone (their
    shard: ``trained``) have gradients, AdamW states and the temporary (the block gradients
    and the activations are still planned as full fine-tuning's: an upper bound)."""
    update, update_end, step = update_phases(label)
    c = compute_bytes
    base = ModelSize(rows=adapters, block=0, root=0, head=0, head_kind="chunked",
                     shape=size.shape) if adapters else size
    shard = base.shard_numel(shards)  # the trained elements of a rank
    held = size.shard_numel(shards) + (shard if adapters else 0)
    on_gpu = not offload_params
    weights = FP32 * shard if on_gpu else 0
    adam = ADAM_STATES * FP32 * shard + FP32 * base.tensors  # and an fp32 step count each
    where = "" if on_gpu else " (on the CPU: param_offload)"
    offloaded_adam = on_gpu and offload_optimizer
    items = [
        MemoryItem(name=f"{label} parameter shards (fp32)", bytes=FP32 * held if on_gpu else 0,
                   formula=f"{held:,} elements x 4 B{where}"
                           + (" (the frozen base and the LoRA adapters)" if adapters else "")),
        MemoryItem(name=f"{label} AdamW states (2 x fp32)",
                   bytes=adam if on_gpu and not offload_optimizer else 0,
                   formula=f"{shard:,} x 8 B + 4 B x {base.tensors} step counts"
                           + (" (on the CPU: optimizer_offload)" if offloaded_adam else where)),
        MemoryItem(name=f"{label} gradient shards (fp32)", bytes=weights,
                   phases=(update, update_end, step), formula=f"{shard:,} x 4 B{where}"),
        *gathered_items(label, size, compute_bytes=c, with_root=(update, update_end),
                        with_blocks=(update,)),
        MemoryItem(name=f"{label} block gradients in flight", bytes=size.block * (c + FP32),
                   phases=(update,), formula=f"{size.block:,} x ({c} + 4) B"),
        MemoryItem(name=f"{label} activations", phases=(update,),
                   bytes=activation_bytes(size.shape, tokens, c, checkpointing),
                   formula=f"{tokens:,} tokens, {size.shape.layers} layers"
                           + (", checkpointed" if checkpointing else "")),
        MemoryItem(name=f"{label} head ({size.head_kind})", phases=(update,),
                   bytes=head_bytes(size, tokens, c, backward=True),
                   formula=f"{tokens:,} positions"),
        MemoryItem(name=f"{label} root gradients reduced", bytes=size.root * (c + FP32),
                   phases=(update_end,), formula=f"{size.root:,} x ({c} + 4) B"),
    ]
    if on_gpu:
        if offload_optimizer:
            items.append(MemoryItem(name=f"{label} AdamW states, brought for the step",
                                    bytes=adam, phases=(step,),
                                    formula=f"{shard:,} x 8 B (optimizer_offload)"))
        items.append(MemoryItem(name=f"{label} AdamW foreach temporary", phases=(step,),
                                bytes=FP32 * shard, formula=f"{shard:,} x 4 B"))
    return items


def gathered_items(label: str, size: ModelSize, *, compute_bytes: int,
                   with_root: tuple[str, ...], with_blocks: tuple[str, ...]
                   ) -> list[MemoryItem]:
    """FSDP2's gathered parameters, in the compute dtype: the root's (embeddings, final
    norm, head) from a forward's start through its backward (the root does not reshard after
    its forward), and ``GATHERED_BLOCKS`` blocks (the one running and the one prefetched)."""
    c = compute_bytes
    return [MemoryItem(name=f"{label} gathered root", bytes=size.root * c, phases=with_root,
                       formula=f"{size.root:,} x {c} B"),
            MemoryItem(name=f"{label} gathered blocks", phases=with_blocks,
                       bytes=GATHERED_BLOCKS * size.block * c,
                       formula=f"{GATHERED_BLOCKS} x {size.block:,} x {c} B")]


def frozen_item(label: str, size: ModelSize, *, shards: int, compute_bytes: int,
                offloaded: bool) -> MemoryItem:
    """A frozen model's shards (the reference), in the compute dtype: it never steps; its
    passes are ``LOGPROB`` passes (``logprob_pass_items``)."""
    shard = size.shard_numel(shards)
    return MemoryItem(name=f"{label} parameter shards", bytes=shard * compute_bytes * (
        not offloaded), formula=f"{shard:,} x {compute_bytes} B"
                                + (" (on the CPU: param_offload)" if offloaded else ""))


def logprob_pass_items(size: ModelSize, *, compute_bytes: int, tokens: int) -> list[MemoryItem]:
    """A forward without gradients over ``tokens`` tokens (the proximal or the reference
    log-probs): the gathered parameters, one block's forward working set
    (``forward_working_bytes_per_token``) and the head's chunks."""
    return [*gathered_items("log-prob pass", size, compute_bytes=compute_bytes,
                            with_root=(LOGPROB,), with_blocks=(LOGPROB,)),
            MemoryItem(name="log-prob pass working set", phases=(LOGPROB,),
                       bytes=tokens * forward_working_bytes_per_token(size.shape, compute_bytes),
                       formula=f"{tokens:,} tokens"),
            MemoryItem(name=f"log-prob pass head ({size.head_kind})", phases=(LOGPROB,),
                       bytes=head_bytes(size, tokens, compute_bytes, backward=False),
                       formula=f"{tokens:,} positions")]


def publish_item(size: ModelSize, bucket_bytes: int, compute_bytes: int) -> MemoryItem:
    """A publish on CUDA (``relay.learner.weight_buckets``): every rank gathers each parameter whole
    in the compute dtype, ``DEVICE_AHEAD`` bucket ahead of the one whose rows go to the host,
    so the device holds the parameters of two buckets at most: 2 x bucket, and the whole
    parameters cut at their ends (two of the largest). The buckets themselves are pinned
    host memory."""
    buckets = DEVICE_AHEAD + 1
    largest = 2 * size.largest * compute_bytes
    return MemoryItem(name="publish gathers", bytes=buckets * bucket_bytes + largest,
                      phases=(PUBLISH,), formula=f"{buckets} x {bucket_bytes >> 20} MiB + 2 x "
                                                 f"{size.largest:,} x {compute_bytes} B")


def learner_notes(run: RunConfig, policy: ModelSize, tokens: int, sp: int,
                  compute_bytes: int) -> list[str]:
    """What a person reading the plan should know about its assumptions."""
    notes = [f"policy: {policy.numel:,} parameters; an update pass holds at most "
             f"{tokens:,} tokens a rank"
             + (f" (1/{sp} of a pass under Ulysses)" if sp > 1 else "")]
    if policy.head_kind == "chunked":
        whole = unchunked_logits_bytes(policy.shape, tokens, compute_bytes)
        notes.append(f"log-probs in chunks of {LOGITS_CHUNK_BYTES >> 20} MiB of fp32 logits; "
                     f"(positions x vocabulary) logits taken whole would hold "
                     f"{whole / GIB:.1f} GiB")
    if policy.shape.model_type not in BLOCK_FORMULA_FAMILIES:
        notes.append(f"activations use the formula of a {'/'.join(BLOCK_FORMULA_FAMILIES)} "
                     f"block; a {policy.shape.model_type} block may keep more or less")
    if not run.model.enable_gradient_checkpointing:
        notes.append("without model.enable_gradient_checkpointing every block keeps its "
                     "activations until the backward")
    return notes
