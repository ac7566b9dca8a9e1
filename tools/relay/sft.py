"""Supervised fine-tuning with verl's SFT keys (``relay.learner.sft``).

    relay sft [CONFIG.yaml|CONFIG.toml] [key=value ...]
    relay sft --arithmetic-data OUT_DIR [--rows N] [--val-rows M] [--seed S]

The config (optional: every key may come from the command line) and the overrides are
verl's ``fsdp_sft_trainer`` keys (``relay.configs.sft_schema``), e.g.::

    relay sft data.train_files=configs/data/arithmetic-sft-train.jsonl \\
        data.val_files=configs/data/arithmetic-sft-val.jsonl \\
        data.prompt_key=question data.response_key=answer \\
        model.partial_pretrain=Qwen/Qwen2.5-0.5B-Instruct trainer.default_local_dir=out

The resolved config is written to ``default_local_dir/sft.toml``; ``trainer.n_gpus_per_node``
ranks (1: this process) train, started with torchrun on this host. The trained model lands
in ``default_local_dir/final``, a Hugging Face folder an RL run takes as
``actor_rollout_ref.model.path``. A config problem exits 2 naming the key.

``--arithmetic-data`` writes the arithmetic task's SFT rows (``question``, a correct
``answer`` in the verifier's format) as ``arithmetic-sft-train.jsonl`` and
``arithmetic-sft-val.jsonl``: the bundled files in ``configs/data`` are its defaults.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from relay.algorithms.tasks import arithmetic
from relay.configs.loader import ConfigError
from relay.configs.sft_schema import load_sft_config

CONFIG_SUFFIXES = (".yaml", ".yml", ".toml")
ARITHMETIC_FILES = ("arithmetic-sft-train.jsonl", "arithmetic-sft-val.jsonl")


def arithmetic_rows(count: int, seed: int) -> list[dict[str, str]]:
    """``count`` distinct training-split problems of the arithmetic task with their
    answers in the verifier's format (``<answer>N</answer>``)."""
    return [{"question": p.question, "answer": p.response}
            for p in arithmetic.sample_problems(seed, count, "train")]


def write_arithmetic_data(out: Path, rows: int, val_rows: int, seed: int) -> list[Path]:
    """The first ``rows`` problems as the training file, the next ``val_rows`` as the
    validation file (disjoint)."""
    out.mkdir(parents=True, exist_ok=True)
    problems = arithmetic_rows(rows + val_rows, seed)
    paths = [out / name for name in ARITHMETIC_FILES]
    for path, part in zip(paths, (problems[:rows], problems[rows:]), strict=True):
        path.write_text("".join(json.dumps(row) + "\n" for row in part), encoding="utf-8")
    return paths


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="relay sft", description=__doc__.split("\n\n")[0],
        epilog="keys: verl's SFT trainer's (data.*, model.*, optim.*, trainer.*, "
               "ulysses_sequence_parallel_size, use_remove_padding)")
    parser.add_argument("args", nargs="*", metavar="[CONFIG] key=value",
                        help="a YAML/TOML config file first (optional), then overrides")
    parser.add_argument("--arithmetic-data", type=Path, metavar="OUT_DIR",
                        help="write the arithmetic task's SFT files and exit")
    parser.add_argument("--rows", type=int, default=512, help="training rows (default 512)")
    parser.add_argument("--val-rows", type=int, default=64, help="validation rows (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="problem stream seed (default 0)")
    return parser.parse_args(argv)


def torchrun_argv(config_file: Path, ranks: int) -> list[str]:
    """torchrun on this host, ``ranks`` processes of ``relay.learner.sft``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}", "-m", "relay.learner.sft", "--config",
            str(config_file)]


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else list(argv))
    if args.arithmetic_data is not None:
        for path in write_arithmetic_data(args.arithmetic_data, args.rows, args.val_rows,
                                          args.seed):
            print(path)
        return 0
    positional = list(args.args)
    config_path = positional.pop(0) if positional and "=" not in positional[0] \
        and positional[0].endswith(CONFIG_SUFFIXES) else None
    from relay.learner import sft  # torch and transformers: only for a run

    try:
        config = load_sft_config(config_path, positional)
        resolved = sft.write_resolved(config)
    except ConfigError as exc:
        print(f"relay sft: {exc}", file=sys.stderr)
        return 2
    ranks = config.trainer.n_gpus_per_node
    if ranks == 1:
        return sft.main(["--config", str(resolved)])
    return subprocess.call(torchrun_argv(resolved, ranks))


if __name__ == "__main__":
    sys.exit(main())
