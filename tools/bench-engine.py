#!/usr/bin/env python3
"""Benchmark Relay's generation engines against transformers' generate and the bare floor.

    tools/with-venv python tools/bench-engine.py [--model PATH] [--batch 64 ...]
        [--prompt-len 32] [--new-tokens 16] [--samples-per-prompt 1] [--repeats 5]
        [--threads 2] [--dtype float32] [--vllm]

With no ``--model``, the embedded default model (built and cached on first use, as the
launcher does). Prints generated tokens/s (medians) per batch size: the lean engine, the
torch engine, transformers' generate, transformers' bare decode-forward floor and the
compute ceiling, with the ratios lean/generate and floor/lean. ``--samples-per-prompt 8``
makes the batch GRPO-like (each prompt sampled 8 times: the lean engine prefills it once).
``--vllm`` adds vLLM (its CPU build, the `vllm` extra) on the same model folder, with the
ratio vllm/lean; vLLM's CPU attention needs head_dim 32 or more.
Last, continuous batching: ``--groups`` groups whose responses end at random lengths go
through the lean engine's slots (the largest ``--batch``), and it prints the mean number
of sequences in flight while groups waited, against static batches. With ``--tool-sleep S``
(default 2), two-turn episodes whose every fourth tool call sleeps S seconds go through the
same slots: the batch's occupancy while sleeps are pending, and the wall time against an
instant tool (a lockstep batcher would add S per batch holding a sleeper); 0 skips it.
The measurements live in ``relay.bench_engine``.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM

from relay.bench_engine import compare_engines, continuous_batching, tool_episodes


def default_model() -> str:
    from relay.learner.tiny_model.build import build_tiny_model, default_model_dir

    path = default_model_dir()
    if not (path / "config.json").is_file():
        print(f"building the tiny default model into {path} (once; a few minutes)", flush=True)
        build_tiny_model(path, overwrite=True)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local Hugging Face causal LM folder")
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--samples-per-prompt", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--vllm", action="store_true", help="add vLLM's CPU build")
    parser.add_argument("--groups", type=int, default=64,
                        help="groups in the continuous-batching stream")
    parser.add_argument("--tool-sleep", type=float, default=2.0,
                        help="seconds a sleepy tool call takes in the tool-episode stream "
                             "(0: skip it)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model or default_model()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype))
    print(f"model {path} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"{args.dtype}), {torch.get_num_threads()} threads; prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens; {args.samples_per_prompt} samples per prompt; "
          f"tokens/s, median of {args.repeats}")
    vllm = start_vllm(path, args.dtype, max(args.batch), args.prompt_len + args.new_tokens) \
        if args.vllm else None
    for batch in args.batch:
        c = compare_engines(model, batch=batch, prompt_len=args.prompt_len,
                            new_tokens=args.new_tokens,
                            samples_per_prompt=args.samples_per_prompt, repeats=args.repeats,
                            other=vllm)
        extra = "" if c.other is None else (f"  vllm {c.other:>9,.0f}  "
                                            f"vllm/lean {c.other_over_lean:5.2f}")
        print(f"batch {batch:>4}: lean {c.lean:>9,.0f}  torch {c.torch:>9,.0f}  "
              f"generate {c.hf_generate:>9,.0f}{extra}  floor {c.floor:>9,.0f}  "
              f"compute ceiling {c.compute_ceiling:>11,.0f}  "
              f"lean/generate {c.lean_over_hf:5.2f}  floor/lean {c.floor_over_lean:5.2f}",
              flush=True)
    slots, group = max(args.batch), max(args.samples_per_prompt, 8)
    o = continuous_batching(model, max_num_seqs=slots, prompt_len=args.prompt_len,
                            new_tokens=args.new_tokens, samples_per_prompt=group,
                            groups=max(args.groups, -(-2 * slots // group)))
    print(f"continuous batching, {slots} slots, {o.groups} groups of {group} samples ending "
          f"after 1-{args.new_tokens} tokens: {o.continuous:.1f} sequences in flight per "
          f"decode step while groups waited ({o.continuous_fraction:.0%} of the slots; static "
          f"batches: {o.static_fraction:.0%}), {o.tokens_per_s:,.0f} tokens/s", flush=True)
    if args.tool_sleep > 0:
        t = tool_episodes(model, max_num_seqs=slots, prompt_len=args.prompt_len,
                          new_tokens=args.new_tokens, episodes=24 * slots, sleepy_every=4,
                          sleep_s=args.tool_sleep)
        print(f"tools never block decoding, {slots} slots, {t.episodes} two-turn episodes, "
              f"{t.sleepy} of whose tools sleep {t.sleep_s:g} s: {t.occupancy_while_sleeping:.1f} "
              f"sequences in flight per decode step while sleeps were pending; "
              f"{t.sleepy_s:.2f} s against {t.instant_s:.2f} s with an instant tool "
              f"(+{t.extra_s:.2f} s; lockstep batches would add {t.lockstep_extra_s:.0f} s)",
              flush=True)


def start_vllm(path: str, dtype: str, max_num_seqs: int, max_len: int):
    """vLLM's engine on ``path``; nothing stops early (no eos ids), as for the others."""
    from relay.generators.vllm_engine import VLLMEngine

    return VLLMEngine.from_pretrained(path, dtype=getattr(torch, dtype), eos_ids=[], pad_id=0,
                                      max_num_seqs=max_num_seqs, max_len=max_len)


if __name__ == "__main__":
    main()
