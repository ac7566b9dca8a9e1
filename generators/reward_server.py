"""A reward server: ``python -m relay.generators.reward_server --run-dir RUN_DIR --name rm0``.

One ``[[reward_models]]`` entry of the topology as a process: it loads the run's
discriminative reward model (``reward_model.enable``) and/or LLM judge
(``reward_model.judge``, on any of Relay's engines, vLLM and SGLang included) on its own
device, binds its address (``RunContext.reward_endpoint``: an ``ipc://`` file in the run's
private sockets folder, or ``tcp://host:port`` under CURVE with the run's server keys) and
answers the generators' batched ``ScoreRequest``s (``relay.generators.reward_service``)
until SIGTERM or SIGINT. The launcher starts it before the generators and stops it after
them (``relay.launcher.supervisor``); a bad request is answered with an error and the
server keeps serving. Every ``REPORT_EVERY_S`` it logs what it served and refused.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time

import torch

from relay.configs.rundir import RunContext, configure_logging, load_run_dir
from relay.configs.topology_schema import RewardModelPlacement
from relay.generators.learned_rewards import configured_judge, discriminative_rm
from relay.generators.reward_service import ScoreService
from relay.transport.sockets import Server

logger = logging.getLogger("relay.reward_server")

REPORT_EVERY_S = 60.0
POLL_S = 0.1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m relay.generators.reward_server")
    parser.add_argument("--run-dir", required=True, help="run directory written by the launcher")
    parser.add_argument("--name", required=True,
                        help="the reward server's name in the topology ([[reward_models]])")
    return parser.parse_args(argv)


def placement_of(ctx: RunContext, name: str) -> RewardModelPlacement:
    """The ``[[reward_models]]`` entry ``name``; SystemExit naming the ones there are."""
    placements = {r.name: r for r in ctx.topology.reward_models}
    if name not in placements:
        raise SystemExit(f"relay.generators.reward_server: no [[reward_models]] entry named "
                         f"{name!r} in {ctx.run_dir / 'topology.toml'} (have: "
                         f"{', '.join(placements) or 'none'})")
    return placements[name]


def build_service(ctx: RunContext, placement: RewardModelPlacement) -> ScoreService:
    """The run's reward model and judge, loaded on ``placement``'s device."""
    run = ctx.run
    judge_engine = run.reward_model.judge.engine
    judge = configured_judge(run, placement.engine_placement(judge_engine), run.trainer.seed)
    return ScoreService(discriminative_rm(run, placement.device), judge)


def serve(server: Server, service: ScoreService, stop: threading.Event) -> None:
    """Answer requests until ``stop`` is set, logging the counts now and then."""
    next_report = time.monotonic() + REPORT_EVERY_S
    while not stop.is_set():
        server.serve_once(POLL_S)
        if time.monotonic() >= next_report:
            next_report = time.monotonic() + REPORT_EVERY_S
            logger.info("%d requests served, %d responses scored; refused %s; wire errors %s",
                        server.served, service.scored, dict(service.refused) or "none",
                        dict(server.errors) or "none")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging()
    ctx = load_run_dir(args.run_dir)
    placement = placement_of(ctx, args.name)
    if placement.threads:
        torch.set_num_threads(placement.threads)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    service = build_service(ctx, placement)
    server = Server(ctx.reward_endpoint(args.name), service.handle, keys=ctx.server_keys(),
                    max_message_bytes=ctx.run.buffer.max_message_bytes)
    logger.info("reward server %s serving %s on %s", args.name,
                " and ".join(k for k, v in (("the reward model", service.reward_model),
                                            ("the judge", service.judge)) if v is not None),
                server.endpoint)
    try:
        serve(server, service, stop)
    finally:
        server.close()
    logger.info("reward server %s done: %d requests served, %d responses scored", args.name,
                server.served, service.scored)
    return 0


if __name__ == "__main__":
    sys.exit(main())
