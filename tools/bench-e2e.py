#!/usr/bin/env python3
"""Relay against TRL's synchronous GRPOTrainer on the same work, side by side in one run.

    tools/with-venv python tools/bench-e2e.py [--steps 400] [--test-freq 10] [--seed 0]
        [--only relay|trl] [--relay-arg key=value ...] [--target 0.5] [--repeats 1]
        [--out bench-e2e.json]
    tools/with-venv python tools/bench-e2e.py --sweep-staleness 0 1 2 --seeds 0 1 2
    tools/with-venv python tools/bench-e2e.py --throughput [--steps 12] [--dtype bfloat16]
        [--compile] [--repeats 1]

Runs, one after the other (never together: they would share the cores), (a) TRL's
``GRPOTrainer`` through ``tools/trl_grpo.py`` and (b) Relay's default run,
``tools/launch-cluster.py trainer.total_training_steps=STEPS trainer.test_freq=FREQ``
(plus ``--relay-arg`` overrides), both on the embedded default task (tiny model, arithmetic,
32 prompts x 8 samples a step, same hyper-parameters; ``tools/trl_grpo.py`` lists the few
differences). The TRL side needs ``trl`` (``pip install -e '.[bench]'``). TRL runs in
the environment its users give it: without ``OMP_WAIT_POLICY``, which ``tools/with-venv``
and Relay's launcher set to ``PASSIVE`` for Relay's processes (they share the cores), and
which makes TRL's one process about 25% slower a step on a 2-core machine (measured
2026-11-26: 0.61 s against 0.79 s on the embedded default), unless ``--trl-omp-wait-policy``
names a value for it.

Measured, per system, from TRL's JSON lines and from Relay's MLflow store
(``RUN_DIR/mlflow.db``):

- seconds per step: the median over the steps after the first 5 (warm-up); TRL's is the
  wall-clock of its synchronous step (generate, score, train), Relay's the learner's
  ``perf/step_seconds``; held-out evaluation is in neither (TRL's callback time is taken
  out; Relay's evaluator is a process of its own, beside training);
- generated tokens/s: completion tokens (up to and including eos) per second of training
  wall-clock, cumulative; for Relay both that (``rollout/response_length_mean`` x the
  samples of a step / ``perf/step_seconds``, summed) and the median of the generators' own
  ``perf/generator_tokens_per_s``;
- held-out greedy accuracy (all test problems, Relay's evaluation) at the start, at the end
  and at its peak, and the training seconds to the first evaluation at or above
  ``--target`` (50% by default).

Then the ratios Relay/TRL: the speed-up (TRL s/step over Relay s/step) and TRL's time to
the target over Relay's. ``--repeats K`` runs the pair K times (TRL, Relay, TRL, Relay, ...:
the machine's noise hits both alike), prints each pair's table and ratios, and at the end
every ratio per pair and its median (with ``--throughput`` too); the JSON holds every
pair's series.

``--sweep-staleness`` runs Relay alone, once per staleness bound eta
(``buffer.max_staleness``) and seed, and prints per eta the median seconds per step, the
held-out accuracy (mean over seeds) at fixed training times and at the last step, and the
mean time to the target, so the default eta can be the one that gets there first. The
per-step series of both go to ``--out`` as JSON, for curves.

``--throughput`` compares speed where compute, not per-call overhead, dominates: both
systems train a randomly initialised 24M-parameter Qwen2 (``tools/bench_model.py``, built
and cached on first use) for ``--steps`` steps (12 by default) on ``--prompts-per-step``
prompts x 8 samples of up to ``--response-length`` tokens, in ``--dtype`` (bf16 by default:
Relay's learner computes in bf16 over fp32 master weights, TRL autocasts), with a reward
that is a hash of the response (``tools/bench_reward.py``: every group has spread, so every
row trains) and no evaluation; Relay's learner gets 2 threads there (TRL has 2), the
generator 1. It prints seconds per step, generated tokens/s (completion tokens of a step
over its seconds) and learner tokens/s (prompt + completion tokens trained per
second of the update: Relay's ``perf/learner_tokens_per_s``; TRL's step less the time in
``generate``), medians after the first step, and the ratios. ``--compile`` compiles on
both sides: Relay's ``actor.use_torch_compile=true``, TRL's ``--torch-compile``
(``TrainingArguments.torch_compile``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec

from relay.configs import load_run_config
from relay.configs.rundir import RESOLVED_RUN

ROOT = Path(__file__).resolve().parent.parent
WARMUP_STEPS = 5  # left out of the median seconds per step
THROUGHPUT_LEARNER_THREADS = 2  # Relay's learner in --throughput (the generator keeps 1)
RUN_DIR_LINE = re.compile(r"relay launch: trained \d+ steps; results in (.+)$")


class Series(msgspec.Struct, kw_only=True):
    """One system's run: per-step series and held-out evaluations on its training clock."""

    system: str
    step_seconds: list[float]  # of steps 1..N
    completion_tokens: list[float]  # generated in each step
    evals: list[tuple[int, float, float]]  # (step, training seconds at that step, accuracy)
    generator_tokens_per_s: list[float] = []  # Relay: the generators' own rate, per step
    # prompt + completion tokens trained per second of the update, per step
    learner_tokens_per_s: list[float] = []
    reward_mean: list[float] = []  # per step
    source: str = ""  # Relay's run directory


