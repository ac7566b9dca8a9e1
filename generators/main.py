"""A generator process: ``python -m generators.main --run-dir RUN_DIR --name gen0``.

Builds the engine named by the topology for this generator, the tokenizer and the reward
scorer, then runs ``generators.process.GeneratorLoop`` until the run ends. Started by the
launcher, or by hand to attach an extra generator to a running job.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

import torch
from transformers import AutoTokenizer, GenerationConfig

from algorithms.rewards.config import RewardConfig
from algorithms.rewards.scorer import RewardScorer
from buffer.dataset import load_prompt_rows
from configs.rundir import RunContext, configure_logging, load_run_dir
from configs.topology_schema import GeneratorPlacement
from generators.engine import Engine
from generators.hf_engine import HFEngine
from generators.process import GeneratorLoop, GeneratorSettings
from generators.sampling import SamplingParams
from generators.torch_engine import TorchEngine

logger = logging.getLogger("relay.generator")

ENGINES = {"torch": TorchEngine, "hf": HFEngine}
GPU_ENGINES = {"vllm": "vllm", "sglang": "sglang"}


class EngineUnavailable(RuntimeError):
    """The topology asks for an engine this installation cannot run."""


def eos_and_pad(model_path: str, tokenizer) -> tuple[list[int], int]:
    """All eos ids (tokenizer and generation config) and the pad id (eos if none)."""
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        generation = GenerationConfig.from_pretrained(model_path)
        extra = generation.eos_token_id
        eos.update(extra if isinstance(extra, list) else [extra] if extra is not None else [])
    except OSError:
        pass  # no generation_config.json: the tokenizer's eos is all there is
    if not eos:
        raise ValueError(f"{model_path}: the tokenizer has no eos token; generation could not stop")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    return sorted(eos), pad


def build_engine(ctx: RunContext, placement: GeneratorPlacement,
                 seed: int) -> tuple[Engine, object]:
    name = placement.engine
    if name in GPU_ENGINES:
        raise EngineUnavailable(
            f"generator {placement.name}: engine {name!r} is not implemented in this version of "
            f"Relay; use engine = \"torch\" or \"hf\"")
    model = ctx.run.model
    tokenizer = AutoTokenizer.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
    eos, pad = eos_and_pad(model.path, tokenizer)
    engine = ENGINES[name].from_pretrained(model.path, dtype=getattr(torch, model.dtype),
                                           device=placement.device, eos_ids=eos, pad_id=pad,
                                           seed=seed, trust_remote_code=model.trust_remote_code)
    return engine, tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m generators.main")
    parser.add_argument("--run-dir", required=True, help="run directory written by the launcher")
    parser.add_argument("--name", required=True, help="the generator's name in the topology")
    args = parser.parse_args(argv)
    configure_logging()
    ctx = load_run_dir(args.run_dir)
    placements = {g.name: g for g in ctx.topology.generators}
    if args.name not in placements:
        logger.error("no generator named %r in the topology (have: %s)", args.name,
                     ", ".join(placements))
        return 2
    placement = placements[args.name]
    if placement.threads:
        torch.set_num_threads(placement.threads)
    run = ctx.run
    seed = run.trainer.seed * 1000 + list(placements).index(args.name)
    engine, tokenizer = build_engine(ctx, placement, seed)
    reward = run.custom_reward_function
    spec = f"{reward.path}:{reward.name}" if reward.path else ""
    scorer = RewardScorer(RewardConfig(custom_function=spec, timeout_s=reward.timeout_s))
    scorer.check_data_sources({row.data_source for row in load_prompt_rows(run.data.train_files)})
    params = SamplingParams(max_new_tokens=run.rollout.response_length,
                            temperature=run.rollout.temperature, top_p=run.rollout.top_p,
                            top_k=run.rollout.top_k)
    settings = GeneratorSettings(generator_id=args.name, buffer_endpoint=ctx.buffer_endpoint,
                                 weights_endpoint=ctx.weights_endpoint, params=params,
                                 max_prompt_length=run.data.max_prompt_length,
                                 overlong=run.reward_model.overlong_buffer)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with scorer:
        GeneratorLoop(settings, engine, tokenizer, scorer, keys=ctx.client_keys()).run(stop)
    logger.info("generator %s done", args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
