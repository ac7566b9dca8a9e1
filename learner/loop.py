"""The learner's training loop: batch in, update, publish, offer for evaluation, log, repeat.

Every rank runs ``TrainLoop.run_all``; rank 0 additionally talks to the buffer, serves
weights, tracks to MLflow and feeds the launcher's status line (``RankZero``). Versions: the
learner starts at version 0 (the checkpoint the generators loaded) and publishes version
v + 1 every ``trainer.publish_every`` steps, skipping a publish when the policy has not
changed since the last one (the critic's warm-up).

Checkpoints (``relay.learner.checkpoint``) are written after every ``trainer.save_freq``-th step
and the last, with the buffer's state asked of it at that moment. A resumed loop
(``TrainLoop.resume``) goes on at the checkpoint's step + 1 with its version: before the
first step it publishes the loaded weights under that version (version + 1 when the policy
had changed since that version was published, ``trainer.publish_every`` > 1) and tells the
buffer, so the generators, which start from ``model.path``, fetch them and the buffer's
staleness gate counts from there. With ``trainer.val_before_train`` the resumed weights are
offered for evaluation, as verl validates on resume.

Held-out evaluation is not done here. Before it streams anything the loop waits (bounded)
for the evaluator's first request, streaming a ``StreamBeacon`` every ``BEACON_EVERY_S``
meanwhile: the evaluator asks only once it has heard one, so its subscription to the weight
stream has reached this process; then at each evaluation step (step 0 with
``trainer.val_before_train``, every ``trainer.test_freq`` steps, the last step) the loop
offers the newest published version (before any, the initial checkpoint) to the evaluator
process through the weight server's evaluation queue (``relay.learner.eval_queue``) and goes on
training; the evaluator's reports come back later and are logged against the step after
which the version was published, the step whose weights they measured. At the end the loop
waits (bounded) for the last offer's report.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from relay.configs.run_schema import RunConfig
from relay.learner.batch import TrainBatch, collate
from relay.learner.checkpoint import BufferStateLink, LoopState, save_checkpoint
from relay.learner.checkpoint_lineage import Lineage, saves_at
from relay.learner.buffer_link import BufferLink, broadcast_batch
from relay.learner.tracking import Tracker
from relay.learner.update import Learner
from relay.learner.weight_buckets import plan_buckets
from relay.learner.weights import WeightServer, WeightStream, publish_weights
from relay.transport.messages import (
    EpisodeStats,
    EvalOffer,
    EvalReport,
    Metrics,
    RolloutGroup,
    Sample,
    SampleBatch,
)
from relay.transport.sockets import Pusher

logger = logging.getLogger(__name__)

EVALUATOR_JOIN_WAIT_S = 300.0  # for the evaluator's first request (it loads a model too)
BEACON_EVERY_S = 0.1  # StreamBeacons while waiting for it


class Reporter:
    """Rank 0's outlet for metrics: the MLflow run and the launcher's status line."""

    def __init__(self, tracker: Tracker, status: Pusher) -> None:
        self.tracker, self.status = tracker, status

    def report(self, step: int, metrics: dict[str, float]) -> None:
        self.tracker.log_metrics(metrics, step)
        self.status.send(Metrics(source="learner", step=step, values=metrics))

    def phase(self, step: int, doing: str) -> None:
        """Tell the launcher what the learner is doing while it makes no step (its status
        names it), and log it."""
        logger.info("%s", doing)
        self.status.send(Metrics(source="learner", step=step, values={}, phase=doing))

    def close(self, ok: bool) -> None:
        self.tracker.close(ok)
        self.status.close()


class RankZero:
    """What only rank 0 holds: the links to the buffer, the weight server and stream, the
    reporter, and the tokenizer saved with checkpoints."""

    def __init__(self, *, link: BufferLink, buffer_state: BufferStateLink,
                 weights: WeightServer, stream: WeightStream, reporter: Reporter,
                 tokenizer: PreTrainedTokenizerBase) -> None:
        self.link, self.buffer_state = link, buffer_state
        self.weights, self.stream = weights, stream
        self.reporter, self.tokenizer = reporter, tokenizer

    def close(self, ok: bool) -> None:
        self.reporter.close(ok)
        self.weights.stop()
        self.stream.close()
        self.link.close()
        self.buffer_state.close()


def batch_metrics(batch: SampleBatch, train: TrainBatch, version: int,
                  max_staleness: int) -> dict[str, float]:
    """Rollout and staleness statistics of the batch about to be trained on, computed on
    the host (``train`` is the collated batch before the learner moves it)."""
    rewards = train.rewards
    oldest = torch.tensor([int(s.versions.min()) for g in batch.groups for s in g.samples],
                          device="cpu")
    staleness = version - oldest
    samples = [s for g in batch.groups for s in g.samples]
    metrics = {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "rollout/response_length_mean": float(train.response_lengths.float().mean()),
        "rollout/response_length_max": float(train.response_lengths.max()),
        "rollout/prompt_length_mean": float(
            (train.attention_mask.sum(dim=1) - train.response_lengths).float().mean()),
        "rollout/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
        "rollout/reward_error_frac": sum(bool(s.reward_error) for s in samples) / len(samples),
        "staleness/mean": float(staleness.float().mean()),
        "staleness/max": float(staleness.max()),
    }
    for k in range(max_staleness + 1):
        metrics[f"staleness/frac_{k}"] = float((staleness == k).float().mean())
    for key in ("rm_score", "judge_score", "rule_score"):  # a learned reward's two parts
        if all(key in s.reward_info for s in samples):
            metrics[f"rollout/{key}_mean"] = sum(s.reward_info[key] for s in samples) / len(samples)
    if any(s.episode is not None for s in samples):
        metrics.update(episode_metrics(samples, train))
    metrics.update(batch.buffer_stats)
    return metrics


def episode_metrics(samples: list[Sample], train: TrainBatch) -> dict[str, float]:
    """Multi-turn statistics of a batch (``Sample.episode``; a sample without one counts as
    one turn without tool calls): ``rollout/turns_mean`` and ``rollout/tool_calls_mean`` per
    sample, ``rollout/tool_failure_frac`` = failed calls / calls and
    ``rollout/tool_latency_p95_s`` over every call of the batch (both 0 without calls), and
    ``rollout/policy_token_frac`` = tokens the policy sampled / response tokens (the rest
    were inserted: tool responses, the chat template's turn markers)."""
    stats = [s.episode or EpisodeStats() for s in samples]
    calls = sum(e.tool_calls for e in stats)
    latencies = torch.tensor([t for e in stats for t in e.tool_latencies_s],
                             dtype=torch.float64, device="cpu")
    return {
        "rollout/turns_mean": sum(e.turns for e in stats) / len(stats),
        "rollout/tool_calls_mean": calls / len(stats),
        "rollout/tool_failure_frac": sum(e.tool_failures for e in stats) / calls if calls
        else 0.0,
        "rollout/tool_latency_p95_s": float(latencies.quantile(0.95)) if latencies.numel()
        else 0.0,
        "rollout/policy_token_frac": float(train.response_mask.sum()
                                           / train.response_lengths.sum().clamp(min=1)),
    }


def metrics_line(step: int, total: int, metrics: dict[str, float],
                 accuracy: tuple[int, float] | None) -> str:
    """The learner log's line for ``step``: reward, held-out accuracy (the newest reported,
    with the step it measured), loss, KL and clip fraction, tokens/s, staleness; a metric
    the step did not produce is left out."""
    parts = [f"step {step}/{total}"]
    shown = (("rollout/reward_mean", "reward", ".3f"), ("actor/loss", "loss", ".4g"),
             ("actor/approx_kl", "kl", ".3g"), ("actor/clip_frac", "clipfrac", ".3f"),
             ("perf/learner_tokens_per_s", "learn tok/s", ".0f"),
             ("perf/generator_tokens_per_s", "gen tok/s", ".0f"),
             ("staleness/mean", "staleness", ".2f"))
    parts += [f"{name} {metrics[key]:{spec}}" for key, name, spec in shown if key in metrics]
    if accuracy is not None:
        parts.insert(2 if "rollout/reward_mean" in metrics else 1,
                     f"held-out acc {accuracy[1]:.3f} (step {accuracy[0]})")
    return " | ".join(parts)


def finite_priorities(groups: list[RolloutGroup], td_errors: list[float]
                      ) -> tuple[dict[str, float], int]:
    """Each group's TD-error priority by rollout id, leaving out those that are not finite
    (a diverging critic's NaN or inf), and how many were left out. The buffer refuses a
    request whose priorities hold any such value, applying none of them
    (``relay.buffer.prioritized``), which the learner could not survive; a group left out keeps
    the priority it had."""
    priorities = {group.rollout_id: error for group, error in zip(groups, td_errors)
                  if math.isfinite(error)}
    return priorities, len(td_errors) - len(priorities)


class TrainLoop:
    """Runs ``run.trainer``'s steps. From the run's other sections it reads the groups per
    step (``data.train_batch_size``), eta (``buffer.max_staleness``, for the staleness
    metrics), whether the buffer wants TD-error priorities back (``buffer.replay.priority``),
    whether the run evaluates (``RunConfig.evaluates``), how many checkpoints to keep
    (``checkpoint.keep_last``), and how weights are published (``model.dtype``,
    ``rollout.update_weights_bucket_megabytes``). Besides the config it is given the padding
    id, where checkpoints go and the lineage they carry
    (``relay.learner.checkpoint_lineage.run_lineage``), rank 0's links, the CPU group, and
    whether a LoRA policy publishes its adapters alone (``relay.configs.lora_publish``)."""

    def __init__(self, run: RunConfig, learner: Learner, *, pad_id: int, checkpoint_dir: Path,
                 lineage: Lineage, rank0: RankZero | None,
                 group: dist.ProcessGroup | None = None, publish_adapters: bool = False) -> None:
        self.trainer, self.learner = run.trainer, learner
        self.batch_size, self.max_staleness = run.data.train_batch_size, run.buffer.max_staleness
        self.send_td_errors = run.buffer.replay.priority == "td_error"
        self.evaluates, self.keep_last = run.evaluates, run.checkpoint.keep_last
        self.publish_dtype: torch.dtype = getattr(torch, run.model.dtype)
        self.pad_id, self.checkpoint_dir = pad_id, checkpoint_dir
        self.lineage, self.rank0, self.group = lineage, rank0, group
        with learner.full_policy():  # the parameters' full shapes
            self.plan = plan_buckets(learner.model, self.publish_dtype,
                                     run.rollout.update_weights_bucket_megabytes << 20,
                                     adapters=publish_adapters)
        self.version = 0
        self.published_step = 0  # the step after which self.version was taken
        self.unpublished_update = False  # the policy changed since the last publish
        self.priorities: dict[str, float] = {}  # td_error priorities for the next request
        self.offered_step = -1  # the step of the last version offered for evaluation
        self.resumed_at: int | None = None  # the checkpoint's step, when resumed
        self.accuracy: tuple[int, float] | None = None  # the newest held-out (step, accuracy)

    def resume(self, state: LoopState) -> None:
        """Go on after a checkpoint's step, from its version (module docstring)."""
        self.resumed_at = state.step
        self.version, self.unpublished_update = state.version, state.unpublished_update

    def run_all(self) -> None:
        trainer = self.trainer
        last = trainer.total_training_steps
        first = 1
        self._wait_for_evaluator()
        if self.resumed_at is not None:
            first = self.resumed_at + 1
            self._publish_resumed(self.resumed_at)
        if trainer.val_before_train:
            self._offer_evaluation()
        for step in range(first, last + 1):
            self._step(step)
            if trainer.test_freq > 0 and (step % trainer.test_freq == 0 or step == last):
                self._offer_evaluation()
            if saves_at(step, trainer.save_freq, last):
                self._save(step)
        if self.rank0 is not None:
            self.rank0.link.end_run(f"trained {last} steps")
            self._finish_evaluation()

    def _step(self, step: int) -> None:
        began = time.monotonic()
        waited = 0.0
        batch, waited = self._next_batch(step)
        train = collate(batch.groups, self.pad_id, batch.weights,
                        pin_memory=self.learner.device.type == "cuda")
        rollout = {} if self.rank0 is None else batch_metrics(batch, train, self.version,
                                                               self.max_staleness)
        trained_at = time.monotonic()
        result = self.learner.step(train, self.version)
        metrics = result.metrics
        train_seconds = time.monotonic() - trained_at
        if self.send_td_errors:
            self.priorities, nonfinite = finite_priorities(batch.groups, result.td_errors)
            metrics["replay/nonfinite_td_errors"] = float(nonfinite)
            if nonfinite:
                logger.warning("step %d: %d of %d TD-error priorities are not finite (the "
                               "critic diverges?); those groups keep their priority", step,
                               nonfinite, len(result.td_errors))
        self.unpublished_update |= result.policy_updated
        if step % self.trainer.publish_every == 0 and self.unpublished_update:
            self._publish(step)  # not while the critic warms up: the policy is unchanged
        if self.rank0 is None:
            return
        metrics.update(rollout)
        tokens = float(train.attention_mask.sum())
        metrics.update({
            "perf/step_seconds": time.monotonic() - began,
            "perf/wait_seconds": waited,
            "perf/learner_tokens_per_s": tokens / max(train_seconds, 1e-9),
            "perf/generator_tokens_per_s": batch.buffer_stats.get(
                "buffer/generator_tokens_per_s", 0.0),
            "version": float(self.version),
        })
        self.rank0.reporter.report(step, metrics)
        if step % self.trainer.log_freq == 0 or step == self.trainer.total_training_steps:
            logger.info("%s", metrics_line(step, self.trainer.total_training_steps, metrics,
                                           self.accuracy))
        for report in self.rank0.weights.evaluation.take_reports():
            self._log_eval_report(report)

    def _next_batch(self, step: int) -> tuple[SampleBatch, float]:
        """The batch for ``step`` on every rank, and the seconds rank 0 waited for it.
        While waiting, rank 0 may stop to stream the newest version again for subscribers
        that missed it (``relay.learner.weights``): then every rank streams, and waits again."""
        waited = 0.0
        priorities = self.priorities  # sent with the first request only
        if self.rank0 is not None and step == (self.resumed_at or 0) + 1:
            self.rank0.reporter.phase(step - 1, "waiting for the first batch from the "
                                                "generators")
        while True:
            batch = None
            if self.rank0 is not None:
                batch, seconds = self.rank0.link.next_batch(
                    self.batch_size, priorities, step=step, interrupt=self._resend_due)
                waited += seconds
            priorities = {}
            batch = broadcast_batch(batch, self.group)
            if batch is not None:
                return batch, waited
            self._serve(self.published_step)

    def _resend_due(self) -> bool:
        """Rank 0: a subscriber asked for the newest version again, and the policy still is
        that version (else the next publish brings it up to date)."""
        assert self.rank0 is not None
        return (self.rank0.weights.resend_wanted() and not self.unpublished_update
                and self.version > 0)

    def _publish(self, step: int) -> None:
        """Publish the policy as the next version."""
        self.version += 1
        self.unpublished_update = False
        self._serve(step)

    def _publish_resumed(self, step: int) -> None:
        """Serve the loaded weights: as the checkpoint's version, or as a new one when the
        policy had changed since that version was published. Version 0 with no change is
        ``model.path``, which the generators load themselves."""
        if self.unpublished_update:
            self._publish(step)
        elif self.version > 0:
            self._serve(step)

    def _serve(self, step: int) -> None:
        """Tell the buffer, then stream the policy as ``self.version``, taken after ``step``
        (every rank). The buffer learns the version first: a generator that loads it quickly
        sends tokens of it at once, which a buffer still at the previous version would
        refuse as malformed (tokens from the future)."""
        self.published_step = step
        if self.rank0 is not None:
            self.rank0.weights.take_resend()
            self.rank0.link.published(self.version, step)
        with self.learner.full_policy():
            stats = publish_weights(self.learner.model, self.plan, self.publish_dtype,
                                    version=self.version, step=step,
                                    stream=self.rank0.stream if self.rank0 else None,
                                    group=self.group)
        if self.rank0 is not None and stats is not None:
            logger.debug("streamed weights version %d (%.1f MB) in %.2f s", stats.version,
                         stats.total_bytes / 1e6, stats.seconds)
            self.rank0.weights.published(self.version, step)

    def _save(self, step: int) -> None:
        """A checkpoint after ``step``, with the buffer's state at this moment."""
        rank0 = self.rank0
        save_checkpoint(self.learner, self.checkpoint_dir,
                        LoopState(step=step, version=self.version,
                                  unpublished_update=self.unpublished_update),
                        lineage=self.lineage, keep_last=self.keep_last,
                        tokenizer=rank0.tokenizer if rank0 else None,
                        buffer=rank0.buffer_state.state(step) if rank0 else None,
                        mlflow_run_id=rank0.reporter.tracker.run_id if rank0 else "",
                        group=self.group)

    def _wait_for_evaluator(self) -> None:
        """Rank 0, before streaming anything: wait (bounded) until the evaluator listens to
        the weight stream, so that every version offered to it reaches it."""
        if not self.evaluates or self.rank0 is None:
            return
        self.rank0.reporter.phase(0, "waiting for the evaluator to load its model and "
                                     "subscribe to the weight stream")
        deadline = time.monotonic() + EVALUATOR_JOIN_WAIT_S
        joined = False
        while not joined and time.monotonic() < deadline:
            self.rank0.stream.beacon()
            joined = self.rank0.weights.evaluation.wait_for_evaluator(BEACON_EVERY_S)
        if not joined:
            logger.warning("the evaluator did not ask for weights within %.0f s: training "
                           "without it; what it misses of the stream will not be evaluated "
                           "(its log is in the run directory's logs/)", EVALUATOR_JOIN_WAIT_S)

    def _offer_evaluation(self) -> None:
        """Offer the newest published version (the initial checkpoint before any) for
        evaluation, once each: on the weight stream, so that the evaluator keeps the
        version, then in the queue it asks. Rank 0 only: no collective, no copy."""
        if not self.evaluates or self.rank0 is None:
            return
        step, version = self.rank0.weights.step, self.rank0.weights.version
        if step == self.offered_step:
            return
        self.offered_step = step
        offer = EvalOffer(step=step, version=version)
        self.rank0.stream.offer(offer)
        self.rank0.weights.evaluation.offer(offer)

    def _finish_evaluation(self) -> None:
        assert self.rank0 is not None
        if not self.evaluates:
            return
        self.rank0.reporter.phase(self.trainer.total_training_steps,
                                  f"waiting for the held-out evaluation of step "
                                  f"{self.offered_step}")
        self.rank0.weights.evaluation.end(self.offered_step, on_report=self._log_eval_report)

    def _log_eval_report(self, report: EvalReport) -> None:
        assert self.rank0 is not None
        if not report.metrics:
            logger.warning("step %d (version %d) was not evaluated: the evaluator never got "
                           "its weights (see its log)", report.step, report.version)
            return
        accuracy = report.metrics.get("eval/accuracy", float("nan"))
        logger.info("step %d (version %d): held-out accuracy %.3f", report.step,
                    report.version, accuracy)
        self.accuracy = (report.step, accuracy)
        self.rank0.reporter.report(report.step, report.metrics)
        if report.generations:
            self.rank0.reporter.tracker.log_generations(report.step, report.generations)