class Summary(msgspec.Struct, kw_only=True):
    """The numbers of the table for one system."""

    system: str
    steps: int
    seconds_per_step: float  # median after warm-up
    tokens_per_s: float  # cumulative completion tokens / cumulative training seconds
    generator_tokens_per_s: float | None  # Relay: median of perf/generator_tokens_per_s
    accuracy_start: float
    accuracy_end: float
    accuracy_peak: float
    seconds_to_target: float | None  # training seconds to the first accuracy >= target


# -- running the two systems -----------------------------------------------------------


def run_trl(args: argparse.Namespace, extra: list[str] = ()) -> Series:
    """Train with TRL's GRPOTrainer in a subprocess and read its JSON lines."""
    command = [sys.executable, str(ROOT / "tools" / "trl_grpo.py"), "--steps", str(args.steps),
               "--test-freq", str(args.test_freq), "--seed", str(args.seed), *extra]
    env = {name: value for name, value in os.environ.items() if name != "OMP_WAIT_POLICY"}
    if args.trl_omp_wait_policy:
        env["OMP_WAIT_POLICY"] = args.trl_omp_wait_policy
    print(f"bench-e2e: TRL (OMP_WAIT_POLICY={env.get('OMP_WAIT_POLICY', 'unset')}): "
          f"{' '.join(command)}", flush=True)
    events = []
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True,
                          env=env) as proc:
        for line in proc.stdout:
            if not line.startswith('{"event"'):
                continue
            event = json.loads(line)
            events.append(event)
            if event["event"] == "eval":
                print(f"  TRL step {event['step']}: held-out accuracy {event['accuracy']:.1%} "
                      f"after {event['train_seconds']:.0f} s", flush=True)
    if proc.returncode != 0:
        sys.exit(f"bench-e2e: tools/trl_grpo.py failed (exit code {proc.returncode})")
    return trl_series(events)


def trl_series(events: list[dict[str, Any]]) -> Series:
    """The per-step series of ``tools/trl_grpo.py``'s events (cumulative counters)."""
    steps = [e for e in events if e["event"] == "step"]
    seconds = differences([e["train_seconds"] for e in steps])
    tokens = [e["generated_tokens"] for e in steps]
    trained = differences([e["trained_tokens"] for e in steps])
    generating = differences([e["generation_seconds"] for e in steps])
    return Series(system="TRL", step_seconds=seconds,
                  completion_tokens=differences(tokens),
                  learner_tokens_per_s=[n / max(total - g, 1e-9)
                                        for n, total, g in zip(trained, seconds, generating)],
                  evals=[(e["step"], e["train_seconds"], e["accuracy"])
                         for e in events if e["event"] == "eval"],
                  reward_mean=[e["reward_mean"] for e in steps])


def run_relay(args: argparse.Namespace, extra: list[str] = ()) -> Series:
    """Launch Relay's default run, wait for it, read its MLflow store."""
    command = [sys.executable, str(ROOT / "tools" / "launch-cluster.py"),
               f"trainer.total_training_steps={args.steps}", f"trainer.test_freq={args.test_freq}",
               f"trainer.seed={args.seed}", f"data.seed={args.seed}", *extra, *args.relay_arg]
    print(f"bench-e2e: Relay: {' '.join(command)}", flush=True)
    run_dir = None
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True) as proc:
        for line in proc.stdout:
            print(f"  {line.rstrip()}", flush=True)
            match = RUN_DIR_LINE.search(line.strip())
            run_dir = Path(match.group(1)) if match else run_dir
    if proc.returncode != 0 or run_dir is None:
        sys.exit(f"bench-e2e: launch-cluster failed (exit code {proc.returncode}); see above")
    return relay_series(run_dir)


