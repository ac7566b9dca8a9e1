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

from algorithms.rewards.scorer import RewardScorer
from buffer.dataset import load_prompt_rows
from configs.rundir import configure_logging, load_run_dir
from generators.build import build_engine
from generators.process import GeneratorLoop

logger = logging.getLogger("relay.generator")


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
    engine, tokenizer = build_engine(run.model, placement.engine, placement.device, seed,
                                     max_num_seqs=run.rollout.max_num_seqs,
                                     max_len=run.data.max_prompt_length
                                     + run.rollout.response_length)
    scorer = RewardScorer(run.custom_reward_function)
    scorer.check_data_sources({row.data_source for row in load_prompt_rows(run.data.train_files)})
    loop = GeneratorLoop(generator_id=args.name, buffer_endpoint=ctx.buffer_endpoint,
                         weights_endpoint=ctx.weights_endpoint, engine=engine,
                         tokenizer=tokenizer, scorer=scorer, rollout=run.rollout,
                         max_prompt_length=run.data.max_prompt_length,
                         overlong=run.reward_model.overlong_buffer,
                         patience_s=run.buffer.client_patience_s, seed=seed,
                         keys=ctx.client_keys())
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with scorer:
        loop.run(stop)
    logger.info("generator %s done", args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
