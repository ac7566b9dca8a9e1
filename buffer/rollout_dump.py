"""verl's ``trainer.rollout_data_dir``: each training step's samples as ``DIR/STEP.jsonl``.

One JSON object a line, one line per sample the step trains on, with verl's fields
(``RayPPOTrainer._log_rollout_data`` and ``_dump_generations``):

    input   the prompt as the model saw it (its tokens decoded, special tokens skipped)
    output  the response (likewise decoded)
    gts     the ground truth (the row's ``reward_model.ground_truth``)
    score   the sample's reward (verl: the sum of its token-level scores)
    step    the learner step
    ...     the reward function's extra values (``reward_info``), each key that every
            sample of the step has (verl keeps an extra column only when its length is the
            number of samples)

Where it is written: by the buffer, when it serves step N's batch (``relay.buffer.hub``),
not by the learner. The buffer alone holds the whole batch of a step in one process (the
learner's ranks each hold a shard) and it already records what each step consumed (the
rollout log). The file is written before the batch is sent, so the learner waits for it: a
decode and a write per step (3 ms for the default's 256 samples on this project's 2-core
CPU; more for long responses), only when the option is set. The samples are those the
learner is served, after the buffer's filters, in the order served; a step served again
after a resume overwrites its file, so the folder describes the lineage of the kept
weights, as the rollout log does. The file is written beside its name and renamed into
place: a reader never sees half of one.

The path: relative values resolve as every path of a run config does (against the launch
directory when given on the command line, verl's way; against the file's folder when set in
a TOML file); ``relay.configs.checks`` refuses at launch a folder that cannot be created or
written (``dump_dir_problem``), on the launcher's host and again on the buffer's.

The tokenizer is ``model.path``'s: a ``builtin:`` model's folder by then, where the launcher
built it and pointed the run config (``relay.launcher.supervisor.builtin_model``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from relay.configs.run_schema import RunConfig
    from relay.transport.messages import RolloutGroup

Decode = Callable[["torch.Tensor"], str]
"""Token ids to text: the run's tokenizer, special tokens skipped."""


@dataclass(frozen=True)
class RolloutDump:
    """Where the dumps go and how token ids become text."""

    folder: Path
    decode: Decode


def rollout_dump(run: RunConfig) -> RolloutDump | None:
    """The run's dump (``trainer.rollout_data_dir``; None when unset), decoding with
    ``model.path``'s tokenizer (loaded only then: the buffer needs no other)."""
    if not run.trainer.rollout_data_dir:
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        run.model.path, trust_remote_code=run.model.trust_remote_code)

    def decode(ids: torch.Tensor) -> str:
        return tokenizer.decode(ids.tolist(), skip_special_tokens=True)

    return RolloutDump(folder=Path(run.trainer.rollout_data_dir), decode=decode)


def dump_rows(step: int, groups: Sequence[RolloutGroup], decode: Decode) -> list[dict[str, Any]]:
    """The lines of step ``step``'s file (module docstring), one per sample of ``groups``."""
    samples = [(group, sample) for group in groups for sample in group.samples]
    extras = [key for key in (samples[0][1].reward_info if samples else {})
              if all(key in s.reward_info for _, s in samples)]
    return [{"input": decode(sample.prompt_ids), "output": decode(sample.response_ids),
             "gts": group.ground_truth, "score": sample.reward, "step": step,
             **{key: sample.reward_info[key] for key in extras}}
            for group, sample in samples]


def write_dump(folder: Path, step: int, groups: Sequence[RolloutGroup], decode: Decode) -> Path:
    """Write ``folder/<step>.jsonl`` (module docstring) and return its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{step}.jsonl"
    partial = path.with_name(path.name + ".partial")
    lines = (json.dumps(row, ensure_ascii=False) + "\n" for row in dump_rows(step, groups, decode))
    partial.write_text("".join(lines), encoding="utf-8")
    partial.replace(path)
    return path
