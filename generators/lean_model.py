"""A lean decoder forward for the Llama, Qwen2 and Qwen3 families, over the lean KV cache.

Transformers' forward is built for every model and every feature; for a small model on a
CPU its per-call overhead costs far more than its arithmetic. ``LeanDecoder`` is the same
computation written as a handful of tensor ops per layer: fused QKV and gate-up matmuls,
``rms_norm``, rotary embeddings from a precomputed table, and attention over a
preallocated cache of ``slots`` rows (``relay.generators.kv_cache``: every row at full length,
or, when the memory does not hold that, a paged pool sized from the device's free memory).
It reads the Hugging Face checkpoint's own parameter names, so weights from the learner
load unchanged.

Per layer, with x the residual stream (pre-norm decoder, as in transformers):

    h = rms_norm(x) ;  q, k, v = h W_qkv (+ b_qkv)          [Qwen3: q, k = rms_norm per head]
    q, k = rope(q, pos), rope(k, pos) ;  cache[slot, pos] = k, v
    x = x + softmax(q K^T / sqrt(d) + causal mask) V W_o
    x = x + (silu(h' W_gate) * h' W_up) W_down,   h' = rms_norm(x)

and logits = rms_norm(x) W_lm. On the CPU two things make a bf16 decode step cheaper (a
24M-parameter Qwen2 at batch 64: 20.6 -> 15.9 ms): the matmul weights are also held
reordered for oneDNN (``torch.ops.mkldnn``'s prepacked linear: the same products, bit for
bit, 1.3-1.9x faster at decode's few rows, since ``F.linear`` reorders a bf16 weight on
every call; they cost a second copy of those weights), and the KV cache is fp32 (twice a
bf16 cache's memory), so that decode attention (scores, softmax and the weighted sum in
fp32) reads the cache without casting copies (1.8x faster there; a bf16 cache with bf16
products measured no faster). The learner's bf16 attention rounds its scores to bf16, as
transformers' eager attention does; at equal weights the learner's log-probs of a lean
engine's samples differ from their behaviour log-probs by 0.003 on average (24M Qwen2).

Supported: ``model_type`` llama, qwen2, qwen3 (and mistral without a sliding window),
``hidden_act`` silu, default rotary embeddings; anything else raises ``UnsupportedModel``
naming the setting, so the caller can choose another engine.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from relay.generators.kv_cache import (
    CacheShape,
    CachePlan,
    KVCache,
    PagedCache,
    SlotCache,
    budget_from_free_memory,
    plan_cache,
    workspace_bytes,
)

SUPPORTED_TYPES = ("llama", "qwen2", "qwen3", "mistral")


class UnsupportedModel(ValueError):
    """The checkpoint uses an architecture or setting the lean forward does not implement."""


@dataclass(frozen=True)
class CacheMemory:
    """How big the KV cache may be: ``positions`` (any device; paged when fewer than slots x
    max_len) or, on a GPU, ``gpu_memory_utilization`` of the memory free at start; on the
    CPU without ``positions``, every slot at full length. A prefill takes at most
    max(``max_num_batched_tokens``, max_len) padded prompt tokens (verl's names and
    defaults)."""

    positions: int | None = None
    gpu_memory_utilization: float = 0.5
    max_num_batched_tokens: int = 8192


def free_device_bytes(device: torch.device) -> int | None:
    """Free memory of a CUDA device (``torch.cuda.mem_get_info``); None elsewhere (the CPU
    has no such query)."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


