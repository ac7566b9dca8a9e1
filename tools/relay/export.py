"""Write the policy of a run's checkpoint as a Hugging Face model folder.

    relay export RUN_DIR [--step N] [--dtype DTYPE] OUT_DIR

Takes the newest complete checkpoint of the run (``--step N``: checkpoint ``step-N``),
refuses one that fails its integrity check (``relay.learner.checkpoint_meta.check_intact``:
owner and mode, the SHA-256 of every file, the DCP metadata), and writes its policy with the
tokenizer into OUT_DIR in the run's ``model.dtype`` (or ``--dtype``): the files
``AutoModelForCausalLM.from_pretrained`` and vLLM load. OUT_DIR is written atomically and
must not exist yet or be empty. The policy at the end of a run is already in
``RUN_DIR/final/``. Every problem (no run directory, no such checkpoint, a damaged one, an
OUT_DIR in use) exits 2 with a message naming it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from relay.configs import ConfigError
from relay.configs.rundir import (FINAL_MODEL, RESOLVED_RUN, configure_logging, is_run_dir,
                                  load_run_dir)
from relay.learner.checkpoint_files import CheckpointError
from relay.learner.checkpoint_meta import (
    CheckpointMeta,
    check_intact,
    newest_first,
    read_meta,
    scan_checkpoints,
)
from relay.learner.hf_export import convert_folder

DTYPES = ("float32", "bfloat16", "float16")


class ExportError(Exception):
    """Why nothing was exported: the message names the run directory, step or folder."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="relay export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="the run directory")
    parser.add_argument("out_dir", metavar="OUT_DIR", type=Path,
                        help="the folder to write (new, or empty)")
    parser.add_argument("--step", type=int, default=None, metavar="N",
                        help="the checkpoint of step N (default: the newest complete one)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="the weights' dtype (default: the run's model.dtype)")
    return parser.parse_args(argv)


def pick_checkpoint(checkpoints: Path, step: int | None) -> tuple[Path, CheckpointMeta]:
    """Checkpoint ``step-<step>`` of ``checkpoints`` (None: the newest complete one), with
    its meta; ``ExportError`` naming the folder and the steps there are otherwise."""
    if step is None:
        complete = newest_first(checkpoints)
        if not complete:
            raise ExportError(f"{checkpoints}: no complete checkpoint (a run saves them every "
                              f"trainer.save_freq steps; its final policy is in "
                              f"{checkpoints.parent / FINAL_MODEL})")
        return complete[0]
    path = checkpoints / f"step-{step}"
    try:
        return path, read_meta(path)
    except CheckpointError as exc:
        steps = [found for found, _path in scan_checkpoints(checkpoints)[0]]
        there = ", ".join(map(str, steps)) if steps else "none"
        raise ExportError(f"step {step}: {exc} (complete checkpoints of steps: {there})") from exc


def export(run_dir: Path, out_dir: Path, step: int | None = None,
           dtype: str | None = None) -> Path:
    """Write the policy of ``run_dir``'s checkpoint (``pick_checkpoint``) into ``out_dir``
    in ``dtype`` (None: the run's ``model.dtype``); the checkpoint it took."""
    if not is_run_dir(run_dir):
        raise ExportError(f"{run_dir}: not a run directory (no {RESOLVED_RUN})")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"{out_dir}: already exists and is not an empty folder; "
                          "name a new one")
    ctx = load_run_dir(run_dir)
    checkpoint, meta = pick_checkpoint(ctx.checkpoint_dir, step)
    try:
        check_intact(checkpoint, meta)
    except CheckpointError as exc:
        raise ExportError(f"{checkpoint} is damaged, not exported: {exc}") from exc
    hf = checkpoint / "hf"
    if not (hf / "config.json").is_file():
        raise ExportError(f"{checkpoint}: holds no Hugging Face folder hf/")
    convert_folder(hf, out_dir, getattr(torch, dtype or ctx.run.model.dtype))
    return checkpoint


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    configure_logging()
    try:
        checkpoint = export(args.run_dir.resolve(), args.out_dir, args.step, args.dtype)
    except (ExportError, ConfigError) as exc:
        print(f"relay export: {exc}", file=sys.stderr)
        return 2
    print(f"wrote the policy of {checkpoint} to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
