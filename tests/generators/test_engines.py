"""Both in-process engines: agreement with each other, per-token versions, weight loading."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from generators.engine import WeightMismatch
from generators.hf_engine import HFEngine
from generators.sampling import SamplingParams
from generators.torch_engine import TorchEngine

PROMPTS = [[1, 271, 201, 273, 272, 223, 19, 20, 2, 201, 1, 278, 201], [1, 271, 201, 24, 2, 201]]


def engines(path: Path, eos: int = 2):
    common = dict(dtype=torch.float32, eos_ids=[eos], pad_id=0, seed=0)
    return (TorchEngine.from_pretrained(str(path), **common),
            HFEngine.from_pretrained(str(path), **common))


def test_greedy_decoding_agrees_with_transformers_generate(random_model_dir: Path) -> None:
    ours, reference = engines(random_model_dir)
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    for a, b in zip(ours.generate(PROMPTS, params), reference.generate(PROMPTS, params)):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        assert a.finish_reason == b.finish_reason


def test_behavior_logprobs_agree_with_transformers_processed_scores(random_model_dir: Path) -> None:
    ours, reference = engines(random_model_dir)
    params = SamplingParams(max_new_tokens=10, temperature=0.7, top_k=20, top_p=0.9)
    # same seed, same draws: both sample with torch.multinomial from the same distribution
    a = ours.generate(PROMPTS[:1], params)[0]
    b = reference.generate(PROMPTS[:1], params)[0]
    assert a.token_ids.tolist() == b.token_ids.tolist()
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=1e-4)


def test_eos_stops_a_row_and_is_kept(random_model_dir: Path) -> None:
    ours, _ = engines(random_model_dir)
    probe = ours.generate(PROMPTS[:1], SamplingParams(max_new_tokens=4, temperature=0.0))[0]
    first = int(probe.token_ids[0])
    ours.eos_ids = frozenset({first})  # make the greedy first token an eos token
    stopped = ours.generate(PROMPTS[:1], SamplingParams(max_new_tokens=4, temperature=0.0))[0]
    assert stopped.token_ids.tolist() == [first] and stopped.finish_reason == "stop"
    assert probe.finish_reason == "length" and len(probe.token_ids) == 4


def test_weights_swapped_between_decode_steps_stamp_later_tokens(random_model_dir: Path) -> None:
    ours, _ = engines(random_model_dir, eos=-1)
    new_weights = {n: p.detach() + 0.01 for n, p in ours.model.named_parameters()}
    steps = []

    def hook() -> None:
        steps.append(len(steps))
        if len(steps) == 3:  # after the third sampled token
            ours.load_weights(7, new_weights)

    out = ours.generate(PROMPTS, SamplingParams(max_new_tokens=6), between_steps=hook)
    for completion in out:
        assert completion.versions.tolist() == [0, 0, 0, 7, 7, 7]
    assert ours.version == 7


def test_a_weight_set_that_does_not_fit_changes_nothing(random_model_dir: Path) -> None:
    ours, _ = engines(random_model_dir)
    before = {n: p.detach().clone() for n, p in ours.model.named_parameters()}
    broken = {n: p.detach() + 1 for n, p in ours.model.named_parameters()}
    name = next(iter(broken))
    broken[name] = broken[name][:1]
    with pytest.raises(WeightMismatch, match=name):
        ours.load_weights(1, broken)
    missing = dict(before)
    missing.pop(name)
    with pytest.raises(WeightMismatch, match="missing"):
        ours.load_weights(1, missing)
    assert ours.version == 0
    for n, p in ours.model.named_parameters():
        assert torch.equal(p, before[n])