class LeanDecoder:
    """Weights, rotary tables and KV cache of one decoder; no autograd, no modules."""

    def __init__(self, config: PretrainedConfig, *, slots: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu",
                 memory: CacheMemory | None = None) -> None:
        check_supported(config)
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        memory = memory or CacheMemory()
        free_bytes = free_device_bytes(self.device)  # before the weights take their share
        self.hidden = config.hidden_size
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden // self.heads
        self.layers = config.num_hidden_layers
        self.intermediate = config.intermediate_size
        self.eps = config.rms_norm_eps
        self.slots, self.max_len = slots, max_len
        self.qk_norm = config.model_type == "qwen3"
        self.qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias",
                                                                     False))
        self.mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self._views = self._allocate()
        self.prepacked = dtype == torch.bfloat16 and prepacking_available(self.device)
        self._packed: dict[int, torch.Tensor] = {}  # id(weight) -> its oneDNN-ordered copy
        self._pack_weights()
        self.cos, self.sin = rotary_tables(config, self.head_dim, max_len, self.device)
        self.cache_dtype = torch.float32 if self.device.type == "cpu" else dtype
        self.cache_plan = self._plan_cache(memory, free_bytes)
        shape = self.cache_shape()
        self.cache: KVCache = SlotCache(shape, self.cache_dtype, self.device) \
            if self.cache_plan.blocks is None else \
            PagedCache(shape, self.cache_plan.blocks, self.cache_dtype, self.device)

    # -- cache --------------------------------------------------------------------------

    def cache_shape(self) -> CacheShape:
        return CacheShape(layers=self.layers, kv_heads=self.kv_heads, heads=self.heads,
                          head_dim=self.head_dim, rows=self.slots, max_len=self.max_len)

    def _plan_cache(self, memory: CacheMemory, free_bytes: int | None) -> CachePlan:
        """Every slot at full length on the CPU, or ``memory.positions`` when given; on a
        GPU, what ``memory.gpu_memory_utilization`` of ``free_bytes`` leaves after the weights, the
        next version's copy of them and the workspace. A prefill takes at most
        max(max_num_batched_tokens, max_len) padded tokens on every device."""
        shape = self.cache_shape()
        prefill_tokens = max(memory.max_num_batched_tokens, self.max_len)
        if memory.positions is not None:
            budget = memory.positions * shape.bytes_per_position(self.cache_dtype)
        elif free_bytes is not None:
            workspace = workspace_bytes(shape, hidden=self.hidden, intermediate=self.intermediate,
                                        vocab=self.config.vocab_size,
                                        prefill_tokens=prefill_tokens, dtype=self.dtype,
                                        cache_dtype=self.cache_dtype)
            # the weight receiver assembles the next version in a second copy of the
            # checkpoint's weights on this device (relay.generators.weight_receiver.DeviceCopy)
            next_version = self.checkpoint_bytes()
            budget = budget_from_free_memory(free_bytes, memory.gpu_memory_utilization,
                                             self.weights_bytes() + next_version, workspace)
        else:
            budget = None
        return plan_cache(shape, cache_dtype=self.cache_dtype, budget_bytes=budget,
                          prefill_tokens=prefill_tokens)

    def checkpoint_bytes(self) -> int:
        """Bytes of the checkpoint's weights alone (what a version streams), without the
        prepacked copies and rotary tables this decoder derives from them."""
        bases = {id(t._base if t._base is not None else t): t._base if t._base is not None
                 else t for t in self._views.values()}
        return sum(t.numel() * t.element_size() for t in bases.values())

    def weights_bytes(self) -> int:
        """Bytes of every weight, prepacked copy and rotary table this decoder holds."""
        tensors = {id(t): t for t in [*self._views.values(), *self._packed.values(),
                                      self.cos, self.sin]}
        bases = {id(t._base if t._base is not None else t): t._base if t._base is not None
                 else t for t in tensors.values()}
        return sum(t.numel() * t.element_size() for t in bases.values())

    # -- weights ------------------------------------------------------------------------

    def _allocate(self) -> dict[str, torch.Tensor]:
        """Storage for every weight, and the view each Hugging Face parameter name fills."""
        def new(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=self.dtype, device=self.device)

        q, kv, d, i = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden, \
            self.intermediate
        views: dict[str, torch.Tensor] = {}
        self.embed = new(self.config.vocab_size, d)
        views["model.embed_tokens.weight"] = self.embed
        self.final_norm = new(d)
        views["model.norm.weight"] = self.final_norm
        if self.tied:
            self.lm_head = self.embed
        else:
            self.lm_head = new(self.config.vocab_size, d)
            views["lm_head.weight"] = self.lm_head
        self.blocks: list[dict[str, torch.Tensor | None]] = []
        for layer in range(self.layers):
            p = f"model.layers.{layer}."
            block = {"norm1": new(d), "qkv": new(q + 2 * kv, d), "o": new(d, q),
                     "norm2": new(d), "gate_up": new(2 * i, d), "down": new(d, i),
                     "qkv_bias": new(q + 2 * kv) if self.qkv_bias else None,
                     "o_bias": new(d) if self.qkv_bias and self.config.model_type != "qwen2"
                     else None,
                     "gate_up_bias": new(2 * i) if self.mlp_bias else None,
                     "down_bias": new(d) if self.mlp_bias else None,
                     "q_norm": new(self.head_dim) if self.qk_norm else None,
                     "k_norm": new(self.head_dim) if self.qk_norm else None}
            self.blocks.append(block)
            views[p + "input_layernorm.weight"] = block["norm1"]
            views[p + "post_attention_layernorm.weight"] = block["norm2"]
            views[p + "self_attn.o_proj.weight"] = block["o"]
            views[p + "mlp.down_proj.weight"] = block["down"]
            for name, rows in _split(block["qkv"], q, kv, kv, ["q", "k", "v"]):
                views[p + f"self_attn.{name}_proj.weight"] = rows
            for name, rows in _split(block["gate_up"], i, i, None, ["gate", "up"]):
                views[p + f"mlp.{name}_proj.weight"] = rows
            if block["qkv_bias"] is not None:
                for name, rows in _split(block["qkv_bias"], q, kv, kv, ["q", "k", "v"]):
                    views[p + f"self_attn.{name}_proj.bias"] = rows
            if block["o_bias"] is not None:
                views[p + "self_attn.o_proj.bias"] = block["o_bias"]
            if block["gate_up_bias"] is not None:
                for name, rows in _split(block["gate_up_bias"], i, i, None, ["gate", "up"]):
                    views[p + f"mlp.{name}_proj.bias"] = rows
                views[p + "mlp.down_proj.bias"] = block["down_bias"]
            if self.qk_norm:
                views[p + "self_attn.q_norm.weight"] = block["q_norm"]
                views[p + "self_attn.k_norm.weight"] = block["k_norm"]
        return views

    def parameter_shapes(self) -> dict[str, torch.Size]:
        """Every Hugging Face parameter name this decoder reads, with its shape."""
        return {name: view.shape for name, view in self._views.items()}

    @torch.no_grad()
    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy every named weight in (the caller has checked names and shapes)."""
        for name, view in self._views.items():
            view.copy_(tensors[name])
        self._pack_weights()

    def _pack_weights(self) -> None:
        """Reorder each matmul weight for oneDNN, when ``prepacked`` (module docstring)."""
        self._packed = {}
        if not self.prepacked:
            return
        weights = [self.lm_head] + [block[name] for block in self.blocks
                                    for name in ("qkv", "o", "gate_up", "down")]
        self._packed = {id(w): torch.ops.mkldnn._reorder_linear_weight(w, self.slots)
                        for w in weights}

    def _linear(self, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ b), with W's prepacked copy when there is one."""
        packed = self._packed.get(id(weight))
        if packed is None:
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    # -- forward ------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, lengths: Sequence[int], first_row: int,
                samples: Sequence[int]) -> torch.Tensor:
        """Run prompts (P, W) right-padded to W, of ``lengths`` (P,) real tokens, into the
        cache rows from ``first_row`` on: ``samples[i]`` rows for prompt i, each holding its
        keys and values (the samples of a prompt share one prefill; the rows' room is
        reserved, ``KVCache.reserve``); the logits (P, V) after each prompt's last real token.

        Padding sits after the real tokens, so the causal mask already hides it from them.
        """
        batch, width = tokens.shape
        plan = self.cache.plan_prefill(first_row, samples, lengths, width)
        positions = torch.arange(width, device=self.device)
        x = F.embedding(tokens, self.embed)
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # (W, 1, D)
        for layer, block in enumerate(self.blocks):
            q, k, v = self._qkv(x, block, cos, sin)  # (P, W, H|Hkv, D)
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # (P, Hkv, W, D)
            self.cache.write_prompts(layer, plan, k, v)  # cast to the cache's dtype there
            attended = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True,
                                                      enable_gqa=True)
            x = self._finish_layer(x, attended.transpose(1, 2).reshape(batch, width, -1), block)
        last = torch.tensor(lengths, dtype=torch.long, device=self.device) - 1
        return self._logits(x[torch.arange(batch, device=self.device), last])

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, active: int,
               context: int) -> torch.Tensor:
        """One token for each of the first ``active`` rows: tokens (A,) at positions (A,),
        ``context`` = max(positions) + 1 (known to the caller without a device sync);
        logits (A, V). Row i attends to its own cached positions 0..positions[i]."""
        plan = self.cache.plan_decode(positions, active, context)
        x = F.embedding(tokens, self.embed)  # (A, d)
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # (A, 1, D)
        group = self.heads // self.kv_heads
        scale = self.head_dim ** -0.5
        for layer, block in enumerate(self.blocks):
            q, k, v = self._qkv(x, block, cos, sin)  # (A, H|Hkv, D)
            self.cache.write(layer, plan, k, v)
            q = q.view(active, self.kv_heads, group, self.head_dim)
            attended = self.cache.attend(layer, plan, q, scale).to(self.dtype)  # (A, Hkv, G, D)
            x = self._finish_layer(x, attended.reshape(active, -1), block)
        return self._logits(x)

    def _qkv(self, x: torch.Tensor, block: dict, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = F.rms_norm(x, (self.hidden,), block["norm1"], self.eps)
        qkv = self._linear(h, block["qkv"], block["qkv_bias"])
        q, k, v = qkv.split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                             self.kv_heads * self.head_dim], dim=-1)
        q = q.unflatten(-1, (self.heads, self.head_dim))
        k = k.unflatten(-1, (self.kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.kv_heads, self.head_dim))
        if self.qk_norm:
            q = F.rms_norm(q, (self.head_dim,), block["q_norm"], self.eps)
            k = F.rms_norm(k, (self.head_dim,), block["k_norm"], self.eps)
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def _finish_layer(self, x: torch.Tensor, attended: torch.Tensor, block: dict) -> torch.Tensor:
        x = x + self._linear(attended, block["o"], block["o_bias"])
        h = F.rms_norm(x, (self.hidden,), block["norm2"], self.eps)
        gate, up = self._linear(h, block["gate_up"], block["gate_up_bias"]).chunk(2, dim=-1)
        return x + self._linear(F.silu(gate) * up, block["down"], block["down_bias"])

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(F.rms_norm(x, (self.hidden,), self.final_norm, self.eps),
                            self.lm_head)


