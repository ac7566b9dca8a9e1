"""The hub judges every field of a rollout group before its prompt leaves the lease: a bad
group is refused with a reason that names the field, its prompt goes back to the pool and
is leased again, and nothing is stored or logged. The learner's out-of-range requests are
refused as bad_request and change nothing."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import torch

from relay.buffer.hub import Hub
from relay.buffer.main import vocab_size
from relay.buffer.rollout_log import RolloutLogWriter, read_rollout_log
from relay.configs.run_schema import BufferConfig, DataConfig, ModelConfig, RunConfig
from relay.transport.messages import (
    Ack,
    ErrorReply,
    RolloutGroup,
    Sample,
    SampleBatch,
    SampleRequest,
    VersionUpdate,
)

from .conftest import RESPONSE_LENGTH, TOTAL_STEPS, VOCAB_SIZE, make_group
from .test_hub import answer, lease


def first_sample(change: Callable[[Sample], Sample]) -> Callable[[RolloutGroup], RolloutGroup]:
    """A group edit that replaces its first sample by ``change(sample)``."""
    def edit(group: RolloutGroup) -> RolloutGroup:
        return msgspec.structs.replace(group, samples=[change(group.samples[0]),
                                                       *group.samples[1:]])
    return edit


def field(name: str, value: Callable[[torch.Tensor], torch.Tensor]):
    return first_sample(lambda s: msgspec.structs.replace(s, **{name: value(getattr(s, name))}))


def response(ids: torch.Tensor):
    """The first sample's response replaced by ``ids``, log-probs and versions to match."""
    return first_sample(lambda s: msgspec.structs.replace(
        s, response_ids=ids, logprobs=torch.full(ids.shape, -0.5),
        versions=torch.zeros(ids.shape, dtype=torch.int32)))


BAD_GROUPS = {
    "float8 log-probs": (field("logprobs", lambda t: t.to(torch.float8_e4m3fn)),
                         "logprobs is float8_e4m3fn; it must be float32"),
    "float16 log-probs": (field("logprobs", lambda t: t.half()),
                          "logprobs is float16; it must be float32"),
    "int64 response ids": (field("response_ids", lambda t: t.long()),
                           "response_ids is int64; it must be int32"),
    "float prompt ids": (field("prompt_ids", lambda t: t.float()),
                         "prompt_ids is float32; it must be int32"),
    "float versions": (field("versions", lambda t: t.float()),
                       "versions is float32; it must be int32"),
    "a token past the vocabulary": (
        field("response_ids", lambda t: torch.full_like(t, VOCAB_SIZE)),
        f"response_ids span [{VOCAB_SIZE}, {VOCAB_SIZE}], outside the model's vocabulary"),
    "a negative prompt token": (field("prompt_ids", lambda t: -t),
                                "prompt_ids span [-3, -1], outside"),
    "a response too long": (
        response(torch.ones(RESPONSE_LENGTH + 1, dtype=torch.int32)),
        f"{RESPONSE_LENGTH + 1} response tokens, more than rollout.response_length"),
    "log-probs of another length": (field("logprobs", lambda t: torch.zeros(7)),
                                    "3 response tokens but logprobs (7,)"),
    "2-D prompt ids": (field("prompt_ids", lambda t: t.reshape(1, -1)),
                       "must be non-empty 1-D tensors"),
    "an empty response": (response(torch.zeros(0, dtype=torch.int32)), "empty response"),
    "a NaN log-prob": (field("logprobs", lambda t: torch.full_like(t, float("nan"))),
                       "log-probs must be finite and <= 0"),
    "a positive log-prob": (field("logprobs", lambda t: torch.full_like(t, 0.5)),
                            "log-probs must be finite and <= 0"),
    "an infinite reward": (first_sample(lambda s: msgspec.structs.replace(s, reward=float("inf"))),
                           "reward inf is not finite"),
    "a reward past float32's range": (
        first_sample(lambda s: msgspec.structs.replace(s, reward=1e39)),
        "sample 0: reward 1e+39 is outside float32's range"),
    "a negative reward past float32's range": (
        first_sample(lambda s: msgspec.structs.replace(s, reward=-1e39)),
        "sample 0: reward -1e+39 is outside float32's range"),
    "a NaN reward entry": (
        first_sample(lambda s: msgspec.structs.replace(s, reward_info={"acc": float("nan")})),
        "reward_info acc not finite"),
    "a version from the future": (field("versions", lambda t: torch.full_like(t, 5)),
                                  "but the learner is at version 0"),
    "a float loss mask": (
        field("loss_mask", lambda _: torch.ones(3)),
        "loss_mask is float32 (3,); it must be bool (3,), one entry per response token"),
    "a loss mask of another length": (
        field("loss_mask", lambda _: torch.ones(2, dtype=torch.bool)),
        "loss_mask is bool (2,); it must be bool (3,)"),
    "a loss mask without a policy token": (
        field("loss_mask", lambda _: torch.zeros(3, dtype=torch.bool)),
        "loss_mask has no True entry"),
    "a log-prob on an inserted token": (
        field("loss_mask", lambda _: torch.tensor([True, False, True])),
        "log-prob -0.5 at response token 1 where loss_mask is False"),
    "a sample too many": (lambda g: msgspec.structs.replace(g, samples=[*g.samples,
                                                                        g.samples[0]]),
                          "3 samples, the lease asked for 2"),
}


