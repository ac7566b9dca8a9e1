"""The learner at real size: steps/s and memory per rank of Qwen2.5-0.5B's architecture.

    tools/with-venv python tools/bench-learner.py [--configs dp2,sp2] [--steps 3] ...

Each configuration trains a random Qwen2.5-0.5B-architecture model (``tools/bench_model.py``,
494M parameters, built and cached on first use) for ``--steps`` GRPO steps on a synthetic
batch (``--groups`` prompts x ``--n`` samples, ``--prompt-len`` + ``--response-len``
tokens, random tokens and rewards) with Relay's learner (FSDP2, fp32 master weights, bf16
compute, AdamW), under ``torchrun`` on this machine (gloo):

- ``dp2``: two ranks, FSDP2 over both, the rows split between them;
- ``sp2``: two ranks in one Ulysses group (``actor.ulysses_sequence_parallel_size = 2``),
  each running half of every pass's tokens;
- ``dp1``: one rank, for comparison.

A ``+gc`` suffix (``dp2+gc``) turns on gradient checkpointing
(``model.enable_gradient_checkpointing``). ``--share-prompts`` runs each group's prompt once
a pass (``actor.share_prompts``, as training runs do; rows under ``sp2``). Per
configuration it prints the median seconds
per step after the first (warm-up) step, learner tokens/s, and per rank the resident memory
after loading and sharding, the peak while stepping (sampled every 20 ms) and the process's
lifetime peak (``VmHWM``, which includes loading: ``from_pretrained`` holds the whole fp32
model on every rank before it is sharded).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SHAPE = "qwen2.5-0.5b-arch"
CONFIGS = {"dp1": (1, 1), "dp2": (2, 1), "sp2": (2, 2)}  # name: (ranks, SP size)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="dp2,sp2",
                        help="comma-separated: dp1, dp2, sp2, each optionally +gc")
    parser.add_argument("--steps", type=int, default=3, help="steps per configuration")
    parser.add_argument("--groups", type=int, default=4, help="prompts per step")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=4,
                        help="actor.ppo_micro_batch_size_per_gpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--share-prompts", action="store_true",
                        help="actor.share_prompts: each group's prompt once a pass (not "
                             "under sp2)")
    parser.add_argument("--model", help="a model folder (default: the cached random "
                                        f"{SHAPE}, built on first use)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # torchrun's entry: a JSON file
    args = parser.parse_args(argv)
    for name in args.configs.split(","):
        if name.removesuffix("+gc") not in CONFIGS:
            parser.error(f"--configs: unknown {name!r} (choose from {', '.join(CONFIGS)}, "
                         "each optionally +gc)")
    if args.steps < 2:
        parser.error("--steps must be 2 or more (the first is a warm-up)")
    return args


def resident_mib(field: str = "VmRSS") -> float:
    """This process's ``field`` of /proc/self/status (VmRSS, VmHWM) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


class PeakSampler:
    """The largest resident memory seen while running, sampled every 20 ms."""

    def __init__(self) -> None:
        self.peak = resident_mib()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, resident_mib())

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def synthetic_batch(args: argparse.Namespace, vocab: int, seed: int):
    """``args.groups`` groups of ``args.n`` samples with random tokens and 0/1 rewards."""
    import torch

    from relay.learner.batch import collate
    from relay.transport.messages import RolloutGroup, Sample

    generator = torch.Generator().manual_seed(seed)
    groups = []
    for index in range(args.groups):
        prompt = torch.randint(3, vocab, (args.prompt_len,), generator=generator,
                               dtype=torch.int32)
        samples = [Sample(prompt_ids=prompt,
                          response_ids=torch.randint(3, vocab, (args.response_len,),
                                                     generator=generator, dtype=torch.int32),
                          logprobs=-torch.rand(args.response_len, generator=generator) * 5,
                          versions=torch.zeros(args.response_len, dtype=torch.int32),
                          reward=float(sample % 2))
                   for sample in range(args.n)]
        groups.append(RolloutGroup(rollout_id=str(index), lease_id="L", prompt_id=str(index),
                                   generator_id="bench", samples=samples))
    return collate(groups, pad_id=0)


