"""The in-process engines (lean, torch, hf): agreement with transformers, per-token versions,
weight loading."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from relay.algorithms.logprobs import token_logprobs
from relay.algorithms.off_policy import RolloutCorrectionConfig, off_policy_correction
from relay.generators.engine import Completion, Engine, WeightMismatch, copy_device
from relay.generators.hf_engine import HFEngine
from relay.generators.lean_engine import LeanEngine
from relay.generators.sampling import SamplingParams
from relay.generators.torch_engine import TorchEngine

PROMPTS = [[1, 271, 201, 273, 272, 223, 19, 20, 2, 201, 1, 278, 201], [1, 271, 201, 24, 2, 201]]
OURS = ["lean", "torch"]


def build(kind: str, path: Path, eos: int = 2) -> Engine:
    common = dict(dtype=torch.float32, eos_ids=[eos], pad_id=0, seed=0)
    if kind == "lean":
        return LeanEngine.from_pretrained(str(path), max_num_seqs=16, max_len=64, **common)
    return {"torch": TorchEngine, "hf": HFEngine}[kind].from_pretrained(str(path), **common)


def weights(engine: Engine) -> dict[str, torch.Tensor]:
    if isinstance(engine, LeanEngine):
        return {n: v.clone() for n, v in engine.decoder._views.items()}
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


@pytest.mark.parametrize("kind", OURS)
def test_greedy_decoding_agrees_with_transformers_generate(kind: str,
                                                           random_model_dir: Path) -> None:
    ours, reference = build(kind, random_model_dir), build("hf", random_model_dir)
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    for a, b in zip(ours.generate(PROMPTS, params), reference.generate(PROMPTS, params),
                    strict=True):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        assert a.finish_reason == b.finish_reason


FILTERED = SamplingParams(max_new_tokens=10, temperature=0.7, top_k=20, top_p=0.9)


def recomputed_logprobs(model: AutoModelForCausalLM, prompt: list[int],
                        completion: Completion, temperature: float) -> torch.Tensor:
    """The learner's log-probs of ``completion``'s tokens: log softmax(logits / T)[token] of
    a teacher-forced forward (``relay.algorithms.logprobs.token_logprobs``)."""
    ids = torch.tensor([prompt + completion.token_ids.tolist()])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1]
    return token_logprobs(logits, completion.token_ids, temperature)


@pytest.mark.parametrize("kind", [*OURS, "hf"])
def test_behavior_logprobs_are_the_temperature_only_ones_under_top_k_and_top_p(
        kind: str, random_model_dir: Path) -> None:
    """Tokens drawn after transformers' temperature, top-k and top-p warpers; each one's
    behavior log-prob is log softmax(logits / T) of transformers' own forward, not the
    warped distribution's (which is higher wherever the filters cut anything)."""
    engine = build(kind, random_model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(random_model_dir), dtype=torch.float32)
    warpers = [TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.9)]
    cut = 0
    for prompt, completion in zip(PROMPTS * 4, engine.generate(PROMPTS * 4, FILTERED),
                                  strict=True):
        expected = recomputed_logprobs(model, prompt, completion, 0.7)
        torch.testing.assert_close(completion.logprobs, expected, atol=1e-4, rtol=1e-4)
        ids = torch.tensor([prompt + completion.token_ids.tolist()])
        with torch.no_grad():
            warped = model(ids).logits[0, len(prompt) - 1:-1]
        for warp in warpers:
            warped = warp(ids, warped)
        assert (warped > -math.inf).gather(-1, completion.token_ids[:, None].long()).all()
        filtered = warped.log_softmax(-1).gather(-1, completion.token_ids[:, None].long())
        cut += int((filtered.squeeze(-1) > expected + 1e-3).sum())
    assert cut > 0  # the filters did cut: the test tells the two log-probs apart


