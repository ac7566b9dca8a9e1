"""The reference engine: transformers' own ``generate``.

Sampling runs through ``generate``'s logits processors (temperature, top-k, top-p); the
raw logits it returns (``output_logits``) give each sampled token's behavior log-prob under
the temperature-only distribution, log softmax(logits / T)[token], Relay's convention
(``relay.generators.sampling``). Weights change only between ``generate`` calls, so every token
of a call carries the same version.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import GenerationConfig

from relay.algorithms.logprobs import token_logprobs
from relay.generators.engine import Completion, ModelEngine, StepHook
from relay.generators.sampling import SamplingParams


class HFEngine(ModelEngine):
    """``model.generate`` on left-padded batches."""

    name = "hf"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._calls = 0

    def reseed(self, seed: int) -> None:
        self.seed, self._calls = seed, 0  # each call seeds the global RNG from these

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 between_steps: StepHook | None = None) -> list[Completion]:
        if not prompts:
            return []
        input_ids, attention = self.left_pad(prompts)
        sampled = not params.greedy
        config = GenerationConfig(
            max_new_tokens=params.max_new_tokens, do_sample=sampled,
            temperature=params.temperature if sampled else None,
            top_p=params.top_p if sampled else None,
            top_k=params.top_k if sampled and params.top_k > 0 else None,
            eos_token_id=sorted(self.eos_ids), pad_token_id=self.pad_id,
            return_dict_in_generate=True, output_logits=True)
        torch.manual_seed(self.seed + self._calls)  # generate draws from the global RNG
        self._calls += 1
        out = self.model.generate(input_ids=input_ids, attention_mask=attention,
                                  generation_config=config)
        new_tokens = out.sequences[:, input_ids.shape[1]:]  # (B, S)
        if sampled:
            logits = torch.stack(out.logits, dim=1)  # (B, S, V), before any processor
            logprobs = token_logprobs(logits, new_tokens, params.temperature)
        else:
            logprobs = torch.zeros(new_tokens.shape, device=new_tokens.device)
        versions = torch.full(new_tokens.shape, self.version, dtype=torch.int32)
        return self.cut_at_eos(new_tokens, logprobs, versions)