@pytest.mark.parametrize("case", list(BAD_GROUPS))
def test_a_bad_group_is_refused_whole_and_its_prompt_is_leased_again(
        make_hub, tmp_path: Path, case: str) -> None:
    edit, reason = BAD_GROUPS[case]
    log = RolloutLogWriter(tmp_path)
    hub: Hub = make_hub(batch_size=2, n=2, per_lease=2, log=log)
    granted = lease(hub)
    ack = hub.handle(edit(make_group(granted.lease_id, granted.prompts[0], granted.n)))
    assert ack.verdict == "malformed" and reason in ack.detail, ack.detail
    assert hub.counts["rejected/malformed"] == 1 and len(hub.store) == 0 and log.records == 0
    assert hub.leases.running == 1 and hub.source.returned == 1
    assert hub.accounting_problems() == []
    again = lease(hub)
    assert [p.prompt_id for p in again.prompts] == [granted.prompts[0].prompt_id]
    assert all(a.accepted for a in answer(hub, granted)[1:] + answer(hub, again))
    assert len(hub.handle(SampleRequest(num_groups=2)).groups) == 2
    assert hub.accounting_problems() == []


def multi_turn(sample: Sample) -> Sample:
    """``sample`` as a two-turn episode: response token 1 inserted (a tool response), with
    log-prob 0 and a real version."""
    return msgspec.structs.replace(sample, loss_mask=torch.tensor([True, False, True]),
                                   logprobs=torch.tensor([-0.5, 0.0, -0.5]))


def test_a_sound_multi_turn_sample_is_stored_logged_and_served_with_its_mask(
        make_hub, tmp_path: Path) -> None:
    log = RolloutLogWriter(tmp_path)
    hub: Hub = make_hub(batch_size=2, n=2, per_lease=2, log=log)
    granted = lease(hub)
    for prompt in granted.prompts:
        assert hub.handle(first_sample(multi_turn)(
            make_group(granted.lease_id, prompt, granted.n))).accepted
    log.close()
    logged = [g.samples[0].loss_mask for g in read_rollout_log(tmp_path)]
    assert [m.tolist() for m in logged] == [[True, False, True]] * 2
    batch = hub.handle(SampleRequest(num_groups=2))
    masks = [g.samples[0].loss_mask for g in batch.groups]
    assert all(m is not None and m.tolist() == [True, False, True] for m in masks)
    assert all(g.samples[1].loss_mask is None for g in batch.groups)


def test_the_largest_float32_reward_is_trained_on_as_itself(make_hub) -> None:
    """The boundary of float32's range is sound: it stays finite in the learner's dtype,
    while 1e39 (refused above) would be inf there."""
    largest = float(torch.finfo(torch.float32).max)
    assert torch.tensor(largest, dtype=torch.float32).isfinite()
    assert torch.tensor(1e39, dtype=torch.float32).isinf()
    hub = make_hub(batch_size=2, n=2, per_lease=2)
    granted = lease(hub)
    for prompt, reward in zip(granted.prompts, (largest, -largest)):
        assert hub.handle(make_group(granted.lease_id, prompt, 2,
                                     rewards=[reward, 0.0])).accepted
    batch = hub.handle(SampleRequest(num_groups=2))
    assert sorted(g.samples[0].reward for g in batch.groups) == [-largest, largest]


