#!/usr/bin/env python
"""Plan a run's GPU memory from the model's config alone: no weights, no GPU.

    python tools/plan-memory.py MODEL_CONFIG --ranks 8 --gpu-gib 80 [key=value ...]
    python tools/plan-memory.py Qwen2.5-7B/ --ranks 8 model.enable_gradient_checkpointing=true \\
        actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=16384 --engine vllm --json

MODEL_CONFIG is a model folder or its config.json. For the learner's rank 0 (of ``--ranks``,
sharded over ``--fsdp-size``) it prints, per item, the GiB held (fp32 shards, gradients,
AdamW states, gathered blocks, activations at the run's token budget, the LM head's
log-probs, a publish's gathers, the reference and the critic when the run has them) and when
(always, or in which phase), the peak against ``--gpu-gib``; then the same for a generator
(weights, KV cache, workspace). The run's knobs are the run schema's defaults, those of
``--run RUN.toml``, and ``key=value`` overrides as ``tools/launch-cluster.py`` takes them
(verl's section names too). ``tools/launch-cluster.py`` warns with the same plan when a
process on this machine's GPUs would not fit. Exit status 0 when every process fits, 1 when
one does not, 2 on a bad argument.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec
from transformers import AutoConfig, PretrainedConfig

from relay.configs.loader import ConfigError, apply_overrides, load
from relay.configs.run_schema import VERL_ALIASES, RunConfig
from relay.configs.topology_schema import (
    GeneratorPlacement,
    LeanOptions,
    LearnerPlacement,
    SGLangOptions,
    Topology,
    VLLMOptions,
)
from relay.launcher.memory import format_plans, plan_run, plans_json

GIB = 1 << 30


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", metavar="MODEL_CONFIG", type=Path,
                        help="a model folder or its config.json")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="run-config overrides, e.g. actor.ppo_max_token_len_per_gpu=16384")
    parser.add_argument("--ranks", type=int, default=8, help="learner ranks (default 8)")
    parser.add_argument("--fsdp-size", type=int, default=-1,
                        help="ranks each model is sharded over (actor.fsdp_config.fsdp_size; "
                             "-1: every rank)")
    parser.add_argument("--gpu-gib", type=float, default=80.0, help="GiB of each GPU")
    parser.add_argument("--run", type=Path, help="a run config whose knobs to plan with")
    parser.add_argument("--engine", default="lean", choices=["lean", "torch", "hf", "vllm",
                                                             "sglang"])
    parser.add_argument("--tensor-parallel", type=int, default=1,
                        help="the generator's tensor_model_parallel_size (vllm, sglang)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                        help="the generator's share of its GPU (lean, vllm, sglang)")
    parser.add_argument("--json", action="store_true", help="print the plans as JSON")
    args = parser.parse_intermixed_args(argv)
    if args.ranks < 1 or args.gpu_gib <= 0 or args.tensor_parallel < 1:
        parser.error("--ranks and --tensor-parallel must be at least 1, --gpu-gib positive")
    if not 0 < args.gpu_memory_utilization <= 1:
        parser.error("--gpu-memory-utilization must be in (0, 1]")
    if not (args.model / "config.json").is_file() and not args.model.is_file():
        parser.error(f"{args.model}: neither a config.json nor a folder holding one")
    if any("=" not in item for item in args.overrides):
        parser.error(f"overrides look like key=value: {args.overrides}")
    return args


def run_config(args: argparse.Namespace, model_dir: Path) -> RunConfig:
    """The run's knobs: ``--run``'s or the schema's defaults, the overrides, and
    ``--fsdp-size``; ``model.path`` is the planned model."""
    overrides = [*args.overrides, f"actor.fsdp_config.fsdp_size={args.fsdp_size}",
                 f"model.path={model_dir}"]
    if args.run is not None:
        return load(RunConfig, args.run, overrides, aliases=VERL_ALIASES)
    data = {"data": {"train_files": []}, "model": {"path": str(model_dir)}}
    apply_overrides(RunConfig, data, overrides, VERL_ALIASES)
    return msgspec.convert(data, type=RunConfig)


def topology(args: argparse.Namespace) -> Topology:
    """The learner's ranks and one generator, each on GPUs."""
    share = args.gpu_memory_utilization
    parallel = dict(gpu_memory_utilization=share, tensor_model_parallel_size=args.tensor_parallel)
    generator = GeneratorPlacement(name="gen0", engine=args.engine, device="cuda",
                                   lean=LeanOptions(gpu_memory_utilization=share),
                                   vllm=VLLMOptions(**parallel), sglang=SGLangOptions(**parallel))
    return Topology(learner=LearnerPlacement(nproc_per_node=args.ranks, device="cuda"),
                    generators=[generator])


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    model_dir = args.model if args.model.is_dir() else args.model.parent
    planned_config = AutoConfig.from_pretrained(args.model)

    def config_of(path: str) -> PretrainedConfig:
        return planned_config if Path(path) == model_dir else AutoConfig.from_pretrained(path)

    try:
        run = run_config(args, model_dir)
        planned = plan_run(run, topology(args), config_of=config_of,
                           gpu_bytes=lambda host, device, gpus: int(args.gpu_gib * GIB))
    except (ConfigError, msgspec.ValidationError, ValueError) as exc:
        print(f"plan-memory: {exc}", file=sys.stderr)
        return 2
    if args.json:
        sys.stdout.buffer.write(plans_json(planned) + b"\n")
    else:
        print(format_plans(planned))
    return 0 if all(p.fits for p in planned) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
