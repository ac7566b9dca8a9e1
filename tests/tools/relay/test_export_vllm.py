"""``relay export`` of a checkpoint in bf16 decodes greedily, token for token, as the
checkpoint's policy does (the learner's weights cast to bf16, as a user loads them): in
transformers and in vLLM's CPU build (slow: vLLM starts in ~15 s). vLLM runs in a process
of its own: its engine leaves a default process group behind, which would break every
later test that makes one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM

from relay.export import main
from relay.learner.tiny_model.tokenizer import build_tokenizer

from ...conftest import free_port, gather_full_weights
from ...learner.test_update_algorithms import make_learner
from .test_export import checkpoint_of

PROMPTS = [[1, 271, 201, 273, 272, 223, 19, 20, 2, 201, 1, 278, 201], [1, 271, 201, 24, 2, 201],
           [1, 40, 41, 42, 43]]
NEW_TOKENS = 12


def save_decoding_model(folder: Path) -> Path:
    """A random Llama that decodes something other than its last token: an untied head with
    logits of a spread (std ~ 11) far above bf16's rounding, so that greedy choices are
    clear-cut; 4 heads of 32, the smallest vLLM's CPU attention runs."""
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=False,
                         eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 1.0)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def greedy(model: torch.nn.Module) -> list[list[int]]:
    """``NEW_TOKENS`` greedy tokens after each prompt, EOS not stopping them."""
    outs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(out[0, len(prompt):].tolist())
    return outs


def checkpoint_and_policy(model_dir: Path, tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    """A checkpoint of a learner on ``model_dir`` (one gloo rank, gone afterwards) and its
    policy as a plain model, cast to bf16."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        learner = make_learner(model_dir)
        checkpoint = checkpoint_of(learner, model_dir, tmp_path)
        weights = gather_full_weights(learner.model, torch.float32)
    finally:
        dist.destroy_process_group()
    policy = LlamaForCausalLM(LlamaConfig.from_pretrained(model_dir)).eval()
    policy.load_state_dict(weights)
    return checkpoint, policy.to(torch.bfloat16)


def vllm_decodes(_index: int, folder: str) -> None:
    """vLLM's CPU engine on ``folder`` decodes ``PROMPTS`` greedily into ``folder``/vllm.pt."""
    from relay.generators.sampling import SamplingParams
    from relay.generators.vllm_engine import VLLMEngine

    engine = VLLMEngine.from_pretrained(folder, dtype=torch.bfloat16, eos_ids=[], pad_id=0,
                                        max_num_seqs=4, max_len=64)
    completions = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS,
                                                          temperature=0.0))
    torch.save([completion.token_ids.tolist() for completion in completions],
               Path(folder) / "vllm.pt")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM is not installed (the `vllm` extra)")
def test_a_bf16_export_decodes_as_the_checkpoint_in_transformers_and_vllm(
        tmp_path: Path) -> None:
    model_dir = save_decoding_model(tmp_path / "model")
    checkpoint, policy = checkpoint_and_policy(model_dir, tmp_path)
    expected = greedy(policy)
    assert expected != greedy(AutoModelForCausalLM.from_pretrained(model_dir,
                                                                   dtype=torch.bfloat16))
    assert main([str(checkpoint), "--dtype", "bfloat16", str(tmp_path / "out")]) == 0
    assert greedy(AutoModelForCausalLM.from_pretrained(tmp_path / "out")) == expected
    mp.start_processes(vllm_decodes, args=(str(tmp_path / "out"),), nprocs=1,
                       start_method="spawn")
    assert torch.load(tmp_path / "out" / "vllm.pt") == expected
