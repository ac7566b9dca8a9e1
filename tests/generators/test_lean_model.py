"""relay.generators.lean_model: the lean forward gives transformers' logits for Llama (GQA, tied
and untied, an explicit head_dim that is not hidden / heads), Qwen2 (QKV biases) and Qwen3
(per-head q/k norms), through the prefill and through decode steps over the cache (every
slot at full length, and a paged pool of blocks); unsupported settings are named."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
)

from relay.generators.kv_cache import PagedCache, SlotCache
from relay.generators.lean_model import (
    CacheMemory,
    LeanDecoder,
    UnsupportedModel,
    prepacking_available,
)

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
CONFIGS = {
    "llama-gqa-tied": LlamaConfig(**COMMON, tie_word_embeddings=True),
    "llama-untied-bias": LlamaConfig(**COMMON, tie_word_embeddings=False, attention_bias=True,
                                     mlp_bias=True),
    "llama-head-dim-32": LlamaConfig(**COMMON, head_dim=32, tie_word_embeddings=True),
    "qwen2": Qwen2Config(**COMMON, tie_word_embeddings=False),
    "qwen3": Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True),
}


CACHES = {"slots": (None, SlotCache), "paged": (CacheMemory(positions=5 * 16), PagedCache)}


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("name", CONFIGS)
def test_prefill_and_decode_give_the_transformers_logits(name: str, cache: str) -> None:
    """Two prompts into rows 2 and 3, moved to rows 0 and 1, decoded there. In the paged
    pool (5 blocks of 16 for 4 rows of 32 positions) the long prompt's row takes blocks 1
    and 2 (its continuation crosses from one to the next), the short one's block 3; block 0
    went to another row first."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[name]).eval()
    with torch.no_grad():  # biases and norms start at 0 / 1: move them off
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    memory, layout = CACHES[cache]
    decoder = LeanDecoder(model.config, slots=4, max_len=32, dtype=torch.float32, memory=memory)
    assert isinstance(decoder.cache, layout)
    decoder.load(dict(model.named_parameters()))
    prompts = [torch.randint(0, 97, (length,)) for length in (14, 3)]
    continuations = torch.randint(0, 97, (2, 5))
    padded = torch.zeros((2, 14), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        padded[row, :len(prompt)] = prompt
    decoder.cache.reserve(0, [1])  # block 0 to a row that stays empty: the rows' blocks differ
    decoder.cache.reserve(2, [14 + 5, 3 + 5])
    first = decoder.prefill(padded, [14, 3], 2, [1, 1])
    decoder.cache.release([0])
    decoder.cache.move([2, 3], [0, 1], 14)
    lean = [first]
    positions = torch.tensor([14, 3])
    for step in range(continuations.shape[1]):
        lean.append(decoder.decode(continuations[:, step], positions, active=2,
                                   context=int(positions.max()) + 1))
        positions = positions + 1
    with torch.no_grad():
        for row, prompt in enumerate(prompts):
            ids = torch.cat([prompt, continuations[row]])[None]
            expected = model(ids).logits[0, len(prompt) - 1:]
            got = torch.stack([step_logits[row] for step_logits in lean])
            torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def lean_logits(decoder: LeanDecoder, prompt: torch.Tensor,
                continuation: torch.Tensor) -> torch.Tensor:
    """One prompt through the prefill, then its continuation decoded: (1 + steps, V)."""
    decoder.cache.reserve(0, [len(prompt) + len(continuation)])
    logits = [decoder.prefill(prompt[None], [len(prompt)], 0, [1])]
    for step, token in enumerate(continuation):
        position = len(prompt) + step
        logits.append(decoder.decode(token[None], torch.tensor([position]), 1, position + 1))
    return torch.cat(logits).float()


@pytest.mark.parametrize("name", ["llama-untied-bias", "qwen2", "qwen3"])
def test_bf16_decoding_with_prepacked_weights_gives_the_plain_matmuls_logits(name: str) -> None:
    """On a CPU with oneDNN's bf16, the prepacked matmuls give ``F.linear``'s products bit
    for bit, and bf16 logits stay within bf16 rounding of fp32 transformers'."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[name]).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    weights = dict(model.named_parameters())
    prompt, continuation = torch.randint(0, 97, (7,)), torch.randint(0, 97, (5,))
    results = {}
    for prepack in (True, False):
        decoder = LeanDecoder(model.config, slots=2, max_len=32, dtype=torch.bfloat16)
        decoder.prepacked = prepack and decoder.prepacked
        decoder.load(weights)
        results[prepack] = (decoder.prepacked, lean_logits(decoder, prompt, continuation))
    if not prepacking_available(torch.device("cpu")):
        pytest.skip("this torch or CPU has no oneDNN bf16 matmuls")
    assert results[True][0] and not results[False][0]
    assert torch.equal(results[True][1], results[False][1])
    with torch.no_grad():
        expected = model(torch.cat([prompt, continuation])[None]).logits[0, len(prompt) - 1:]
    torch.testing.assert_close(results[True][1], expected, atol=0.05, rtol=0.02)


def test_parameter_names_are_the_checkpoints() -> None:
    model = AutoModelForCausalLM.from_config(CONFIGS["qwen2"])
    decoder = LeanDecoder(model.config, slots=1, max_len=8, dtype=torch.float32)
    assert decoder.parameter_shapes() == {n: p.shape for n, p in model.named_parameters()}


@pytest.mark.parametrize(("config", "named"), [
    (GPT2Config(), "model_type 'gpt2'"),
    (LlamaConfig(**COMMON, hidden_act="gelu"), "hidden_act 'gelu'"),
    (LlamaConfig(**COMMON, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 10000.0}), "rope_type 'linear'"),
    (Qwen2Config(**COMMON, use_sliding_window=True), "sliding-window"),
])
def test_unsupported_settings_are_named(config, named: str) -> None:
    with pytest.raises(UnsupportedModel, match=named):
        LeanDecoder(config, slots=1, max_len=8, dtype=torch.float32)



def test_a_gpu_cache_leaves_room_for_the_next_versions_copy_of_the_weights(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the weight receiver assembles the next version in a second copy of the
    checkpoint's weights on the device (relay.generators.weight_receiver.DeviceCopy): the cache's
    budget is free x utilization - weights - that copy - workspace. Seen without it: a 7B
    lean generator at 0.9 of 80 GiB had no room for the copy at its first update. A GPU's
    free memory is stood in for on the CPU."""
    import relay.generators.lean_model as lean_model

    held: list[int] = []
    plain_budget = lean_model.budget_from_free_memory

    def budget(free: int, utilization: float, weights: int, workspace: int) -> int:
        held.append(weights)
        return plain_budget(free, utilization, weights, workspace)
    monkeypatch.setattr(lean_model, "budget_from_free_memory", budget)
    monkeypatch.setattr(lean_model, "free_device_bytes", lambda device: 2**40)
    decoder = LeanDecoder(CONFIGS["qwen2"], slots=4, max_len=32, dtype=torch.float32,
                          memory=CacheMemory(gpu_memory_utilization=0.5))
    checkpoint = sum(p.numel() * 4 for p in AutoModelForCausalLM.from_config(
        CONFIGS["qwen2"]).parameters())
    assert decoder.checkpoint_bytes() == checkpoint < decoder.weights_bytes()  # no rotary
    assert held == [decoder.weights_bytes() + checkpoint]
