"""The benchmarks' models: randomly initialised Qwen2 architectures.

    tools/with-venv python tools/bench_model.py [FOLDER] [--shape NAME]

The throughput benchmark's is a Qwen2 of about 24M parameters (``bench-qwen2-24m``):
Qwen2's architecture (GQA, SwiGLU, RoPE, tied embeddings) at a size where compute, not
per-call overhead, sets the speed on a CPU: hidden 512, 8 layers, 8 query heads of 64 and 2
key/value heads, MLP 1536. It uses Relay's tiny tokenizer (290 tokens, ChatML), so the
arithmetic prompts tokenize as in the default run. Its weights are random (seeded): what it
writes is noise, so it measures speed, never accuracy. ``tools/bench-e2e.py --throughput``
builds it on first use into ``~/.cache/relay/models/bench-qwen2-24m``.

The learner benchmark's (``tools/bench-learner.py``) is Qwen2.5-0.5B's architecture
(``qwen2.5-0.5b-arch``: hidden 896, 24 layers, 14 query heads of 64 and 2 key/value
heads, MLP 4864, tied embeddings over Qwen2.5's 151,936-token vocabulary: 494M parameters),
random, saved in bf16 (1 GB) with the tiny tokenizer (its ids are a subset of the
vocabulary).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from relay.learner.tiny_model.build import default_model_dir
from relay.learner.tiny_model.tokenizer import build_tokenizer

NAME = "bench-qwen2-24m"
SHAPES: dict[str, dict[str, Any]] = {
    NAME: dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
               num_key_value_heads=2, intermediate_size=1536, max_position_embeddings=512),
    "qwen2.5-0.5b-arch": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                              num_key_value_heads=2, intermediate_size=4864,
                              max_position_embeddings=32768, vocab_size=151936,
                              rope_theta=1e6, rms_norm_eps=1e-6, dtype="bfloat16"),
}


def bench_model_dir(shape: str = NAME) -> Path:
    """Where a benchmark model is cached: beside the tiny default model."""
    return default_model_dir().parent / shape


def build_bench_model(folder: Path, seed: int = 0, shape: str = NAME) -> Path:
    """Save the random model of ``shape`` and the tiny tokenizer into ``folder``, like any
    HF model."""
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    options = {"vocab_size": len(tokenizer), **SHAPES[shape]}
    dtype = getattr(torch, options.pop("dtype", "float32"))
    config = Qwen2Config(tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, **options)
    model = Qwen2ForCausalLM(config).to(dtype)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def ensure_bench_model(shape: str = NAME) -> Path:
    """The cached benchmark model of ``shape``, built (seconds to a minute) if missing."""
    folder = bench_model_dir(shape)
    if not (folder / "config.json").is_file():
        print(f"building the benchmark model {shape} into {folder}", file=sys.stderr,
              flush=True)
        build_bench_model(folder, shape=shape)
    return folder


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="build a benchmark model")
    parser.add_argument("folder", nargs="?", help="where (default: the cache)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=NAME)
    args = parser.parse_args()
    built = build_bench_model(Path(args.folder) if args.folder else bench_model_dir(args.shape),
                              shape=args.shape)
    parameters = Qwen2ForCausalLM.from_pretrained(built).num_parameters()
    print(f"{built}: {parameters / 1e6:.1f}M parameters")