def relay_series(run_dir: Path) -> Series:
    """The per-step series of a finished Relay run, from its MLflow store and run config."""
    from mlflow.tracking import MlflowClient

    run = load_run_config(run_dir / RESOLVED_RUN)
    samples_per_step = run.data.train_batch_size * run.rollout.n
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    if len(runs) != 1:
        sys.exit(f"bench-e2e: {run_dir / 'mlflow.db'} holds {len(runs)} runs, expected one")
    run_id = runs[0].info.run_id

    def history(key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run_id, key)}

    step_seconds = history("perf/step_seconds")
    steps = sorted(step_seconds)
    if steps != list(range(1, len(steps) + 1)):
        sys.exit(f"bench-e2e: {run_dir}: perf/step_seconds misses steps")
    lengths, rates = history("rollout/response_length_mean"), history("perf/generator_tokens_per_s")
    rewards, learner = history("rollout/reward_mean"), history("perf/learner_tokens_per_s")
    clock = cumulative([step_seconds[s] for s in steps])
    return Series(system="Relay", step_seconds=[step_seconds[s] for s in steps],
                  completion_tokens=[lengths[s] * samples_per_step for s in steps],
                  evals=[(s, clock[s - 1] if s else 0.0, a)
                         for s, a in sorted(history("eval/accuracy").items())],
                  generator_tokens_per_s=[rates[s] for s in steps],
                  learner_tokens_per_s=[learner[s] for s in steps],
                  reward_mean=[rewards[s] for s in steps], source=str(run_dir))


# -- numbers -----------------------------------------------------------------------------


def differences(cumulative_values: list[float]) -> list[float]:
    """Per-step increments of a cumulative series."""
    return [b - a for a, b in zip([0.0, *cumulative_values], cumulative_values)]


def cumulative(values: list[float]) -> list[float]:
    total, out = 0.0, []
    for value in values:
        total += value
        out.append(total)
    return out


def after_warmup(values: list[float]) -> list[float]:
    """The values after the warm-up steps (all but the first, for runs too short to have
    any after them)."""
    return values[WARMUP_STEPS:] if len(values) > WARMUP_STEPS else values[1:] or values


def seconds_to(evals: list[tuple[int, float, float]], target: float) -> float | None:
    """Training seconds at the first evaluation at or above ``target``, if any."""
    return next((seconds for _, seconds, accuracy in evals if accuracy >= target), None)


def summarize(series: Series, target: float) -> Summary:
    if not series.step_seconds or not series.evals:
        sys.exit(f"bench-e2e: {series.system} reported no steps or no evaluation")
    accuracies = [accuracy for _, _, accuracy in series.evals]
    rates = after_warmup(series.generator_tokens_per_s)
    return Summary(system=series.system, steps=len(series.step_seconds),
                   seconds_per_step=statistics.median(after_warmup(series.step_seconds)),
                   tokens_per_s=sum(series.completion_tokens) / sum(series.step_seconds),
                   generator_tokens_per_s=statistics.median(rates) if rates else None,
                   accuracy_start=accuracies[0], accuracy_end=accuracies[-1],
                   accuracy_peak=max(accuracies),
                   seconds_to_target=seconds_to(series.evals, target))


# -- report ------------------------------------------------------------------------------


def seconds_text(seconds: float | None) -> str:
    return "not reached" if seconds is None else f"{seconds:.1f} s"


