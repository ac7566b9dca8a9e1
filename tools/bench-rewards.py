#!/usr/bin/env python3
"""Reward scoring throughput: in-process rule vs the isolated worker, side by side.

    python tools/bench-rewards.py [--group 8] [--groups 2000] [--chars 400]

Scores groups of arithmetic completions (a few hundred characters of reasoning, then an
``<answer>``) through ``RewardScorer`` both ways, after a warm-up, and prints samples/s
and their ratio. Also prints the worker's start-up time (what a timeout's respawn costs).
"""

from __future__ import annotations

import argparse
import random
import time

from relay.algorithms.rewards import RewardConfig, RewardItem, RewardScorer


def make_groups(groups: int, size: int, chars: int, seed: int = 0) -> list[list[RewardItem]]:
    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        truth = rng.randint(-9999, 9999)
        out.append([
            RewardItem("relay/arithmetic",
                       "x" * chars + f"<answer>{truth + rng.choice((0, 1))}</answer>", str(truth))
            for _ in range(size)
        ])
    return out


def samples_per_second(scorer: RewardScorer, groups: list[list[RewardItem]]) -> float:
    for group in groups[:20]:  # warm-up
        scorer.score(group)
    start = time.perf_counter()
    for group in groups:
        scorer.score(group)
    return sum(map(len, groups)) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--group", type=int, default=8, help="completions per group")
    parser.add_argument("--groups", type=int, default=2000, help="groups to score")
    parser.add_argument("--chars", type=int, default=400, help="characters per completion")
    args = parser.parse_args()
    groups = make_groups(args.groups, args.group, args.chars)

    with RewardScorer(RewardConfig(in_process_builtins=True)) as scorer:
        local = samples_per_second(scorer, groups)
    start = time.perf_counter()
    with RewardScorer(RewardConfig(in_process_builtins=False)) as scorer:
        scorer.check_data_sources(["relay/arithmetic"])  # starts the worker
        startup = time.perf_counter() - start
        remote = samples_per_second(scorer, groups)

    print(f"arithmetic, groups of {args.group}, {args.chars} chars per completion")
    print(f"  in-process : {local:12,.0f} samples/s")
    print(f"  worker     : {remote:12,.0f} samples/s")
    print(f"  ratio      : {local / remote:12.1f} x")
    print(f"  worker start-up: {startup:.2f} s")


if __name__ == "__main__":
    main()
