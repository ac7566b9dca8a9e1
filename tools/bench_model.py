"""The throughput benchmark's model: a randomly initialised Qwen2 of about 24M parameters.

    tools/with-venv python tools/bench_model.py [FOLDER]

Qwen2's architecture (GQA, SwiGLU, RoPE, tied embeddings) at a size where compute, not
per-call overhead, sets the speed on a CPU: hidden 512, 8 layers, 8 query heads of 64 and 2
key/value heads, MLP 1536. It uses Relay's tiny tokenizer (290 tokens, ChatML), so the
arithmetic prompts tokenize as in the default run. Its weights are random (seeded): what it
writes is noise, so it measures speed, never accuracy. ``tools/bench-e2e.py --throughput``
builds it on first use into ``~/.cache/relay/models/bench-qwen2-24m``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from learner.tiny_model.build import default_model_dir
from learner.tiny_model.tokenizer import build_tokenizer

NAME = "bench-qwen2-24m"
SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, intermediate_size=1536, max_position_embeddings=512)


def bench_model_dir() -> Path:
    """Where the benchmark model is cached: beside the tiny default model."""
    return default_model_dir().parent / NAME


def build_bench_model(folder: Path, seed: int = 0) -> Path:
    """Save the random Qwen2 and the tiny tokenizer into ``folder``, like any HF model."""
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, **SHAPE)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def ensure_bench_model() -> Path:
    """The cached benchmark model, built (seconds) if missing."""
    folder = bench_model_dir()
    if not (folder / "config.json").is_file():
        print(f"building the benchmark model into {folder}", file=sys.stderr, flush=True)
        build_bench_model(folder)
    return folder


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else bench_model_dir()
    built = build_bench_model(target)
    parameters = Qwen2ForCausalLM.from_pretrained(built).num_parameters()
    print(f"{built}: {parameters / 1e6:.1f}M parameters")
