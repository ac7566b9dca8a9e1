"""Print, or dump as JSONL, the rollout groups a learner step trained on.

    relay rollouts RUN_DIR --step N               # readable: prompts, responses, rewards
    relay rollouts RUN_DIR --step N --jsonl FILE  # one JSON object a group ("-": stdout)

Read from the run's rollout log (``RUN_DIR/rollouts``, ``relay.buffer.rollout_log``): the
step's record names its groups, in the order served, and the weights version the learner
trained the step at; each group holds the samples the store kept of it (``served_group``).
Token ids are decoded with the run's tokenizer (``model.path`` of ``RUN_DIR/run.toml``),
special tokens skipped. A sample's weights version is that of its tokens (a range when the
weights changed while it was generated), and its staleness is

    staleness = trained-at version - the oldest version among its tokens

(``relay.buffer.staleness``). A JSONL line holds ``step``, ``trained_at_version``,
``rollout_id``, ``prompt_id``, ``generator_id``, ``data_source``, ``ground_truth``,
``importance_weight``, ``prompt`` and ``responses``: each with ``text``, ``reward``,
``reward_info``, ``reward_error``, ``finish_reason``, ``version_min``, ``version_max`` and
``staleness``. Exit code 2, with the reason, for a run without a rollout log, a step it does
not record, or groups of the step that a damaged log lost.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from relay.buffer.rollout_log import (LogProblem, StepRecord, read_rollout_log, read_steps,
                                      served_group)
from relay.configs import ConfigError
from relay.configs.loader import read_toml
from relay.configs.rundir import RESOLVED_RUN
from relay.configs.run_schema import BUILTIN_MODEL_PREFIX
from relay.transport.messages import RolloutGroup, Sample

LOG_FOLDER = "rollouts"

Decode = Callable[[Any], str]


class RolloutsError(ValueError):
    """The step cannot be shown (the message names the run directory and why)."""


def log_folder(run_dir: Path, run: dict[str, Any]) -> Path:
    """The run's rollout log, or ``RolloutsError`` saying why there is none."""
    folder = run_dir / LOG_FOLDER
    if run.get("buffer", {}).get("rollout_log", True) is False:
        raise RolloutsError(f"{run_dir}: the run was made with buffer.rollout_log = false, "
                            "so it kept no rollout log")
    if not folder.is_dir():
        raise RolloutsError(f"{run_dir}: no rollout log ({LOG_FOLDER}/): the buffer never "
                            "started, or the folder was removed")
    return folder


def step_groups(folder: Path, step: int) -> tuple[StepRecord, list[RolloutGroup]]:
    """Step ``step``'s record and its groups as served; ``RolloutsError`` for a step not
    recorded or groups a damaged log lost (naming the damage)."""
    problems: list[LogProblem] = []
    try:
        records = read_steps(folder, problems)
    except FileNotFoundError as exc:
        raise RolloutsError(str(exc)) from None
    if step not in records:
        held = f"steps {min(records)} to {max(records)}" if records else "no step"
        raise RolloutsError(f"{folder}: step {step} is not recorded (it records {held})"
                            + _damage(problems))
    record = records[step]
    wanted = set(record.rollout_ids)
    try:
        found = {g.rollout_id: served_group(g) for g in read_rollout_log(folder, problems)
                 if g.rollout_id in wanted}
    except FileNotFoundError as exc:
        raise RolloutsError(str(exc)) from None
    lost = [rid for rid in record.rollout_ids if rid not in found]
    if lost:
        raise RolloutsError(f"{folder}: {len(lost)} of step {step}'s {len(wanted)} groups are "
                            f"not in the log (first: {lost[0]})" + _damage(problems))
    for problem in problems:  # elsewhere in the log: this step is whole
        print(f"relay rollouts: warning: {problem.segment} at byte {problem.offset}: "
              f"{problem.reason}", file=sys.stderr)
    return record, [found[rid] for rid in record.rollout_ids]


def _damage(problems: list[LogProblem]) -> str:
    if not problems:
        return ""
    first = problems[0]
    return (f"; the log is damaged: {len(problems)} unreadable record(s), the first in "
            f"{first.segment} at byte {first.offset} ({first.reason})")


