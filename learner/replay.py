"""Offline replay: the learner re-run on exactly what each recorded step trained on.

``tools/replay-rollouts.py RUN_DIR --from-step A --to-step B`` debugs a run without
generators or a buffer. The buffer's rollout log (``relay.buffer.rollout_log``) holds every group
admitted and, for each learner step, the groups it was served, in order, with their
importance weights and the version the learner trained at. The replay starts from the newest
complete checkpoint written before step A (or, with none, from ``model.path``, the weights
of step 0), trains step after step on the recorded batches up to B with the run's own
config, and prints per step the loss, KL and grad norm next to what the live run logged to
MLflow. With η = 0 and the run's thread count the two agree to rounding; a step that
disagrees points at non-determinism or at state the checkpoint did not carry.

The served samples of a group are the logged group's samples that the store kept
(``metadata["buffer_admission"]["kept_samples"]``: PF-PPO may keep fewer). Steps between
the checkpoint and A are replayed too (they lead to A's weights) and printed. A checkpoint
that is not intact (``relay.learner.checkpoint_meta.check_intact``: not this user's, writable by
others, files that differ from its manifest, DCP metadata that asks to run code) is skipped
with a warning saying why, for the newest one before it that passes; its state is read
without running any pickle (``relay.learner.safe_dcp``).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist
from mlflow.tracking import MlflowClient
from transformers import AutoTokenizer

from relay.buffer.rollout_log import (LogProblem, StepRecord, read_rollout_log, read_steps,
                                      served_group)
from relay.configs.rundir import RunContext
from relay.learner.batch import collate
from relay.learner.checkpoint import load_checkpoint
from relay.learner.checkpoint_files import CheckpointError
from relay.learner.checkpoint_meta import check_intact, read_meta, scan_checkpoints
from relay.learner.main import build_learner
from relay.learner.tracking import RUN_DIR_TAG, default_uri
from relay.learner.update import Learner
from relay.transport.messages import RolloutGroup

logger = logging.getLogger(__name__)

COMPARED = ("actor/loss", "actor/kl", "actor/reward_kl", "actor/approx_kl", "actor/grad_norm")
"""The metrics printed side by side, those of them the run's algorithm reports."""


class ReplayError(ValueError):
    """The run directory cannot be replayed over the steps asked (the message says why)."""


class ReplayStep(msgspec.Struct, frozen=True):
    """One recorded step: its record and its served groups, in the order served."""

    record: StepRecord
    groups: list[RolloutGroup]


class StepComparison(msgspec.Struct, frozen=True):
    """A replayed step's metrics next to the live run's (NaN where it logged none)."""

    step: int
    replayed: dict[str, float]
    live: dict[str, float]

    def worst_relative_difference(self) -> float:
        """The largest |replayed - live| / max(|live|, 1e-3) over the metrics both have
        (relative; absolute for values near 0, such as a GRPO loss)."""
        gaps = [abs(value - self.live[name]) / max(abs(self.live[name]), 1e-3)
                for name, value in self.replayed.items()
                if name in self.live and self.live[name] == self.live[name]]
        return max(gaps, default=0.0)


def recorded_steps(log_folder: Path, first: int, last: int,
                   problems: list[LogProblem] | None = None) -> list[ReplayStep]:
    """Steps ``first`` to ``last`` (0: the last recorded) of the log with their groups; a
    step or group the log does not hold is a ``ReplayError`` that names it."""
    records = read_steps(log_folder, problems)
    last = last or max(records, default=0)
    if last < first:
        raise ReplayError(f"{log_folder}: records no step from step {first} on (it records "
                          f"{len(records)} steps)")
    missing = [step for step in range(first, last + 1) if step not in records]
    if missing:
        held = f"{min(records)} to {max(records)}" if records else "none"
        raise ReplayError(f"{log_folder}: no record of step(s) {_span(missing)} (it records "
                          f"steps {held})")
    wanted = {rid for step in range(first, last + 1) for rid in records[step].rollout_ids}
    groups = {g.rollout_id: served_group(g) for g in read_rollout_log(log_folder, problems)
              if g.rollout_id in wanted}
    lost = sorted(wanted - groups.keys())
    if lost:
        raise ReplayError(f"{log_folder}: {len(lost)} served group(s) are not in the log "
                          f"(first: {lost[0]}); a torn or unreadable record?")
    return [ReplayStep(record=records[step],
                       groups=[groups[rid] for rid in records[step].rollout_ids])
            for step in range(first, last + 1)]


