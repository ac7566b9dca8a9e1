"""Launch a Relay run: the buffer, the learner (torchrun) and the generators.

    python tools/launch-cluster.py [TOPOLOGY.toml] [RUN.toml] [key=value ...] [--dry-run]
    python tools/launch-cluster.py --resume RUN_DIR [key=value ...] [--dry-run]

With no config, the embedded default (configs/topology.toml, configs/arithmetic-grpo.toml).
Overrides ``section.key=value`` apply to the run config; ``topology.section.key=value`` to the
topology. verl's key paths work as written (``actor_rollout_ref.actor.clip_ratio_high=0.28``,
``trainer.n_gpus_per_node=8``, Hydra's ``+key=value``): configs/verl-keys.md says what each
becomes. A bad config is refused before anything starts; a process on this machine's GPUs
whose memory plan does not fit its GPU is warned about (``relay.launcher.memory``). ``--dry-run``
prints the resolved configs and the processes that would start, and exits. ``--resume
RUN_DIR`` continues the run in RUN_DIR from its newest complete checkpoint, with the configs
stored there (and any overrides, e.g. more ``trainer.total_training_steps``).
"""

from __future__ import annotations

import argparse
import logging
import sys

from relay.configs import DEFAULT_RUN, DEFAULT_TOPOLOGY, ConfigError
from relay.launcher.memory import memory_warnings
from relay.launcher.resolve import dry_run_report, resolve_launch, resolve_resume

TOPOLOGY_PREFIX = "topology."


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s [TOPOLOGY.toml] [RUN.toml] [key=value ...]\n"
                                           "       %(prog)s --resume RUN_DIR [key=value ...]")
    parser.add_argument("items", nargs="*", metavar="ARG",
                        help="config files (topology first, then run) and key=value overrides")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the resolved configs and the processes, start nothing")
    parser.add_argument("--resume", metavar="RUN_DIR",
                        help="continue the run in RUN_DIR from its newest complete checkpoint")
    args = parser.parse_args(argv)
    files = [a for a in args.items if "=" not in a]
    overrides = [a for a in args.items if "=" in a]
    if len(files) > 2:
        parser.error(f"at most two config files (topology, run); got {files}")
    if args.resume and files:
        parser.error(f"--resume takes the configs stored in the run directory; got {files}")
    args.topology = files[0] if files else str(DEFAULT_TOPOLOGY)
    args.run = files[1] if len(files) > 1 else str(DEFAULT_RUN)
    args.topology_overrides = [o.removeprefix(TOPOLOGY_PREFIX) for o in overrides
                               if o.startswith(TOPOLOGY_PREFIX)]
    args.run_overrides = [o for o in overrides if not o.startswith(TOPOLOGY_PREFIX)]
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="launch-cluster: %(message)s")
    try:
        if args.resume:
            resolved = resolve_resume(args.resume, args.topology_overrides, args.run_overrides)
        else:
            resolved = resolve_launch(args.topology, args.run, args.topology_overrides,
                                      args.run_overrides)
    except ConfigError as exc:
        print(f"launch-cluster: config error: {exc}", file=sys.stderr)
        return 2
    for warning in memory_warnings(resolved.run, resolved.topology, resolved.run_file):
        logging.warning(warning)
    if args.dry_run:
        print(dry_run_report(resolved))
        return 0
    if resolved.run.trainer.resume_mode == "resume_path":
        print(f"launch-cluster: resuming from {resolved.run.trainer.resume_from_path}",
              flush=True)
    from relay.launcher.supervisor import launch

    return launch(resolved)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
