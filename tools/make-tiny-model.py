#!/usr/bin/env python
"""Build Relay's tiny default model (a Llama warm-started on the arithmetic task).

    python tools/make-tiny-model.py                      # ~/.cache/relay/models/tiny-arith-r3
    python tools/make-tiny-model.py --out /tmp/tiny --seed 1 --force
    python tools/make-tiny-model.py --variant tools      # ~/.cache/relay/models/tiny-arith-tools-r1

Prints the build time, parameter count and held-out accuracy (greedy, and sampled pass@1 /
pass@8 on configs/data/arithmetic-test.jsonl). Exits 1 if the greedy accuracy falls
outside the 5-60% band that leaves the RL stage something to learn, 2 if --out is not a
model directory it may replace.

``--variant tools`` builds ``builtin:tiny-arith-tools``, which calls a calculator tool on
part of its answers, and prints its tool-call rate and its held-out accuracy with the calls
executed (relay.generators.tools' hermes parser and calculator) and without, greedy and
sampled (configs/data/arithmetic-tools-test.jsonl); exits 1 if the sampled accuracy with
tools falls outside the 10-50% band (RL should lift it by raising tool use).
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

from relay.generators.tools.calculator import reply_to  # noqa: E402
from relay.learner.tiny_model.build import (  # noqa: E402
    ToolBuildReport,
    build_tiny_model,
    build_tools_model,
    default_model_dir,
)
from relay.learner.tiny_model.tool_warm_start import ToolWarmStartConfig  # noqa: E402
from relay.learner.tiny_model.warm_start import WarmStartConfig  # noqa: E402

ACCURACY_BAND = (0.05, 0.60)
TOOLS_ACCURACY_BAND = (0.10, 0.50)
BUILTIN_NAMES = {"arith": "tiny-arith", "tools": "tiny-arith-tools"}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.out is None:
        args.out = default_model_dir(BUILTIN_NAMES[args.variant])
    if args.steps is None:
        args.steps = (ToolWarmStartConfig().optim.steps if args.variant == "tools"
                      else WarmStartConfig.steps)
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
            if args.variant == "tools":
                return _report_tools(build_tools_model(
                    args.out, reply_to, seed=args.seed, overwrite=True, on_step=on_step,
                    recipe=ToolWarmStartConfig(optim=WarmStartConfig(steps=args.steps)),
                ))
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


def _report_tools(report: ToolBuildReport) -> int:
    heldout = report.heldout
    print(f"built {report.path} in {report.seconds:.0f} s ({report.warm_start_steps} warm-start "
          f"steps in {report.warm_start_seconds:.0f} s, final loss {report.final_loss:.3f})\n"
          f"parameters: {report.params:,}\nheld-out ({heldout.problems} problems):")
    for name, d in (("greedy", heldout.greedy), (f"sampled x{heldout.sampled.samples}, T=1",
                                                   heldout.sampled)):
        print(f"  {name}: tool-call rate {d.tool_call_rate:.1%}, accuracy with tools "
              f"{d.accuracy:.1%} (when called {d.accuracy_when_called:.1%}), without tools "
              f"{d.accuracy_without_tools:.1%}")
    low, high = TOOLS_ACCURACY_BAND
    if not low <= heldout.sampled.accuracy <= high:
        print(f"sampled accuracy with tools outside the {low:.0%}-{high:.0%} band",
              file=sys.stderr)
        return 1
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", choices=sorted(BUILTIN_NAMES), default="arith",
                        help="arith: builtin:tiny-arith; tools: builtin:tiny-arith-tools")
    parser.add_argument("--out", type=Path, help="model directory (default: the launcher's "
                                                 "cache of the variant)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, help="warm-start steps (default: the recipe's)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--force", action="store_true", help="rebuild an existing --out")
    return parser


if __name__ == "__main__":
    sys.exit(main())
