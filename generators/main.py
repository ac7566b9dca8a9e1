"""A generator process: ``python -m relay.generators.main --run-dir RUN_DIR --name gen0``.

Builds the engine named by the topology for this generator, the tokenizer and the reward
scorers (the learned ones in this process, or clients of the topology's ``[[reward_models]]``
servers: ``relay.generators.learned_rewards``), then runs
``relay.generators.process.GeneratorLoop`` until the run ends. Started by the
launcher under a topology name, or with ``--attached`` (``tools/attach-generator.py``) as an
extra generator joining a running job under a name of its own: its engine, device and
threads come from the command line, else from the topology's first generator.

Seeds: the topology's i-th generator draws from ``trainer.seed * 1000 + i``; an attached one
from a hash of its name, never one of those.

``--lineage TOKEN``: the launcher's token for this topology generator, the same for every
process it starts under this name in one launch (``Attach.lineage``). Started again after
its last process died, the generator takes the name that process may still hold at once,
instead of after ``buffer.heartbeat_timeout_s``, on whichever host (``relay.buffer.registry``).
"""

from __future__ import annotations

import argparse
import logging
import re
import signal
import socket
import sys
import threading
import zlib

import msgspec
import torch

from relay.algorithms.rewards.scorer import RewardScorer
from relay.configs.lora_publish import publish_problem, publishes_adapters
from relay.configs.prompt_data import load_prompt_rows
from relay.configs.rundir import RunContext, configure_logging, load_run_dir
from relay.configs.topology_schema import GeneratorPlacement
from relay.generators.build import build_engine
from relay.generators.learned_rewards import generator_scorers
from relay.generators.process import GeneratorLoop, NameInUse
from relay.generators.tool_loop import configured_workflow

logger = logging.getLogger("relay.generator")

EXIT_NAME_IN_USE = 3
LINEAGE = re.compile(r"[0-9a-f]{8,64}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m relay.generators.main")
    parser.add_argument("--run-dir", required=True, help="run directory written by the launcher")
    parser.add_argument("--name", required=True,
                        help="the generator's name in the topology, or with --attached a name "
                             "of its own")
    parser.add_argument("--attached", action="store_true",
                        help="an extra generator, not in the topology, joining the running job")
    parser.add_argument("--engine", help="with --attached: the inference engine")
    parser.add_argument("--device", help="with --attached: the device")
    parser.add_argument("--threads", type=int, help="with --attached: torch threads (0: all)")
    parser.add_argument("--lineage", type=lineage_token, metavar="TOKEN",
                        help="the launcher's token for this topology generator, the same for "
                             "its restarts: a restart takes the name of its dead process at "
                             "once")
    return parser.parse_args(argv)


def lineage_token(text: str) -> str:
    """A lineage token from the command line (8 to 64 lowercase hex digits); argparse names
    the option when it is not one."""
    if not LINEAGE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"a lineage is 8 to 64 lowercase hex digits, not "
                                         f"{text!r}")
    return text


def placement_and_seed(ctx: RunContext, args: argparse.Namespace) -> tuple[GeneratorPlacement, int]:
    """Where and how this generator runs, and its seed (module docstring); SystemExit
    naming the problem when ``--name`` or an option does not fit."""
    placements = {g.name: g for g in ctx.topology.generators}
    base = ctx.run.trainer.seed * 1000
    if not args.attached:
        if args.name not in placements:
            raise SystemExit(f"relay.generators.main: no generator named {args.name!r} in the "
                             f"topology (have: {', '.join(placements)}); an extra generator "
                             "takes --attached")
        return placements[args.name], base + list(placements).index(args.name)
    if args.name in placements:
        raise SystemExit(f"relay.generators.main: {args.name!r} is a topology name; an attached "
                         "generator needs a name of its own")
    return (attached_placement(ctx.topology.generators[0], args),
            attached_seed(args.name, base, len(placements)))


def attached_placement(first: GeneratorPlacement, args: argparse.Namespace) -> GeneratorPlacement:
    """The topology's first generator's placement (``first``) under the attached
    generator's name and host, with the engine, device and threads the command line gives;
    SystemExit naming a value the topology schema refuses."""
    fields = msgspec.structs.asdict(first)
    given = {"engine": args.engine, "device": args.device, "threads": args.threads}
    fields |= {k: v for k, v in given.items() if v is not None}
    fields |= {"name": args.name, "host": socket.gethostname()}
    try:
        return msgspec.convert(fields, GeneratorPlacement)
    except msgspec.ValidationError as exc:
        raise SystemExit(f"relay.generators.main: attached generator {args.name!r}: "
                         f"{exc}") from None


def attached_seed(name: str, base: int, topology_size: int) -> int:
    """A seed drawn from the attached generator's name, never one of the topology's
    generators' (``base`` to ``base + topology_size - 1``)."""
    seed = base + zlib.crc32(name.encode())
    return seed + topology_size if seed < base + topology_size else seed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging()
    ctx = load_run_dir(args.run_dir)
    placement, seed = placement_and_seed(ctx, args)
    if placement.threads:
        torch.set_num_threads(placement.threads)
    run = ctx.run
    problem = publish_problem(run, ctx.topology, placement, f"generator {args.name!r}")
    if problem:
        raise SystemExit(f"relay.generators.main: {problem}")
    engine, tokenizer = build_engine(run.model, placement, seed,
                                     max_num_seqs=run.rollout.max_num_seqs,
                                     max_len=run.data.max_prompt_length
                                     + run.rollout.response_length,
                                     lora_adapters=publishes_adapters(run, ctx.topology))
    try:
        learned = generator_scorers(ctx, placement, seed)
    except ValueError as exc:  # a vLLM judge beside this vLLM engine: vllm_clash
        raise SystemExit(f"relay.generators.main: generator {args.name!r}: {exc}") from None
    scorer = RewardScorer(run.custom_reward_function, run.sandbox)
    scorer.check_data_sources({row.data_source for row in load_prompt_rows(
        run.data.train_files, prompt_key=run.data.prompt_key)})
    loop = GeneratorLoop(generator_id=args.name, buffer_endpoint=ctx.buffer_endpoint,
                         weights_endpoint=ctx.weights_endpoint,
                         weights_stream_endpoint=ctx.weights_stream_endpoint, engine=engine,
                         tokenizer=tokenizer, scorer=scorer, rollout=run.rollout,
                         data=run.data, buffer=run.buffer,
                         overlong=run.reward_model.overlong_buffer, seed=seed,
                         keys=ctx.client_keys(), workflow=configured_workflow(run.rollout),
                         lineage=args.lineage or "",
                         reward_model=learned.reward_model, judge=learned.judge)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        with scorer:
            loop.run(stop)
    except NameInUse as exc:
        logger.error("generator %s not started: %s", args.name, exc)
        return EXIT_NAME_IN_USE
    finally:
        learned.close()
    logger.info("generator %s done", args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