def run_decoder(run_dir: Path, run: dict[str, Any]) -> Decode:
    """Token ids to text with the run's tokenizer (``model.path``), special tokens skipped."""
    model = run.get("model", {})
    path = str(model.get("path", ""))
    try:
        if path.startswith(BUILTIN_MODEL_PREFIX):
            from relay.learner.tiny_model.tokenizer import builtin_tokenizer

            tokenizer = builtin_tokenizer(path.removeprefix(BUILTIN_MODEL_PREFIX))
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(
                path, trust_remote_code=bool(model.get("trust_remote_code", False)))
    except (OSError, ValueError) as exc:
        raise RolloutsError(f"{run_dir}: cannot load the tokenizer of model.path {path!r} "
                            f"({exc})") from None
    return lambda ids: tokenizer.decode(ids.tolist(), skip_special_tokens=True)


def sample_entry(sample: Sample, trained_at: int, decode: Decode) -> dict[str, Any]:
    versions = sample.versions.tolist() or [trained_at]
    return {"text": decode(sample.response_ids), "reward": sample.reward,
            "reward_info": dict(sample.reward_info), "reward_error": sample.reward_error,
            "finish_reason": sample.finish_reason, "version_min": min(versions),
            "version_max": max(versions), "staleness": trained_at - min(versions)}


def group_entries(record: StepRecord, groups: list[RolloutGroup],
                  decode: Decode) -> Iterator[dict[str, Any]]:
    """One JSON-ready entry per group (module docstring)."""
    weights = record.weights or [1.0] * len(groups)
    for group, weight in zip(groups, weights):
        prompt = decode(group.samples[0].prompt_ids) if group.samples else ""
        yield {"step": record.step, "trained_at_version": record.version,
               "rollout_id": group.rollout_id, "prompt_id": group.prompt_id,
               "generator_id": group.generator_id, "data_source": group.data_source,
               "ground_truth": group.ground_truth, "importance_weight": weight,
               "prompt": prompt,
               "responses": [sample_entry(s, record.version, decode) for s in group.samples]}


def print_readable(entries: list[dict[str, Any]], out: TextIO) -> None:
    first = entries[0]
    out.write(f"step {first['step']}: trained at weights version {first['trained_at_version']}, "
              f"{len(entries)} groups\n")
    for i, entry in enumerate(entries, 1):
        weight = entry["importance_weight"]
        out.write(f"\n== group {i}/{len(entries)}  {entry['rollout_id']}  prompt "
                  f"{entry['prompt_id']}  {entry['data_source']}  from {entry['generator_id']}"
                  + (f"  weight {weight:.3g}" if weight != 1.0 else "") + "\n")
        out.write(f"prompt: {_indented(entry['prompt'].rstrip())}\n")
        out.write(f"ground truth: {entry['ground_truth']!r}\n")
        for j, response in enumerate(entry["responses"], 1):
            low, high = response["version_min"], response["version_max"]
            version = str(low) if low == high else f"{low}-{high}"
            extras = "".join(f"  {k} {v:g}" for k, v in response["reward_info"].items())
            error = f"  reward error: {response['reward_error']}" if response["reward_error"] \
                else ""
            out.write(f"  [{j}] reward {response['reward']:g}{extras}  version {version}  "
                      f"staleness {response['staleness']}  {response['finish_reason']}{error}\n")
            out.write(f"      {_indented(response['text'], 6)}\n")


def _indented(text: str, width: int = 8) -> str:
    return text.replace("\n", "\n" + " " * width)


def write_jsonl(entries: list[dict[str, Any]], out: TextIO) -> None:
    for entry in entries:
        out.write(json.dumps(entry, ensure_ascii=False) + "\n")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run directory")
    parser.add_argument("--step", type=int, required=True, metavar="N",
                        help="the learner step (counted from 1)")
    parser.add_argument("--jsonl", metavar="FILE", default=None,
                        help="write one JSON object per group to FILE ('-': stdout) instead "
                             "of printing them readably")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    run_dir = args.run_dir.resolve()
    try:
        if not (run_dir / RESOLVED_RUN).is_file():
            raise RolloutsError(f"{run_dir}: not a run directory (no {RESOLVED_RUN})")
        run = read_toml(run_dir / RESOLVED_RUN)
        record, groups = step_groups(log_folder(run_dir, run), args.step)
        entries = list(group_entries(record, groups, run_decoder(run_dir, run)))
    except (RolloutsError, ConfigError) as exc:
        print(f"relay rollouts: {exc}", file=sys.stderr)
        return 2
    if args.jsonl is None:
        print_readable(entries, sys.stdout)
    elif args.jsonl == "-":
        write_jsonl(entries, sys.stdout)
    else:
        try:
            with open(args.jsonl, "w", encoding="utf-8") as out:
                write_jsonl(entries, out)
        except OSError as exc:
            print(f"relay rollouts: cannot write {args.jsonl}: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {len(entries)} groups of step {args.step} to {args.jsonl}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