def test_a_remax_baseline_past_float32s_range_is_refused(make_hub) -> None:
    hub = make_hub(batch_size=2, n=2, per_lease=2, greedy_baseline=True)
    granted = lease(hub)
    group = make_group(granted.lease_id, granted.prompts[0], 2)
    ack = hub.handle(msgspec.structs.replace(group, baseline_reward=-1e39))
    assert ack.verdict == "malformed" and "baseline_reward is -1e+39" in ack.detail, ack.detail
    assert "within float32's range" in ack.detail


def test_a_bad_group_for_someone_elses_lease_takes_nothing(make_hub) -> None:
    hub = make_hub()
    granted = lease(hub)
    bad, _ = BAD_GROUPS["float8 log-probs"]
    group = bad(make_group(granted.lease_id, granted.prompts[0], granted.n, generator_id="g1"))
    assert hub.handle(group).verdict == "unknown_lease"
    assert hub.leases.running == 2 and hub.source.returned == 0


@pytest.mark.parametrize("num_groups", [-1, 0, 5, 10**9])
def test_a_batch_request_out_of_range_is_refused(make_hub, num_groups: int) -> None:
    hub = make_hub(batch_size=4, per_lease=4)
    answer(hub, lease(hub))
    reply = hub.handle(SampleRequest(num_groups=num_groups))
    assert isinstance(reply, ErrorReply) and reply.code == "bad_request"
    assert f"num_groups = {num_groups}" in reply.detail and "1 to 4 groups" in reply.detail
    assert hub.counts["rejected/bad_request"] == 1 and len(hub.store) == 4
    assert isinstance(hub.handle(SampleRequest(num_groups=4)), SampleBatch)


@pytest.mark.parametrize("version, step, reason", [
    (10**12, 10**12, f"past trainer.total_training_steps = {TOTAL_STEPS}"),
    (10**12, 3, "publishes at most one version per step"),
    (4, 3, "publishes at most one version per step"),
    (1, 1, "goes back from version 2"),
    (2, 1, "goes back from version 2 after step 2"),
    (-1, 5, "goes back"),
])
def test_an_impossible_version_is_refused(make_hub, version: int, step: int,
                                          reason: str) -> None:
    hub = make_hub()
    assert isinstance(hub.handle(VersionUpdate(version=2, step=2)), Ack)
    reply = hub.handle(VersionUpdate(version=version, step=step))
    assert isinstance(reply, ErrorReply) and reply.code == "bad_request"
    assert reason in reply.detail, reply.detail
    assert (hub.learner_version, hub.learner_step) == (2, 2)
    assert hub.counts["rejected/bad_request"] == 1


def test_versions_may_repeat_and_steps_go_on_without_a_new_version(make_hub) -> None:
    hub = make_hub()
    for version, step in ((0, 1), (1, 2), (1, 2), (1, 5), (5, 5), (5, TOTAL_STEPS)):
        assert isinstance(hub.handle(VersionUpdate(version=version, step=step)), Ack)
    assert (hub.learner_version, hub.learner_step) == (5, TOTAL_STEPS)


def run_with_model(folder: Path, config: object, buffer_vocab: int = 0) -> RunConfig:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return RunConfig(data=DataConfig(train_files=["t.jsonl"]), model=ModelConfig(path=str(folder)),
                     buffer=BufferConfig(vocab_size=buffer_vocab))


def test_the_vocabulary_comes_from_the_model_or_the_buffer_config(tmp_path: Path) -> None:
    assert vocab_size(run_with_model(tmp_path / "a", {"vocab_size": 151936})) == 151936
    nested = {"model_type": "vl", "text_config": {"vocab_size": 32064}}
    assert vocab_size(run_with_model(tmp_path / "b", nested)) == 32064
    assert vocab_size(run_with_model(tmp_path / "c", {"hidden_size": 8}, buffer_vocab=99)) == 99
    with pytest.raises(SystemExit, match="names no vocab_size; set buffer.vocab_size"):
        vocab_size(run_with_model(tmp_path / "d", {"hidden_size": 8}))
    missing = RunConfig(data=DataConfig(train_files=["t.jsonl"]),
                        model=ModelConfig(path=str(tmp_path / "nowhere")))
    with pytest.raises(SystemExit, match="nowhere/config.json.*set buffer.vocab_size"):
        vocab_size(missing)