@pytest.mark.parametrize("kind", [*OURS, "hf"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_at_equal_weights_every_importance_weight_is_one_under_top_p(
        kind: str, level: str, random_model_dir: Path) -> None:
    """Issue 30, item 20: sampled at top-p 0.9, the learner's recomputation with the same
    weights gives pi_prox / pi_b = 1 at every token, so neither token- nor sequence-level
    IS shrinks anything (with the filtered log-probs, 0.97 a token and ~0 a sequence)."""
    engine = build(kind, random_model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(random_model_dir), dtype=torch.float32)
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9)
    completions = engine.generate(PROMPTS * 4, params)
    width = max(len(c.token_ids) for c in completions)
    behavior = torch.zeros(len(completions), width)
    proximal = torch.zeros(len(completions), width)
    mask = torch.zeros(len(completions), width)
    for row, (prompt, completion) in enumerate(zip(PROMPTS * 4, completions, strict=True)):
        length = len(completion.token_ids)
        behavior[row, :length] = completion.logprobs
        proximal[row, :length] = recomputed_logprobs(model, prompt, completion, 1.0)
        mask[row, :length] = 1.0
    correction = off_policy_correction(proximal, behavior, mask,
                                       RolloutCorrectionConfig(rollout_is=level))
    torch.testing.assert_close(correction.weight, torch.ones_like(mask), atol=1e-3, rtol=0)
    assert correction.mask.equal(mask)


@pytest.mark.parametrize("kind", OURS)
def test_eos_stops_a_row_and_is_kept(kind: str, random_model_dir: Path) -> None:
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    probe = build(kind, random_model_dir).generate(PROMPTS[:1], greedy)[0]
    first = int(probe.token_ids[0])  # make the greedy first token an eos token
    stopped = build(kind, random_model_dir, eos=first).generate(PROMPTS[:1], greedy)[0]
    assert stopped.token_ids.tolist() == [first] and stopped.finish_reason == "stop"
    assert probe.finish_reason == "length" and len(probe.token_ids) == 4


@pytest.mark.parametrize("kind", OURS)
def test_weights_swapped_between_decode_steps_stamp_later_tokens(kind: str,
                                                                  random_model_dir: Path) -> None:
    ours = build(kind, random_model_dir, eos=-1)
    new_weights = {n: t + 0.01 for n, t in weights(ours).items()}
    steps = []

    def hook() -> None:
        steps.append(len(steps))
        if len(steps) == 3:  # after the third sampled token
            ours.load_weights(7, new_weights)

    out = ours.generate(PROMPTS, SamplingParams(max_new_tokens=6), between_steps=hook)
    for completion in out:
        assert completion.versions.tolist() == [0, 0, 0, 7, 7, 7]
    assert ours.version == 7


@pytest.mark.parametrize("kind", OURS)
def test_a_weight_set_that_does_not_fit_changes_nothing(kind: str,
                                                        random_model_dir: Path) -> None:
    ours = build(kind, random_model_dir)
    before = weights(ours)
    broken = {n: t + 1 for n, t in before.items()}
    name = next(iter(broken))
    broken[name] = broken[name][:1]
    with pytest.raises(WeightMismatch, match=name):
        ours.load_weights(1, broken)
    missing = dict(before)
    missing.pop(name)
    with pytest.raises(WeightMismatch, match="missing"):
        ours.load_weights(1, missing)
    assert ours.version == 0
    for n, t in weights(ours).items():
        assert torch.equal(t, before[n])


@pytest.mark.parametrize("kind", [*OURS, "hf"])
def test_reseeding_makes_sampling_depend_on_the_seed_alone(kind: str,
                                                           random_model_dir: Path) -> None:
    engine = build(kind, random_model_dir)
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    prompts = [[1, 271, 201, 273], [1, 271, 201, 24, 25]] * 2

    def sampled(seed: int) -> list[list[int]]:
        engine.reseed(seed)
        return [c.token_ids.tolist() for c in engine.generate(prompts, params)]

    first = sampled(7)
    engine.generate(prompts, params)  # the stream moves on ...
    assert sampled(7) == first  # ... and a reseed starts it over
    assert sampled(8) != first


@pytest.mark.parametrize("kind", [*OURS, "hf"])
def test_only_a_cuda_engine_has_its_next_version_assembled_on_its_device(
        kind: str, random_model_dir: Path) -> None:
    """On the CPU a version is assembled whole in host memory (staging_device None); an
    engine on a CUDA device has it assembled there, beside its weights."""
    assert build(kind, random_model_dir).staging_device is None
    assert copy_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert copy_device(torch.device("cpu")) is None