def print_table(summaries: list[Summary], target: float) -> None:
    warmup = f"median, steps after the first {WARMUP_STEPS}"
    rows = [
        (f"seconds per step ({warmup})", lambda s: f"{s.seconds_per_step:.3f}"),
        ("generated tokens/s (completion tokens / training s)", lambda s: f"{s.tokens_per_s:,.0f}"),
        (f"generators' own tokens/s ({warmup})",
         lambda s: "-" if s.generator_tokens_per_s is None else f"{s.generator_tokens_per_s:,.0f}"),
        ("held-out accuracy at start", lambda s: f"{s.accuracy_start:.1%}"),
        ("held-out accuracy at end", lambda s: f"{s.accuracy_end:.1%}"),
        ("held-out accuracy, peak", lambda s: f"{s.accuracy_peak:.1%}"),
        (f"training time to {target:.0%} held-out accuracy",
         lambda s: seconds_text(s.seconds_to_target)),
    ]
    width = max(len(label) for label, _ in rows)
    print(f"\n{'':<{width}}  " + "  ".join(f"{s.system:>12}" for s in summaries))
    print(f"{'steps':<{width}}  " + "  ".join(f"{s.steps:>12}" for s in summaries))
    for label, cell in rows:
        print(f"{label:<{width}}  " + "  ".join(f"{cell(s):>12}" for s in summaries))


def comparison_ratios(relay: Summary, trl: Summary) -> dict[str, float | None]:
    """Relay's advantage: TRL's seconds per step over Relay's, and TRL's training time to
    the target over Relay's (None when either never reached it)."""
    to_target = None
    if relay.seconds_to_target is not None and trl.seconds_to_target is not None:
        to_target = trl.seconds_to_target / max(relay.seconds_to_target, 1e-9)
    return {"speed-up a step": trl.seconds_per_step / relay.seconds_per_step,
            "time to target": to_target}


def print_ratios(relay: Summary, trl: Summary, target: float) -> None:
    ratios = comparison_ratios(relay, trl)
    print(f"\nRelay/TRL speed-up (TRL s/step / Relay s/step): {ratios['speed-up a step']:.2f}x")
    if ratios["time to target"] is None:
        print(f"time to {target:.0%}: TRL {seconds_text(trl.seconds_to_target)}, "
              f"Relay {seconds_text(relay.seconds_to_target)}: no ratio")
    else:
        print(f"time to {target:.0%} (TRL / Relay): {ratios['time to target']:.2f}x")


def print_repeats(ratios: list[dict[str, float | None]]) -> None:
    """Each ratio per pair of runs, and its median over the pairs that have it."""
    print(f"\nover {len(ratios)} pairs of runs (Relay's advantage; median of the pairs):")
    width = max(len(name) for name in ratios[0])
    for name in ratios[0]:
        values = [r[name] for r in ratios]
        measured = [v for v in values if v is not None]
        median = f"{statistics.median(measured):.2f}x" if measured else "-"
        cells = ", ".join("-" if v is None else f"{v:.2f}x" for v in values)
        print(f"  {name:<{width}}  median {median}  ({cells})")


def write_record(path: str, header: dict[str, Any], pairs: list[dict[str, Any]]) -> None:
    """The JSON record: ``header``, then one pair's fields beside it, or ``pairs`` (a list
    of them) once there are several (``--repeats``). Written after every pair, so an
    interrupted run keeps the pairs it finished."""
    body = pairs[0] if len(pairs) == 1 else {"pairs": pairs}
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode({**header, **body})))


def accuracy_at(evals: list[tuple[int, float, float]], seconds: float) -> float | None:
    """The last held-out accuracy measured by training time ``seconds``."""
    measured = [accuracy for _, at, accuracy in evals if at <= seconds]
    return measured[-1] if measured else None


