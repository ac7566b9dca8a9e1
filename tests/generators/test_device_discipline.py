"""A generator step names the device of every tensor it creates and brings each forward's
drawn tokens to the host once: the lean engine's steps (admission, decode, retirement; slot
and paged caches) and the torch engine's decode loop, on tiny random Llama and Qwen2 models
on the CPU, under ``tests.device_audit.DeviceAudit`` (a factory without ``device=`` would
put an index or a mask on the CPU beside CUDA data; a host sync stalls the GPU's queue).
Before this was fixed, a lean step made 8 to 24 syncs and its admission had two device-less
factories; the torch engine made 2 syncs a token, with four device-less factories in
``ModelEngine``'s padding."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from relay.generators.engine import GroupRequest
from relay.generators.lean_engine import LeanEngine
from relay.generators.lean_model import CacheMemory
from relay.generators.sampling import SamplingParams
from relay.generators.torch_engine import TorchEngine
from ..device_audit import DeviceAudit

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
MODELS = {"llama": LlamaConfig(**COMMON, tie_word_embeddings=True),
          "qwen2": Qwen2Config(**COMMON, tie_word_embeddings=False)}
CACHES = {"slots": None, "paged": CacheMemory(positions=6 * 16)}


def tiny_model(name: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(MODELS[name]).eval()


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("name", MODELS)
def test_every_lean_step_places_its_tensors_and_syncs_once_a_forward(
        name: str, cache: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Groups of two samples at temperature 1 and greedy, ending at 2, 3 and 4 tokens:
    the first step admits, later ones decode, retire, compact and admit again. Each forward
    (a decode, or the prefill of the groups a step admits) brings its drawn tokens to the
    host once: one sync for a step that decodes, two for one that also admits."""
    engine = LeanEngine.from_model(tiny_model(name), eos_ids=[-1], pad_id=0, max_num_seqs=4,
                                   max_len=24, memory=CACHES[cache])
    forwards = []
    for method in ("prefill", "decode"):
        original = getattr(engine.decoder, method)
        monkeypatch.setattr(engine.decoder, method,
                            lambda *a, _run=original: forwards.append(1) or _run(*a))
    for index, (limit, temperature) in enumerate([(2, 1.0), (3, 0.0), (4, 1.0), (3, 1.0)]):
        params = SamplingParams(max_new_tokens=limit, temperature=temperature)
        engine.submit(GroupRequest(index, [1, 5 + index, 9, 11][:2 + index % 3], 2, params))
    steps, finished = [], 0
    while engine.in_flight:
        forwards.clear()
        with DeviceAudit(["generators"]) as audit:
            finished += len(engine.step())
        steps.append((audit, len(forwards)))
    assert finished == 4 and len(steps) >= 5
    assert {passes for _, passes in steps} == {1, 2}  # steps with and without admission
    for audit, passes in steps:
        assert audit.unplaced == [], audit.report()
        assert audit.sync_count == passes, audit.report()


@pytest.mark.parametrize("name", MODELS)
def test_the_torch_engine_places_its_tensors_and_syncs_once_a_token(name: str) -> None:
    """Four more decode steps cost at most four more host syncs (the padding and the final
    copy of the outputs are paid once a call)."""
    engine = TorchEngine(tiny_model(name), eos_ids=[-1], pad_id=0)
    counts = []
    for tokens in (2, 6):
        with DeviceAudit(["generators"]) as audit:
            engine.generate([[1, 5, 7], [1, 2]], SamplingParams(max_new_tokens=tokens))
        assert audit.unplaced == [], audit.report()
        counts.append(audit.sync_count)
    assert counts[1] - counts[0] <= 4, counts
