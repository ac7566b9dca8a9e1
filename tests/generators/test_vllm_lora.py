"""The adapters-only publish to vLLM's LoRA support (``relay.generators.vllm_lora``): the
generator expects exactly the names and shapes the learner's LoRA policy publishes, and
vLLM's CPU build, given a version of adapters alone, generates what the merged model
W + (alpha / r) B A generates; a version of the wrong shapes changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from relay.configs.run_schema import ModelConfig
from relay.generators.engine import WeightMismatch
from relay.generators.sampling import SamplingParams
from relay.generators.vllm_engine import VLLMEngine, engine_arguments
from relay.generators.vllm_lora import adapter_layout, max_lora_rank
from relay.configs.topology_schema import VLLMOptions
from relay.learner.lora import adapter_state, save_adapter, write_merged
from relay.learner.weight_buckets import gather_buckets, plan_buckets

from ..conftest import exit_worker, free_port, save_random_model
from ..learner.test_lora import load_lora, lora_keys, randomize_b
from .test_vllm_engine import EOS, PROMPTS, needs_vllm

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)


def test_vllm_gets_the_smallest_lora_rank_it_knows_that_holds_the_adapters() -> None:
    assert [max_lora_rank(r) for r in (1, 2, 8, 9, 64, 320)] == [1, 8, 8, 16, 64, 320]
    with pytest.raises(ValueError, match="lora_rank = 600.*enable_lora = false"):
        max_lora_rank(600)
    args = engine_arguments("/m", dtype="float32", device="cpu", seed=0, max_num_seqs=4,
                            max_len=64, trust_remote_code=False, options=VLLMOptions(),
                            lora_rank=12)
    assert (args["enable_lora"], args["max_loras"], args["max_lora_rank"]) == (True, 1, 16)
    plain = engine_arguments("/m", dtype="float32", device="cpu", seed=0, max_num_seqs=4,
                             max_len=64, trust_remote_code=False, options=VLLMOptions())
    assert "enable_lora" not in plain


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"]])
def test_the_generator_expects_what_the_learner_publishes(
        random_model_dir: Path, one_rank_group: None, targets: object) -> None:
    model = load_lora(random_model_dir, target_modules=targets)
    plan = plan_buckets(model, torch.bfloat16, 1 << 12, adapters=True)
    expected, peft_config = adapter_layout(lora_keys(random_model_dir, target_modules=targets))
    assert [(e.name, tuple(e.shape)) for e in plan.entries] == \
        [(name, tuple(shape)) for name, shape in expected.items()]
    assert all(".lora_A.weight" in n or ".lora_B.weight" in n for n in expected)
    # peft resolves all-linear into the modules' paths
    assert {t.rsplit(".", 1)[-1] for t in peft_config.target_modules} == (
        {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
        if targets == "all-linear" else set(targets))
    # far smaller than the merged publish of the same model
    merged = plan_buckets(model, torch.bfloat16, 1 << 12)
    assert plan.total_bytes < merged.total_bytes / 4


def test_the_adapters_publish_gathers_a_and_b_whole(random_model_dir: Path,
                                                    one_rank_group: None) -> None:
    model = load_lora(random_model_dir)
    randomize_b(model)
    plan = plan_buckets(model, torch.float32, 1 << 12, adapters=True)
    pieces: dict[str, list[torch.Tensor]] = {}
    for bucket in gather_buckets(model, plan, torch.float32, version=1):
        for name, piece in zip(bucket.names, bucket.tensors):
            pieces.setdefault(name, []).append(piece.clone())
    published = {name: torch.cat(parts) for name, parts in pieces.items()}
    state = adapter_state(model)
    assert published.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(published[name], tensor), name


def test_an_adapters_publish_of_a_model_without_lora_is_refused(random_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(random_model_dir))
    with pytest.raises(ValueError, match="model.lora_rank"):
        plan_buckets(model, torch.float32, 1 << 12, adapters=True)


# -- vLLM's CPU build -----------------------------------------------------------------------


@needs_vllm
@pytest.mark.slow
def test_vllm_generates_with_a_version_of_adapters_alone(tmp_path: Path) -> None:
    model_dir = save_random_model(tmp_path / "base", hidden=128)  # vLLM's CPU heads: >= 32
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        model = load_lora(model_dir)
        randomize_b(model, std=0.5)  # large enough to change the greedy tokens
        plan = plan_buckets(model, torch.float32, 1 << 14, adapters=True)
        version = {}
        for bucket in gather_buckets(model, plan, torch.float32, version=1):
            for name, piece in zip(bucket.names, bucket.tensors):
                version[name] = torch.cat([version[name], piece]) if name in version \
                    else piece.clone()
        save_adapter(model, tmp_path / "adapter", base_path=str(model_dir))
    finally:
        dist.destroy_process_group()
    write_merged(tmp_path / "adapter", tmp_path / "merged", torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    expected = {tuple(p): generated(merged, p) for p in PROMPTS}
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    assert any(generated(base, p) != expected[tuple(p)] for p in PROMPTS)  # B != 0 shows
    torch.save(version, tmp_path / "version.pt")
    # vLLM's engine core leaves a default process group behind: a process of its own
    mp.start_processes(vllm_takes_adapters, args=(str(model_dir), str(tmp_path)), nprocs=1,
                       start_method="spawn")
    results = torch.load(tmp_path / "vllm.pt")
    assert results["refused"].startswith("base_model.model.")
    for prompt, before, after, kept in zip(PROMPTS, results["before"], results["after"],
                                           results["after_refused"]):
        assert before == generated(base, prompt)[:len(before)]  # version 0: the base
        assert after == expected[tuple(prompt)][:len(after)]
        assert kept == after  # the refused version changed nothing


def generated(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                             eos_token_id=EOS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def vllm_takes_adapters(_index: int, model_dir: str, folder: str) -> None:
    """vLLM's CPU engine with the policy's adapter slot: greedy completions of ``PROMPTS``
    before and after ``folder/version.pt``, then after a version with a wrong shape."""
    engine = VLLMEngine.from_pretrained(model_dir, dtype=torch.float32, eos_ids=[EOS], pad_id=0,
                                        max_num_seqs=16, max_len=64,
                                        lora=ModelConfig(path=model_dir, lora_rank=8,
                                                         lora_alpha=16.0))
    results = {"before": [c.token_ids.tolist() for c in engine.generate(PROMPTS, GREEDY)]}
    version = torch.load(Path(folder) / "version.pt")
    engine.load_weights(1, version)
    results["after"] = [c.token_ids.tolist() for c in engine.generate(PROMPTS, GREEDY)]
    bad = dict(version)
    name = next(iter(bad))
    bad[name] = torch.zeros(bad[name].shape[0] + 1, bad[name].shape[1])
    try:
        engine.load_weights(2, bad)
    except WeightMismatch as exc:
        results["refused"] = str(exc)
    results["after_refused"] = [c.token_ids.tolist() for c in engine.generate(PROMPTS, GREEDY)]
    torch.save(results, Path(folder) / "vllm.pt")
    exit_worker()