def sweep_staleness(args: argparse.Namespace) -> None:
    """Relay once per eta and seed; a table of accuracy against training time per eta."""
    runs: dict[int, list[Series]] = {}
    for eta in args.sweep_staleness:
        for seed in args.seeds:
            one = argparse.Namespace(**{**vars(args), "seed": seed, "relay_arg": [
                *args.relay_arg, f"buffer.max_staleness={eta}"]})
            runs.setdefault(eta, []).append(run_relay(one))
    Path(args.out).write_bytes(msgspec.json.format(msgspec.json.encode(
        {"steps": args.steps, "test_freq": args.test_freq, "seeds": args.seeds,
         "relay_args": args.relay_arg, "target": args.target,
         "series": {str(eta): series for eta, series in runs.items()}})))
    longest = max(sum(s.step_seconds) for series in runs.values() for s in series)
    marks = [round(longest * fraction) for fraction in (0.125, 0.25, 0.5, 0.75, 1.0)]
    header = "".join(f"{f'{mark} s':>8}" for mark in marks)
    print(f"\nheld-out accuracy (mean of seeds {args.seeds}) by training time; eta = "
          f"buffer.max_staleness")
    print(f"{'eta':>4} {'s/step':>7} {header} {'last step':>10} {'peak':>6} "
          f"{f'to {args.target:.0%}':>10}")
    for eta, series in runs.items():
        summaries = [summarize(s, args.target) for s in series]
        cells = []
        for mark in marks:
            values = [a for s in series if (a := accuracy_at(s.evals, mark)) is not None]
            cells.append(f"{statistics.fmean(values):>8.1%}" if values else f"{'-':>8}")
        reached = [s.seconds_to_target for s in summaries if s.seconds_to_target is not None]
        to_target = (f"{statistics.fmean(reached):.0f} s ({len(reached)}/{len(series)})"
                     if reached else "not reached")
        print(f"{eta:>4} {statistics.median(s.seconds_per_step for s in summaries):>7.3f} "
              f"{''.join(cells)} {statistics.fmean(s.accuracy_end for s in summaries):>10.1%} "
              f"{statistics.fmean(s.accuracy_peak for s in summaries):>6.1%} {to_target:>10}")
    print(f"\nper-step series in {args.out}")


def throughput_rows(trl: Series, relay: Series) -> list[tuple[str, float, float, float, str]]:
    """(label, TRL, Relay, Relay's advantage, format) for seconds per step, generated
    tokens/s and learner tokens/s, over the steps after the first."""
    def seconds(s: Series) -> float:
        return statistics.median(s.step_seconds[1:])

    def generated(s: Series) -> float:  # a median, so one step's compiling weighs nothing
        return statistics.median(tokens / seconds for tokens, seconds
                                 in zip(s.completion_tokens[1:], s.step_seconds[1:]))

    def learner(s: Series) -> float:
        return statistics.median(s.learner_tokens_per_s[1:])

    return [("seconds per step", seconds(trl), seconds(relay), seconds(trl) / seconds(relay),
             "{:.2f}"),
            ("generated tokens/s (completion tokens / step s)", generated(trl),
             generated(relay), generated(relay) / generated(trl), "{:,.0f}"),
            ("learner tokens/s (prompt + completion, in the update)", learner(trl),
             learner(relay), learner(relay) / learner(trl), "{:,.0f}")]


def throughput(args: argparse.Namespace) -> None:
    """Both systems on the 24M-parameter random Qwen2: speed only (see the module docstring),
    ``--repeats`` pairs of runs."""
    from bench_model import ensure_bench_model

    model = ensure_bench_model()
    pairs, ratios = [], []
    for repeat in range(args.repeats):
        trl, relay = throughput_pair(args, model)
        pairs.append({"series": [trl, relay]})
        rows = throughput_rows(trl, relay)
        ratios.append({label.split(" (")[0]: ratio for label, _, _, ratio, _ in rows})
        print(f"\n{model.name}, {args.dtype}{', compiled' if args.compile else ''}, "
              f"{args.prompts_per_step} prompts x 8 samples, up to {args.response_length} new "
              f"tokens, {args.steps} steps (medians after the first)"
              + (f", pair {repeat + 1} of {args.repeats}" if args.repeats > 1 else ""))
        width = max(len(label) for label, *_ in rows)
        print(f"{'':<{width}}  {'TRL':>10}  {'Relay':>10}  {'Relay/TRL':>10}")
        for label, theirs, ours, ratio, form in rows:
            print(f"{label:<{width}}  {form.format(theirs):>10}  {form.format(ours):>10}  "
                  f"{ratio:>9.2f}x")
        write_record(args.out, {
            "mode": "throughput", "model": str(model), "steps": args.steps, "dtype": args.dtype,
            "prompts_per_step": args.prompts_per_step, "response_length": args.response_length,
            "compile": args.compile, "relay_args": args.relay_arg}, pairs)
    if args.repeats > 1:
        print_repeats(ratios)
    print(f"\nper-step series in {args.out}")


