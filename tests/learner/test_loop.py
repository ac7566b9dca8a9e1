"""The training loop's own bookkeeping: the TD-error priorities it sends the buffer, the
metrics line it logs every ``trainer.log_freq`` steps (and no line per weight version), the
start-up phase it tells the launcher."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import relay.learner.loop as loop_module
from relay.buffer.prioritized import PrioritizedStore
from relay.buffer.store import PriorityError
from relay.configs.run_schema import (
    BufferConfig,
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    ReplayConfig,
    RolloutConfig,
    RunConfig,
    TrainerConfig,
)
from relay.learner.batch import collate
from relay.learner.loop import (
    RankZero,
    Reporter,
    TrainLoop,
    batch_metrics,
    finite_priorities,
    metrics_line,
)
from relay.learner.update import StepResult
from relay.learner.weights import StreamStats
from relay.transport.messages import EpisodeStats, Metrics, Prompt, SampleBatch

from ..buffer.conftest import make_group


def groups(count: int):
    return [make_group("lease", Prompt(prompt_id=f"p{i}", messages=[], data_source="test"), 2,
                       rewards=[1.0, 0.0]) for i in range(count)]


def test_non_finite_td_errors_are_left_out_and_counted() -> None:
    """A NaN or inf TD-error went to the buffer with the rest, which refuses the whole
    request (none applied), and the learner died of the refusal; now those groups are left
    out, the others are sent, and the loop reports how many were left out."""
    batch = groups(5)
    errors = [0.5, float("nan"), 2.0, float("inf"), float("-inf")]
    priorities, left_out = finite_priorities(batch, errors)
    assert priorities == {"lease/p0": 0.5, "lease/p2": 2.0}
    assert left_out == 3
    assert finite_priorities(batch[:2], [0.25, 0.0]) == ({"lease/p0": 0.25, "lease/p1": 0.0}, 0)


MULTI_TURN_KEYS = {"rollout/turns_mean", "rollout/tool_calls_mean", "rollout/tool_failure_frac",
                   "rollout/tool_latency_p95_s", "rollout/policy_token_frac"}


def test_a_single_turn_batch_has_no_multi_turn_metrics() -> None:
    batch = SampleBatch(groups=groups(2))
    metrics = batch_metrics(batch, collate(batch.groups, pad_id=0), version=0, max_staleness=1)
    assert "rollout/reward_mean" in metrics and not MULTI_TURN_KEYS & metrics.keys()


def test_multi_turn_metrics_count_turns_tool_calls_failures_latency_and_policy_tokens() -> None:
    """Four 3-token samples: two episodes with tools (one token of each inserted), one
    episode without a call, one single-turn sample (one turn, no call)."""
    batch = SampleBatch(groups=groups(2))
    first, second = batch.groups[0].samples
    first.episode = EpisodeStats(turns=3, tool_calls=2, tool_failures=1,
                                 tool_latencies_s=[0.5, 2.0])
    first.loss_mask = torch.tensor([True, False, True])
    first.logprobs[1] = 0.0
    second.episode = EpisodeStats(turns=2, tool_calls=3, tool_failures=0,
                                  tool_latencies_s=[0.1, 0.2, 0.3])
    second.loss_mask = torch.tensor([True, True, False])
    batch.groups[1].samples[0].episode = EpisodeStats()
    metrics = batch_metrics(batch, collate(batch.groups, pad_id=0), version=0, max_staleness=1)
    assert metrics["rollout/turns_mean"] == pytest.approx((3 + 2 + 1 + 1) / 4)
    assert metrics["rollout/tool_calls_mean"] == pytest.approx(5 / 4)
    assert metrics["rollout/tool_failure_frac"] == pytest.approx(1 / 5)
    latencies = torch.tensor([0.5, 2.0, 0.1, 0.2, 0.3], dtype=torch.float64)
    assert metrics["rollout/tool_latency_p95_s"] == pytest.approx(float(latencies.quantile(0.95)))
    assert 0.5 < metrics["rollout/tool_latency_p95_s"] <= 2.0
    assert metrics["rollout/policy_token_frac"] == pytest.approx(10 / 12)


def test_multi_turn_metrics_without_a_tool_call_are_zero_not_nan() -> None:
    batch = SampleBatch(groups=groups(1))
    batch.groups[0].samples[0].episode = EpisodeStats(turns=2)
    metrics = batch_metrics(batch, collate(batch.groups, pad_id=0), version=0, max_staleness=1)
    assert metrics["rollout/tool_failure_frac"] == 0.0
    assert metrics["rollout/tool_latency_p95_s"] == 0.0
    assert metrics["rollout/policy_token_frac"] == 1.0
    assert metrics["rollout/turns_mean"] == 1.5


def test_what_is_sent_is_what_the_store_accepts() -> None:
    """The store's check (``PriorityError``) and the loop's filter agree: the raw errors
    are refused whole, the filtered ones applied."""
    batch = groups(3)
    replay = PrioritizedStore(ReplayConfig(priority="td_error", max_reuse=5), max_staleness=2)
    for group in batch:
        replay.add(group)
    errors = [3.0, float("nan"), 1.0]
    with pytest.raises(PriorityError):
        replay.update_priorities(dict(zip((g.rollout_id for g in batch), errors)))
    priorities, _ = finite_priorities(batch, errors)
    replay.update_priorities(priorities)
    # p0 3, p1 kept its initial priority (the largest seen before: 1), p2 1
    assert replay.stats()["replay/priority_mean"] == pytest.approx((3.0 + 1.0 + 1.0) / 3)


class FakeLink:
    """The buffer as the loop's rank 0 sees it: a batch for every step."""

    def next_batch(self, num_groups: int, priorities=None, *, step: int, interrupt=None):
        return SampleBatch(groups=groups(num_groups),
                           buffer_stats={"buffer/generator_tokens_per_s": 900.0}), 0.01

    def published(self, version: int, step: int) -> None:
        pass