def starting_checkpoint(folder: Path, first: int) -> tuple[int, Path | None]:
    """The newest complete checkpoint written before step ``first`` that is this user's and
    intact (module docstring) and its step, or (0, None): start from ``model.path``."""
    complete, _incomplete = scan_checkpoints(folder)
    for step, path in reversed([(step, path) for step, path in complete if step < first]):
        try:
            check_intact(path, read_meta(path))
        except CheckpointError as exc:
            logger.warning("skipping %s: %s", path, exc)
            continue
        return step, path
    return 0, None


def live_metrics(ctx: RunContext, names: tuple[str, ...] = COMPARED,
                 run_id: str = "") -> dict[str, dict[int, float]]:
    """What the live run logged for ``names``, by step: from the MLflow run ``run_id``, or
    from every run tagged with this run directory (a resumed run may have started a new
    one); the last value logged at a step wins. Empty when the store has none."""
    uri = ctx.run.tracking.uri or default_uri(ctx.run_dir)
    client = MlflowClient(uri)
    if run_id:
        run_ids = [run_id]
    else:
        experiment = client.get_experiment_by_name(ctx.run.tracking.experiment)
        if experiment is None:
            return {}
        runs = client.search_runs([experiment.experiment_id],
                                  f"tags.`{RUN_DIR_TAG}` = '{ctx.run_dir.resolve()}'",
                                  order_by=["attributes.start_time ASC"])
        run_ids = [r.info.run_id for r in runs]
    logged: dict[str, dict[int, float]] = {}
    for rid in run_ids:
        for name in names:
            history = sorted(client.get_metric_history(rid, name), key=lambda m: m.timestamp)
            logged.setdefault(name, {}).update({m.step: m.value for m in history})
    return logged


class Replayer:
    """The run's learner in this process (one rank), from a checkpoint or ``model.path``."""

    def __init__(self, ctx: RunContext, checkpoint: Path | None) -> None:
        run = ctx.run
        threads = ctx.topology.learner.threads
        if threads:
            torch.set_num_threads(threads)
        self._store_dir = tempfile.TemporaryDirectory(prefix="relay-replay-")
        # one rank of FSDP2, as the live learner: the same mixed precision
        dist.init_process_group("gloo", store=dist.FileStore(f"{self._store_dir.name}/store", 1),
                                rank=0, world_size=1)
        torch.manual_seed(run.trainer.seed)
        try:
            tokenizer = AutoTokenizer.from_pretrained(
                run.model.path, trust_remote_code=run.model.trust_remote_code)
            self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
            self.learner: Learner = build_learner(ctx, torch.device("cpu"))
            if checkpoint is not None:
                load_checkpoint(self.learner, checkpoint)
        except BaseException:
            self.close()  # a refused checkpoint, say: leave no process group behind
            raise

    def step(self, recorded: ReplayStep) -> dict[str, float]:
        train = collate(recorded.groups, self.pad_id, recorded.record.weights)
        return self.learner.step(train, recorded.record.version).metrics

    def close(self) -> None:
        dist.destroy_process_group()
        self._store_dir.cleanup()


def replay(ctx: RunContext, first: int, last: int, *,
           run_id: str = "") -> Iterator[StepComparison]:
    """Replay steps ``first`` to ``last`` (0: the last recorded), and the steps from the
    starting checkpoint up to ``first``, yielding each step's comparison as it is trained."""
    if first < 1 or 0 < last < first:
        raise ReplayError(f"--from-step {first} --to-step {last}: steps count from 1 and the "
                          "range must not be empty")
    start, checkpoint = starting_checkpoint(ctx.checkpoint_dir, first)
    problems: list[LogProblem] = []
    steps = recorded_steps(ctx.run_dir / "rollouts", start + 1, last, problems)
    for problem in problems:
        logger.warning("rollout log: %s at byte %d: %s", problem.segment, problem.offset,
                       problem.reason)
    logger.info("replaying steps %d to %d from %s", start + 1, steps[-1].record.step,
                checkpoint or f"model.path ({ctx.run.model.path})")
    live = live_metrics(ctx, run_id=run_id)
    replayer = Replayer(ctx, checkpoint)
    try:
        for recorded in steps:
            metrics = replayer.step(recorded)
            step = recorded.record.step
            replayed = {name: metrics[name] for name in COMPARED if name in metrics}
            yield StepComparison(step=step, replayed=replayed,
                                 live={name: live.get(name, {}).get(step, float("nan"))
                                       for name in replayed})
    finally:
        replayer.close()


def _span(steps: list[int]) -> str:
    return str(steps[0]) if len(steps) == 1 else f"{steps[0]}..{steps[-1]} ({len(steps)})"