def throughput_pair(args: argparse.Namespace, model: Path) -> tuple[Series, Series]:
    """One TRL run, then one Relay run, on the 24M model."""
    reward = ROOT / "tools" / "bench_reward.py"
    trl = run_trl(args, ["--model", str(model), "--prompts-per-step", str(args.prompts_per_step),
                         "--response-length", str(args.response_length),
                         "--reward", f"{reward}:compute_score", "--dtype", args.dtype,
                         *(["--torch-compile"] if args.compile else [])])
    relay = run_relay(args, [f"model.path={model}", f"model.dtype={args.dtype}",
                             f"data.train_batch_size={args.prompts_per_step}",
                             f"rollout.response_length={args.response_length}",
                             f"custom_reward_function.path={reward}",
                             "custom_reward_function.name=compute_score",
                             "trainer.val_before_train=false",
                             # TRL runs on 2 threads; here the learner is the slow stage and
                             # the generator idles most of a step (1 thread: 1.26x, 2: 1.59x)
                             f"topology.learner.threads={THROUGHPUT_LEARNER_THREADS}",
                             f"actor.use_torch_compile={str(args.compile).lower()}"])
    return trl, relay


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help="optimizer steps of each run (default 400; "
                                                   "12 with --throughput)")
    parser.add_argument("--test-freq", type=int, default=10,
                        help="held-out evaluation every this many steps (and at the last)")
    parser.add_argument("--throughput", action="store_true",
                        help="speed only, on a random 24M-parameter Qwen2")
    parser.add_argument("--prompts-per-step", type=int, default=8, help="with --throughput")
    parser.add_argument("--response-length", type=int, default=32, help="with --throughput")
    parser.add_argument("--compile", action="store_true",
                        help="with --throughput: torch.compile on both sides")
    parser.add_argument("--trl-omp-wait-policy", default="", metavar="VALUE",
                        help="OMP_WAIT_POLICY for TRL's process (default: unset, as TRL's "
                             "users run it)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16",
                        help="with --throughput")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=["relay", "trl"],
                        help="run one system only (not with --throughput)")
    parser.add_argument("--relay-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="an override for launch-cluster (repeatable), e.g. "
                             "topology.generators[0].engine=hf")
    parser.add_argument("--sweep-staleness", type=int, nargs="+", metavar="ETA",
                        help="run Relay alone for each of these buffer.max_staleness values")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="the seeds of each sweep point")
    parser.add_argument("--target", type=float, default=0.5,
                        help="the held-out accuracy whose training time is compared")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the TRL / Relay pair this many times; ratios per pair and "
                             "their medians")
    parser.add_argument("--out", default="bench-e2e.json",
                        help="where the per-step series go (JSON)")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 12 if args.throughput else 400
    if args.compile and not args.throughput:
        parser.error("--compile goes with --throughput")
    if args.throughput and (args.only or args.sweep_staleness):
        parser.error("--throughput runs both systems: no --only or --sweep-staleness")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.repeats > 1 and (args.only or args.sweep_staleness):
        parser.error("--repeats runs pairs of TRL and Relay: not with --only or "
                     "--sweep-staleness (which repeats with --seeds)")
    if args.throughput:
        args.test_freq = 0  # no evaluation: the model is random
    elif args.test_freq < 1:
        parser.error("--test-freq must be >= 1")
    if args.steps < 2 or args.prompts_per_step < 1 or args.response_length < 1:
        parser.error("--steps must be >= 2, --prompts-per-step and --response-length >= 1")
    if any("=" not in a for a in args.relay_arg):
        parser.error("--relay-arg takes key=value")
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.throughput:
        throughput(args)
        return
    if args.sweep_staleness:
        sweep_staleness(args)
        return
    runs, ratios = [], []
    for repeat in range(args.repeats):
        if args.repeats > 1:
            print(f"bench-e2e: pair {repeat + 1} of {args.repeats}", flush=True)
        series = []
        if args.only != "relay":
            series.append(run_trl(args))
        if args.only != "trl":
            series.append(run_relay(args))
        summaries = {s.system: summarize(s, args.target) for s in series}
        runs.append({"series": series, "summaries": summaries})
        write_record(args.out, {"steps": args.steps, "test_freq": args.test_freq,
                                "seed": args.seed, "relay_args": args.relay_arg,
                                "target": args.target}, runs)
        print_table(list(summaries.values()), args.target)
        if len(summaries) == 2:
            print_ratios(summaries["Relay"], summaries["TRL"], args.target)
            ratios.append(comparison_ratios(summaries["Relay"], summaries["TRL"]))
    if args.repeats > 1:
        print_repeats(ratios)
    print(f"\nper-step series in {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