class FakeWeights:
    def __init__(self) -> None:
        self.evaluation = SimpleNamespace(take_reports=lambda: [])

    def take_resend(self) -> None:
        pass

    def resend_wanted(self) -> bool:
        return False

    def published(self, version: int, step: int) -> None:
        pass


class FakeLearner:
    """An update that changes the policy and reports verl's diagnostics."""

    def __init__(self) -> None:
        self.model = torch.nn.Linear(4, 4)
        self.device = torch.device("cpu")

    def full_policy(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def step(self, train, version: int) -> StepResult:
        return StepResult(metrics={"actor/loss": 0.25, "actor/approx_kl": 0.001,
                                   "actor/clip_frac": 0.05})


def train_loop(sent: list[Metrics], **trainer: object) -> TrainLoop:
    reporter = Reporter(SimpleNamespace(log_metrics=lambda metrics, step: None),
                        SimpleNamespace(send=sent.append))
    rank0 = RankZero(link=FakeLink(), buffer_state=None, weights=FakeWeights(),
                     stream=None, reporter=reporter, tokenizer=None)
    run = RunConfig(data=DataConfig(train_files=[], train_batch_size=2),
                    model=ModelConfig(path="unused", dtype="float32"),
                    rollout=RolloutConfig(update_weights_bucket_megabytes=1),
                    buffer=BufferConfig(max_staleness=1),
                    trainer=TrainerConfig(total_training_steps=6, **trainer),
                    checkpoint=CheckpointConfig(keep_last=1))
    return TrainLoop(run, FakeLearner(), pad_id=0, checkpoint_dir=Path("unused"), lineage=None,
                     rank0=rank0)


def test_the_loop_reads_its_knobs_from_the_run_sections() -> None:
    run = RunConfig(data=DataConfig(train_files=[], val_files=["val.jsonl"], train_batch_size=5),
                    model=ModelConfig(path="unused", dtype="bfloat16"),
                    buffer=BufferConfig(max_staleness=4, replay=ReplayConfig(priority="td_error")),
                    checkpoint=CheckpointConfig(keep_last=3))
    loop = TrainLoop(run, FakeLearner(), pad_id=0, checkpoint_dir=Path("unused"), lineage=None,
                     rank0=None)
    assert (loop.batch_size, loop.max_staleness, loop.send_td_errors, loop.evaluates,
            loop.keep_last) == (5, 4, True, True, 3)
    assert {entry.dtype for entry in loop.plan.entries} == {"bfloat16"}  # published as model.dtype


def test_the_log_has_a_metrics_line_every_log_freq_steps_and_no_line_per_version(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(loop_module, "publish_weights",
                        lambda model, plan, dtype, *, version, step, stream, group: StreamStats(
                            version=version, total_bytes=80, seconds=0.01, lagging=False))
    sent: list[Metrics] = []
    loop = train_loop(sent, log_freq=4)
    with caplog.at_level(logging.DEBUG, logger="relay.learner.loop"):
        for step in range(1, 7):
            loop._step(step)
    info = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    lines = [m for m in info if m.startswith("step ")]
    assert [m.split(" |")[0] for m in lines] == ["step 4/6", "step 6/6"]  # and the last
    for part in ("reward 0.500", "loss 0.25", "kl 0.001", "clipfrac 0.050", "learn tok/s",
                 "gen tok/s 900", "staleness 3.00"):  # version 3, samples of 0
        assert part in lines[0], lines[0]
    versions = [r for r in caplog.records if "streamed weights version" in r.getMessage()]
    assert len(versions) == 6 and {r.levelno for r in versions} == {logging.DEBUG}
    # the launcher heard what the learner waited for before its first step, then six steps
    assert sent[0].phase == "waiting for the first batch from the generators"
    assert sent[0].step == 0 and sent[0].values == {}
    assert [m.step for m in sent[1:]] == [1, 2, 3, 4, 5, 6]
    assert all(m.phase == "" for m in sent[1:])


def test_the_metrics_line_names_the_newest_held_out_accuracy() -> None:
    metrics = {"rollout/reward_mean": 0.75, "actor/loss": 0.5, "staleness/mean": 0.25}
    assert metrics_line(10, 400, metrics, (5, 0.625)) == (
        "step 10/400 | reward 0.750 | held-out acc 0.625 (step 5) | loss 0.5 | staleness 0.25")
    assert metrics_line(10, 400, {}, None) == "step 10/400"


def test_the_buffer_hears_of_a_version_before_its_weights_stream(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A generator that loads version v + 1 quickly sends tokens of it at once; a buffer
    that heard of v + 1 only after the stream refused them as tokens from the future."""
    events: list[tuple[str, int]] = []

    def stream(model, plan, dtype, *, version, step, stream, group) -> StreamStats:
        events.append(("stream", version))
        return StreamStats(version=version, total_bytes=80, seconds=0.01, lagging=False)

    monkeypatch.setattr(loop_module, "publish_weights", stream)
    loop = train_loop([])
    assert loop.rank0 is not None
    monkeypatch.setattr(loop.rank0.link, "published",
                        lambda version, step: events.append(("buffer", version)))
    for step in (1, 2):
        loop._step(step)
    assert events == [("buffer", 1), ("stream", 1), ("buffer", 2), ("stream", 2)]