def worker(spec_file: str) -> None:
    """One rank (started by torchrun): load, shard, step, write its measurements."""
    import torch
    import torch.distributed as dist

    from relay.configs.run_schema import (
        ActorConfig,
        AlgorithmConfig,
        DataConfig,
        OptimConfig,
        RolloutConfig,
    )
    from relay.learner.model import load_sharded
    from relay.learner.optim import build_optimizer, build_scheduler
    from relay.learner.ulysses import learner_parallelism
    from relay.learner.update import Learner

    spec = json.loads(Path(spec_file).read_text())
    args = argparse.Namespace(**spec["args"])
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        parallelism = learner_parallelism(torch.device("cpu"), spec["sp"])
        model = load_sharded(spec["model"], compute_dtype=torch.bfloat16,
                             device=torch.device("cpu"), gradient_checkpointing=spec["gc"])
        optim = OptimConfig(lr=1e-6)
        actor = ActorConfig(optim=optim, ppo_micro_batch_size_per_gpu=args.micro_batch,
                            ulysses_sequence_parallel_size=spec["sp"],
                            share_prompts=args.share_prompts,
                            skip_zero_advantage=False)
        optimizer = build_optimizer(model, optim)
        learner = Learner(model, optimizer,
                          build_scheduler(optimizer, total_steps=args.steps, optim=optim),
                          actor=actor, algorithm=AlgorithmConfig(),
                          rollout=RolloutConfig(temperature=1.0,
                                                response_length=args.response_len),
                          data=DataConfig(train_files=[], train_batch_size=args.groups),
                          parallelism=parallelism)
        loaded = resident_mib()
        seconds = []
        with PeakSampler() as sampler:
            for step in range(args.steps):
                batch = synthetic_batch(args, model.config.vocab_size, seed=step)
                began = time.perf_counter()
                learner.step(batch, version=step)
                seconds.append(time.perf_counter() - began)
                if rank == 0:
                    print(f"  step {step + 1}/{args.steps}: {seconds[-1]:.1f} s", flush=True)
        tokens = int(batch.attention_mask.sum())
        result = {"rank": rank, "seconds": seconds, "tokens": tokens, "loaded_mib": loaded,
                  "stepping_peak_mib": sampler.peak, "lifetime_peak_mib": resident_mib("VmHWM")}
        Path(spec["out"]).with_suffix(f".rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_config(name: str, args: argparse.Namespace, model: Path, folder: Path) -> list[dict]:
    """Start one configuration under torchrun; its ranks' measurements."""
    ranks, sp = CONFIGS[name.removesuffix("+gc")]
    out = folder / name
    spec = {"args": {k: v for k, v in vars(args).items() if k != "worker"}, "sp": sp,
            "gc": name.endswith("+gc"), "model": str(model), "out": str(out)}
    spec_file = folder / f"{name}.json"
    spec_file.write_text(json.dumps(spec))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={ranks}", __file__, "--worker", str(spec_file)]
    print(f"{name}: {ranks} rank(s), SP {sp}{', gradient checkpointing' if spec['gc'] else ''}",
          flush=True)
    subprocess.run(command, check=True, env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
    return [json.loads(out.with_suffix(f".rank{r}.json").read_text()) for r in range(ranks)]


def report(name: str, ranks: list[dict]) -> str:
    """One table row: median s/step after the warm-up, tokens/s, memory per rank."""
    per_step = statistics.median(ranks[0]["seconds"][1:])
    memory = " / ".join(f"{r['loaded_mib'] / 1024:.1f}, {r['stepping_peak_mib'] / 1024:.1f}, "
                        f"{r['lifetime_peak_mib'] / 1024:.1f}" for r in ranks)
    return (f"| {name} | {per_step:.3g} | {ranks[0]['tokens'] / per_step:.0f} | {memory} |")


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker)
        return
    from bench_model import ensure_bench_model

    model = Path(args.model) if args.model else ensure_bench_model(SHAPE)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs.split(","):
            rows.append(report(name, run_config(name, args, model, Path(tmp))))
    tokens = args.groups * args.n * (args.prompt_len + args.response_len)
    print(f"\n{model}: {args.groups} x {args.n} samples of {args.prompt_len} + "
          f"{args.response_len} tokens ({tokens} a step), micro-batch {args.micro_batch}, "
          f"{args.threads} thread(s) a rank; memory in GiB per rank: after loading, peak "
          "while stepping, lifetime peak")
    print("| config | s/step (median) | learner tokens/s | memory per rank (GiB) |")
    print("| --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
