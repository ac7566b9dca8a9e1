"""Write prompt datasets in verl's schema (JSONL or parquet, chosen by the output's suffix).

    python tools/prepare-data.py arithmetic            # configs/data/arithmetic-{train,test}.jsonl
    python tools/prepare-data.py gsm8k ../shared/data/gsm8k/train.jsonl gsm8k-train.parquet

``arithmetic`` writes the bundled task's train and test problems (disjoint by
construction, see ``relay.algorithms.tasks.arithmetic``). ``gsm8k`` converts GSM8K-style records
(``question``, ``answer`` ending in ``#### <number>``) the way verl's
``examples/data_preprocess/gsm8k.py`` does; a malformed record stops the conversion with
an error naming file, line and field.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

from relay.algorithms.tasks import arithmetic, gsm8k
from relay.configs import CONFIG_DIR
from relay.configs.prompt_data import DatasetError, load_prompt_rows, write_prompt_rows


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        args.run(args)
    except DatasetError as error:
        print(f"relay prepare-data: {error}", file=sys.stderr)
        return 1
    return 0


def _arithmetic(args: argparse.Namespace) -> None:
    for split, count in (("train", args.train_rows), ("test", args.test_rows)):
        problems = arithmetic.sample_problems(args.seed, count, split)
        path = args.out_dir / f"arithmetic-{split}.jsonl"
        write_prompt_rows(path, (arithmetic.verl_row(p, split, i) for i, p in enumerate(problems)))
        print(f"wrote {count} {split} rows to {path}")


def _gsm8k(args: argparse.Namespace) -> None:
    rows = load_prompt_rows(args.input, convert=functools.partial(gsm8k.verl_row, split=args.split))
    write_prompt_rows(args.output, rows)
    print(f"wrote {len(rows)} rows to {args.output}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(required=True, metavar="{arithmetic,gsm8k}")

    task = commands.add_parser("arithmetic", help="the bundled arithmetic task's train/test files")
    task.add_argument("--out-dir", type=Path, default=CONFIG_DIR / "data")
    task.add_argument("--seed", type=int, default=0)
    task.add_argument("--train-rows", type=int, default=5000)
    task.add_argument("--test-rows", type=int, default=300)
    task.set_defaults(run=_arithmetic)

    convert = commands.add_parser("gsm8k", help="convert GSM8K question/answer records")
    convert.add_argument("input", type=Path, help="GSM8K-style .jsonl or .parquet")
    convert.add_argument("output", type=Path, help="verl-schema .jsonl or .parquet")
    convert.add_argument("--split", default="train", help="recorded in extra_info.split")
    convert.set_defaults(run=_gsm8k)
    return parser


if __name__ == "__main__":
    sys.exit(main())
