"""The learner's training loop: batch in, update, publish, evaluate, log, repeat.

Every rank runs ``TrainLoop.run``; rank 0 additionally talks to the buffer, serves weights,
evaluates, tracks to MLflow and feeds the launcher's status line. Versions: the learner
starts at version 0 (the checkpoint the generators loaded) and publishes version v + 1
every ``trainer.publish_every`` steps, skipping a publish when the policy has not changed
since the last one (the critic's warm-up).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from buffer.dataset import PromptRow
from configs.run_schema import RunConfig
from generators.sampling import SamplingParams
from generators.torch_engine import TorchEngine
from learner.batch import TrainBatch, collate
from learner.checkpoint import save_checkpoint
from learner.evaluate import EvalResult, evaluate
from learner.rollouts import BufferLink, broadcast_batch
from learner.tracking import Tracker
from learner.update import Learner
from learner.weights import WeightServer, bucketize, gather_full_weights
from transport.messages import Metrics, SampleBatch
from transport.sockets import Pusher

logger = logging.getLogger(__name__)


class RankZero:
    """What only rank 0 holds: the buffer link, weight server, evaluator, tracker, status."""

    def __init__(self, *, link: BufferLink, weights: WeightServer, tracker: Tracker,
                 status: Pusher, eval_engine: TorchEngine, tokenizer, scorer,
                 val_rows: list[PromptRow]) -> None:
        self.link, self.weights, self.tracker, self.status = link, weights, tracker, status
        self.eval_engine, self.tokenizer, self.scorer = eval_engine, tokenizer, scorer
        self.val_rows = val_rows


def batch_metrics(batch: SampleBatch, train: TrainBatch, version: int,
                  max_staleness: int) -> dict[str, float]:
    """Rollout and staleness statistics of the batch about to be trained on."""
    rewards = train.rewards
    oldest = torch.tensor([int(s.versions.min()) for g in batch.groups for s in g.samples])
    staleness = version - oldest
    samples = [s for g in batch.groups for s in g.samples]
    metrics = {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "rollout/response_length_mean": float(train.response_lengths.float().mean()),
        "rollout/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
        "rollout/reward_error_frac": sum(bool(s.reward_error) for s in samples) / len(samples),
        "staleness/mean": float(staleness.float().mean()),
        "staleness/max": float(staleness.max()),
    }
    for k in range(max_staleness + 1):
        metrics[f"staleness/frac_{k}"] = float((staleness == k).float().mean())
    metrics.update(batch.buffer_stats)
    return metrics


class TrainLoop:
    def __init__(self, run: RunConfig, learner: Learner, *, pad_id: int, publish_dtype: torch.dtype,
                 checkpoint_dir: Path, rank0: RankZero | None,
                 group: dist.ProcessGroup | None = None) -> None:
        self.run, self.learner, self.pad_id = run, learner, pad_id
        self.publish_dtype, self.checkpoint_dir = publish_dtype, checkpoint_dir
        self.rank0, self.group = rank0, group
        self.version = 0
        self.unpublished_update = False  # the policy changed since the last publish
        self.priorities: dict[str, float] = {}  # td_error priorities for the next request

    def run_all(self) -> None:
        trainer = self.run.trainer
        if trainer.val_before_train:
            self._evaluate(step=0)
        for step in range(1, trainer.total_training_steps + 1):
            self._step(step)
            if trainer.test_freq > 0 and (step % trainer.test_freq == 0
                                          or step == trainer.total_training_steps):
                self._evaluate(step)
            if trainer.save_freq > 0 and (step % trainer.save_freq == 0
                                          or step == trainer.total_training_steps):
                save_checkpoint(self.learner, self.checkpoint_dir, step, self.version,
                                keep_last=self.run.checkpoint.keep_last,
                                tokenizer=self.rank0.tokenizer if self.rank0 else None)
        if self.rank0 is not None:
            self.rank0.link.end_run(f"trained {trainer.total_training_steps} steps")

    def _step(self, step: int) -> None:
        began = time.monotonic()
        waited = 0.0
        batch = None
        if self.rank0 is not None:
            batch, waited = self.rank0.link.next_batch(self.version, self.run.data.train_batch_size,
                                                       self.priorities)
        batch = broadcast_batch(batch, self.group)
        train = collate(batch.groups, self.pad_id, batch.weights)
        rollout = {} if self.rank0 is None else batch_metrics(batch, train, self.version,
                                                               self.run.buffer.max_staleness)
        trained_at = time.monotonic()
        result = self.learner.step(train, self.version)
        metrics = result.metrics
        train_seconds = time.monotonic() - trained_at
        if self.run.buffer.replay.priority == "td_error":
            self.priorities = {g.rollout_id: error
                               for g, error in zip(batch.groups, result.td_errors)}
        self.unpublished_update |= result.policy_updated
        if step % self.run.trainer.publish_every == 0 and self.unpublished_update:
            self._publish(step)  # not while the critic warms up: the policy is unchanged
        if self.rank0 is None:
            return
        metrics.update(rollout)
        tokens = float(train.attention_mask.sum())
        metrics.update({
            "perf/step_seconds": time.monotonic() - began,
            "perf/wait_seconds": waited,
            "perf/learner_tokens_per_s": tokens / max(train_seconds, 1e-9),
            "version": float(self.version),
        })
        metrics["perf/generator_tokens_per_s"] = batch.buffer_stats.get(
            "buffer/generator_tokens_per_s", 0.0)
        self._report(step, metrics)

    def _publish(self, step: int) -> None:
        tensors = gather_full_weights(self.learner.model, self.publish_dtype)
        self.version += 1
        self.unpublished_update = False
        if self.rank0 is not None:
            self.rank0.weights.publish(bucketize(self.version, tensors))
            self.rank0.link.published(self.version, step)

    def _evaluate(self, step: int) -> None:
        if self.rank0 is None or not self.rank0.val_rows:
            return
        r0 = self.rank0
        if r0.eval_engine.version != r0.weights.version and r0.weights.version > 0:
            latest = gather_latest(r0.weights)
            r0.eval_engine.load_weights(r0.weights.version, latest)
        val = self.run.rollout.val_kwargs
        params = SamplingParams(max_new_tokens=self.run.rollout.response_length,
                                temperature=val.temperature, top_p=val.top_p, top_k=val.top_k)
        began = time.monotonic()
        result = evaluate(r0.eval_engine, r0.tokenizer, r0.val_rows, r0.scorer, params, n=val.n,
                          max_prompt_length=self.run.data.max_prompt_length)
        metrics = eval_metrics(result)
        metrics["perf/eval_seconds"] = time.monotonic() - began
        logger.info("step %d (version %d): held-out accuracy %.3f over %d samples", step,
                    r0.eval_engine.version, result.accuracy, result.samples)
        self._report(step, metrics)

    def _report(self, step: int, metrics: dict[str, float]) -> None:
        assert self.rank0 is not None
        self.rank0.tracker.log_metrics(metrics, step)
        self.rank0.status.send(Metrics(source="learner", step=step, values=metrics,
                                       time=time.time()))


def gather_latest(weights: WeightServer) -> dict[str, torch.Tensor]:
    """The newest published version's tensors by name (rank 0's own copy)."""
    published = weights.latest
    assert published is not None, "nothing published yet"
    return {name: tensor for bucket in published.buckets
            for name, tensor in zip(bucket.names, bucket.tensors)}


def eval_metrics(result: EvalResult) -> dict[str, float]:
    metrics = {"eval/accuracy": result.accuracy, "eval/reward_mean": result.reward_mean,
               "eval/response_length_mean": result.response_length_mean}
    if len(result.by_source) > 1:
        metrics.update({f"eval/accuracy/{s}": a for s, a in result.by_source.items()})
    return metrics
