#!/usr/bin/env python
"""Build Relay's tiny default model (a Llama warm-started on the arithmetic task).

    python tools/make-tiny-model.py                      # ~/.cache/relay/models/tiny-arith-r3
    python tools/make-tiny-model.py --out /tmp/tiny --seed 1 --force

Prints the build time, parameter count and held-out accuracy (greedy, and sampled pass@1 /
pass@8 on configs/data/arithmetic-test.jsonl). Exits 1 if the greedy accuracy falls
outside the 5-60% band that leaves the RL stage something to learn, 2 if --out is not a
model directory it may replace.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# Before torch loads OpenMP: spinning worker threads on a machine whose cores are busy with
# other processes made warm-start steps 6-15x slower in measurements here; sleeping ones
# cost little. Set OMP_WAIT_POLICY yourself to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402 (after the environment above)
from tqdm import tqdm  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from relay.learner.tiny_model.build import build_tiny_model, default_model_dir  # noqa: E402
from relay.learner.tiny_model.warm_start import WarmStartConfig  # noqa: E402

ACCURACY_BAND = (0.05, 0.60)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.out.exists() and not args.force:
        print(f"{args.out} already exists (use --force to rebuild it)")
        return 0
    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()  # one bar for the warm start, none for loading/saving
    with tqdm(total=args.steps, desc="warm start", unit="step") as bar:

        def on_step(step: int, loss: float) -> None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)

        try:
            report = build_tiny_model(
                args.out,
                seed=args.seed,
                warm_start_steps=args.steps,
                overwrite=True,
                on_step=on_step,
            )
        except FileExistsError as error:
            print(f"make-tiny-model: {error}", file=sys.stderr)
            return 2
    print(
        f"built {report.path} in {report.seconds:.0f} s "
        f"({report.warm_start_steps} warm-start steps in {report.warm_start_seconds:.0f} s, "
        f"final loss {report.final_loss:.3f})\n"
        f"parameters: {report.params:,}\n"
        f"held-out ({report.eval_problems} problems): "
        f"greedy accuracy {report.heldout_accuracy:.1%}, "
        f"sampled pass@1 {report.pass_at_1:.1%}, pass@{report.k} {report.pass_at_k:.1%}"
    )
    low, high = ACCURACY_BAND
    if not low <= report.heldout_accuracy <= high:
        print(f"greedy accuracy outside the {low:.0%}-{high:.0%} band", file=sys.stderr)
        return 1
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=default_model_dir(), help="model directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=WarmStartConfig.steps, help="warm-start steps")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--force", action="store_true", help="rebuild an existing --out")
    return parser


if __name__ == "__main__":
    sys.exit(main())
