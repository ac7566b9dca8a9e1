"""The LM head at the response positions only, chunk by chunk (relay.learner.logprob_head), against
the learner's computation before it: the model's own forward, logits at every position,
``token_logprobs`` and ``entropy_from_logits``.

- on FSDP2-sharded models (one rank: the head's weight is a shard of the root, gathered by
  the root's second forward method), tied (Llama) and untied (Qwen2) embeddings, the
  padded, shared-prompt and Ulysses paths give today's log-probs, entropies and gradients
  of a loss of both w.r.t. every parameter: within 1e-5 in fp32, within bf16 rounding
  with bf16 compute;
- no tensor as wide as the vocabulary has a row per position, only one per response token;
- a family whose logits are more than the head (Gemma 2's soft-capping) runs its own
  forward, with the same values.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import Gemma2Config, Gemma2ForCausalLM

from relay.algorithms.logprobs import entropy_from_logits, token_logprobs
from relay.learner.batch import TrainBatch
from relay.learner.logprob_head import FORWARD_METHOD, linear_head
from relay.learner.model import forward_logprobs, load_sharded
from relay.learner.tiny_model.tokenizer import build_tokenizer
from relay.learner.ulysses import SequenceParallel

from .test_shared_prompts import random_rollouts
from .test_ulysses import TensorShapes, save_random_qwen2


def todays_logprobs(model: torch.nn.Module, batch: TrainBatch, temperature: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The padded path before the chunked head: logits at every position."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   use_cache=False).logits[:, :-1]
    return (token_logprobs(logits, batch.input_ids[:, 1:], temperature),
            entropy_from_logits(logits, temperature))


def values_and_gradients(model: torch.nn.Module, batch: TrainBatch, compute
                         ) -> list[torch.Tensor]:
    """Masked log-probs and entropies from ``compute(model, batch)``, and the gradients of
    a loss of both w.r.t. every parameter (whole, fp32)."""
    model.zero_grad()
    logprobs, entropy = compute(model, batch)
    mask = batch.response_mask
    ((logprobs + 0.3 * entropy) * mask).sum().backward()
    grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
             for p in model.parameters()]
    return [(logprobs * mask).detach(), (entropy * mask).detach(), *grads]


@pytest.fixture(scope="module")
def models(random_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> dict[str, Path]:
    return {"llama tied": random_model_dir,
            "qwen2 untied": save_random_qwen2(tmp_path_factory.mktemp("qwen2"), kv_heads=2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", ["padded", "shared prompts", "ulysses"])
@pytest.mark.parametrize("family", ["llama tied", "qwen2 untied"])
def test_the_chunked_head_gives_todays_values_and_gradients(
        family: str, path: str, dtype: torch.dtype, models: dict[str, Path],
        one_rank_group: None) -> None:
    model = load_sharded(str(models[family]), compute_dtype=dtype, device=torch.device("cpu"))
    batch = random_rollouts(0)
    options = {"padded": {}, "shared prompts": {"share_prompts": True},
               "ulysses": {"sp": SequenceParallel(dist.group.WORLD, size=1, rank=0)}}[path]
    expected = values_and_gradients(model, batch, lambda m, b: todays_logprobs(m, b, 0.7))
    got = values_and_gradients(
        model, batch, lambda m, b: forward_logprobs(m, b, 0.7, True, **options))
    assert hasattr(model.__dict__[FORWARD_METHOD], "__wrapped__")  # an FSDP2 forward
    for index, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        if dtype == torch.float32:
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5, msg=str(index))
        else:  # bf16 matmuls: the sums run in another order
            error = float((mine - theirs).norm() / theirs.norm().clamp(min=1e-12))
            assert error < 2e-2, f"output {index}: relative error {error:.2g}"


def test_only_response_positions_reach_the_head(random_model_dir: Path) -> None:
    model = load_sharded(str(random_model_dir), compute_dtype=torch.float32,
                         device=torch.device("cpu"))
    batch = random_rollouts(0)
    vocab = model.config.vocab_size
    with TensorShapes() as seen:
        forward_logprobs(model, batch, 1.0, True)
    rows = {shape[0] for shape in seen.shapes if len(shape) == 2 and shape[1] == vocab}
    # (response tokens, V) logits and (hidden, V), the head's weight transposed
    assert rows == {int(batch.response_mask.sum()), model.config.hidden_size}
    assert not [shape for shape in seen.shapes if len(shape) == 3 and shape[-1] == vocab]


def test_a_soft_capped_head_runs_the_models_own_forward(tmp_path: Path) -> None:
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=16, final_logit_softcapping=3.0,
                          pad_token_id=tokenizer.pad_token_id)
    model = Gemma2ForCausalLM(config).eval()
    assert not linear_head(model)
    batch = random_rollouts(0)
    expected = values_and_gradients(model, batch, lambda m, b: todays_logprobs(m, b, 0.7))
    got = values_and_gradients(model, batch, lambda m, b: forward_logprobs(m, b, 0.7, True))
    for mine, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
