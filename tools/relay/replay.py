"""Replay a run's recorded batches through its learner, offline, and compare with the run.

    python tools/replay-rollouts.py RUN_DIR [--from-step A] [--to-step B] [--tolerance R]

Trains the run's learner (its config, one rank, no generators, no buffer) on exactly the
groups each recorded step trained on, from the newest checkpoint before step A (or the
initial weights), and prints per step the loss, KL and grad norm next to what the live run
logged to MLflow (``relay.learner.replay``). ``--tolerance R`` exits 1 when a step's metrics
differ from the live run's by more than R (relative). A checkpoint it refuses to load (one
whose metadata asks to run code, say) ends it with exit code 2 and the reason.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys

from relay.configs import ConfigError
from relay.configs.rundir import configure_logging, load_run_dir
from relay.learner.checkpoint_files import CheckpointError
from relay.learner.replay import ReplayError, StepComparison, replay


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory to replay")
    parser.add_argument("--from-step", type=int, default=1, metavar="A",
                        help="the first step to compare (default 1)")
    parser.add_argument("--to-step", type=int, default=0, metavar="B",
                        help="the last step to replay (default: the last one recorded)")
    parser.add_argument("--tolerance", type=float, default=None, metavar="R",
                        help="exit 1 when a step differs from the live run by more than R "
                             "(relative)")
    parser.add_argument("--mlflow-run-id", default="",
                        help="the live run's MLflow run (default: found by the run directory)")
    return parser.parse_args(argv)


def row(comparison: StepComparison) -> str:
    cells = [f"{comparison.step:>5}"]
    for name, value in comparison.replayed.items():
        live = comparison.live[name]
        shown = "-" if math.isnan(live) else f"{live:.6g}"
        cells.append(f"{name.removeprefix('actor/')} {value:.6g} (live {shown})")
    return "  ".join(cells)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    configure_logging()
    for noisy in ("mlflow", "alembic", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        ctx = load_run_dir(args.run_dir)
        worst, compared = 0.0, 0
        for comparison in replay(ctx, args.from_step, args.to_step, run_id=args.mlflow_run_id):
            print(row(comparison), flush=True)
            if comparison.step >= args.from_step:
                worst = max(worst, comparison.worst_relative_difference())
                compared += 1
    except (ReplayError, CheckpointError, ConfigError, FileNotFoundError) as exc:
        print(f"relay replay: {exc}", file=sys.stderr)
        return 2
    print(f"replayed {compared} steps; the largest relative difference from the live run is "
          f"{worst:.3g}")
    if args.tolerance is not None and worst > args.tolerance:
        print(f"relay replay: differs from the live run by more than {args.tolerance:g}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
