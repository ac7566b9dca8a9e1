"""Relay's own engine: a plain PyTorch decode loop over a Hugging Face causal LM.

Prompts are left-padded into one batch; a prefill fills the KV cache (transformers'
``DynamicCache``), then one token per step for every row until all rows hit an eos token
or ``max_new_tokens``. Between decode steps the caller's hook may load a new weight
version: the remaining tokens are sampled (and stamped) with the new version while the KV
cache of earlier tokens is kept, so in-flight prompts are never lost (PipelineRL-style
in-flight updates; the per-token versions tell the learner exactly what happened).

It runs any transformers causal LM; for the Llama, Qwen2 and Qwen3 families the lean
engine (``relay.generators.lean_engine``) is faster: a lean forward, a static cache, one prefill
per prompt's samples and continuous batching.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from relay.generators.engine import Completion, ModelEngine, StepHook
from relay.generators.sampling import SamplingParams, sample_next


class TorchEngine(ModelEngine):
    """Batched sampling with a KV cache on one device."""

    name = "torch"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._generator = torch.Generator(device=self.device).manual_seed(self.seed)

    def reseed(self, seed: int) -> None:
        self._generator.manual_seed(seed)

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 between_steps: StepHook | None = None) -> list[Completion]:
        if not prompts:
            return []
        input_ids, attention = self.left_pad(prompts)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = self._forward(input_ids, attention, positions, cache)
        next_position = positions[:, -1] + 1
        eos = torch.tensor(sorted(self.eos_ids), device=self.device)
        done = torch.zeros(len(prompts), dtype=torch.bool, device=self.device)
        tokens, logprobs, versions = [], [], []
        for step in range(params.max_new_tokens):
            version = self.version  # the weights that computed these logits
            token, logprob = sample_next(logits, params, self._generator)
            token = token.masked_fill(done, self.pad_id)
            tokens.append(token)
            logprobs.append(logprob)
            versions.append(torch.full_like(token, version, dtype=torch.int32))
            done |= torch.isin(token, eos)
            if bool(done.all()) or step == params.max_new_tokens - 1:
                break
            if between_steps is not None:
                between_steps()
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=-1)
            logits = self._forward(token[:, None], attention, next_position[:, None], cache)
            next_position = next_position + 1
        return self.cut_at_eos(torch.stack(tokens, 1), torch.stack(logprobs, 1),
                               torch.stack(versions, 1))

    def _forward(self, input_ids: torch.Tensor, attention: torch.Tensor,
                 positions: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]  # (B, V)
