#!/usr/bin/env python3
"""The local sandbox's warm pool against a cold interpreter start, side by side in one run.

    tools/with-venv python tools/bench-sandbox.py [--runs 1000] [--workers 4] [--cold 50]

Runs ``print(1)`` ``--runs`` times through ``LocalSandbox`` with ``--workers`` programs in
flight (as many threads submitting as workers), then ``--cold`` times as
``subprocess.run([sys.executable, "-c", "print(1)"])`` one after another, and prints
executions per second, median and p95 latency of each, and their ratio. Every pool run
must end "ok" with stdout "1"; one that does not stops the benchmark.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time

from relay.algorithms.sandbox.local import LocalSandbox


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def bench_pool(runs: int, workers: int) -> tuple[float, list[float]]:
    """(executions per second, per-execution latencies in seconds)."""
    latencies: list[float] = []
    lock = threading.Lock()
    todo = iter(range(runs))
    with LocalSandbox(workers=workers) as box:
        box.run("print(1)")  # the zygote is up; the first fork is not measured apart

        def worker() -> None:
            while True:
                with lock:
                    if next(todo, None) is None:
                        return
                start = time.perf_counter()
                result = box.run("print(1)")
                took = time.perf_counter() - start
                if (result.status, result.stdout) != ("ok", "1\n"):
                    raise SystemExit(f"a pool run failed: {result}")
                with lock:
                    latencies.append(took)

        threads = [threading.Thread(target=worker) for _ in range(workers)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - start
    if len(latencies) != runs:
        raise SystemExit(f"only {len(latencies)} of {runs} pool runs finished")
    return runs / elapsed, latencies


def bench_cold(runs: int) -> tuple[float, list[float]]:
    latencies = []
    start = time.perf_counter()
    for _ in range(runs):
        began = time.perf_counter()
        subprocess.run([sys.executable, "-c", "print(1)"], check=True, capture_output=True)
        latencies.append(time.perf_counter() - began)
    return runs / (time.perf_counter() - start), latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--cold", type=int, default=50)
    args = parser.parse_args()
    pool_rate, pool = bench_pool(args.runs, args.workers)
    cold_rate, cold = bench_cold(args.cold)
    print(f"{'':28}{'exec/s':>9}{'median ms':>11}{'p95 ms':>9}")
    for name, rate, lat in ((f"pool ({args.runs} runs, {args.workers} workers)", pool_rate,
                             pool), (f"cold subprocess ({args.cold} runs)", cold_rate, cold)):
        print(f"{name:28}{rate:9.1f}{statistics.median(lat) * 1e3:11.2f}"
              f"{percentile(lat, 0.95) * 1e3:9.2f}")
    print(f"pool / cold: {pool_rate / cold_rate:.1f}x the rate, "
          f"{statistics.median(cold) / statistics.median(pool):.1f}x lower median latency")


if __name__ == "__main__":
    main()