def prepacking_available(device: torch.device) -> bool:
    """Whether this torch can run bf16 matmuls with oneDNN-prepacked weights on ``device``
    (``torch.ops.mkldnn``'s ``_reorder_linear_weight`` and ``_linear_pointwise``, the ops
    torch's compiler emits for frozen CPU linears)."""
    ops = torch.ops.mkldnn
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")
            and bool(ops._is_mkldnn_bf16_supported()))


def check_supported(config: PretrainedConfig) -> None:
    """Raise ``UnsupportedModel`` naming the first setting the lean forward lacks."""
    if config.model_type not in SUPPORTED_TYPES:
        raise UnsupportedModel(f"model_type {config.model_type!r} (the lean forward runs "
                               f"{', '.join(SUPPORTED_TYPES)})")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act {config.hidden_act!r} (only silu)")
    rope = _rope_parameters(config)
    if rope.get("rope_type", "default") != "default":
        raise UnsupportedModel(f"rope_type {rope.get('rope_type')!r} (only default rotary "
                               "embeddings)")
    if getattr(config, "use_sliding_window", False) or (
            config.model_type == "mistral" and getattr(config, "sliding_window", None)):
        raise UnsupportedModel("sliding-window attention")
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModel("partial rotary embeddings")


def _rope_parameters(config: PretrainedConfig) -> dict:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    rope = dict(rope or {})
    rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return rope


def rotary_tables(config: PretrainedConfig, head_dim: int, max_len: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (max_len, head_dim) of the default rotary embedding, in fp32, on ``device``:
    angle(p, j) = p * theta^(-2j / head_dim), each half of the head sharing the angles. The
    angles are computed on the CPU, so every device rotates by the same numbers."""
    theta = float(_rope_parameters(config)["rope_theta"])
    inverse = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu")
                              / head_dim)
    angles = torch.arange(max_len, dtype=torch.float32, device="cpu")[:, None] * inverse[None]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(device), angles.sin().to(device)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, computed in fp32 and cast back."""
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def _split(tensor: torch.Tensor, a: int, b: int, c: int | None,
           names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Row views of a fused tensor: sizes a, b (and c) under ``names``."""
    sizes = [a, b] + ([c] if c is not None else [])
    return zip(names, tensor.split(sizes, dim=0), strict=True)
