"""Builders shared by the buffer tests: datasets, hubs, rollout groups."""

from __future__ import annotations

import pytest
import torch

from relay.buffer.hub import Hub
from relay.buffer.prompt_source import PromptSource
from relay.buffer.rollout_log import RolloutLogWriter
from relay.buffer.store import FifoStore, ReplayStore
from relay.buffer.validation import GroupLimits
from relay.configs.prompt_data import ChatMessage, PromptDataset, PromptRow, RewardSpec
from relay.configs.run_schema import BufferConfig
from relay.transport.messages import Attach, Prompt, RolloutGroup, Sample


def make_dataset(size: int) -> PromptDataset:
    return PromptDataset([
        PromptRow(prompt=(ChatMessage(role="user", content=f"What is {i} + 1?"),),
                  data_source="relay/arithmetic",
                  reward_model=RewardSpec(style="rule", ground_truth=str(i + 1)))
        for i in range(size)])


def make_sample(version: int = 0, length: int = 3, reward: float = 1.0) -> Sample:
    return Sample(prompt_ids=torch.tensor([1, 2, 3], dtype=torch.int32),
                  response_ids=torch.arange(4, 4 + length, dtype=torch.int32),
                  logprobs=torch.full((length,), -0.5),
                  versions=torch.full((length,), version, dtype=torch.int32), reward=reward)


def make_group(lease_id: str, prompt: Prompt, n: int, version: int = 0,
               generator_id: str = "g0", rewards: list[float] | None = None) -> RolloutGroup:
    """``n`` samples of reward 1.0, or one sample per entry of ``rewards``."""
    rewards = [1.0] * n if rewards is None else rewards
    return RolloutGroup(rollout_id=f"{lease_id}/{prompt.prompt_id}", lease_id=lease_id,
                        prompt_id=prompt.prompt_id, generator_id=generator_id,
                        samples=[make_sample(version, reward=r) for r in rewards])


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


VOCAB_SIZE = 32  # token ids of the groups above stay below it
RESPONSE_LENGTH = 8
TOTAL_STEPS = 100


@pytest.fixture
def make_hub(clock: FakeClock):
    def build(*, batch_size: int = 4, n: int = 2, max_staleness: int = 0, per_lease: int = 2,
              lease_timeout_s: float = 60.0, rows: int = 100,
              store: ReplayStore | None = None, log: RolloutLogWriter | None = None,
              greedy_baseline: bool = False, min_generators: int = 0,
              steps_per_version: int = 1) -> Hub:
        config = BufferConfig(max_staleness=max_staleness, lease_timeout_s=lease_timeout_s,
                              min_generators=min_generators)
        store = FifoStore() if store is None else store
        limits = GroupLimits(n=n, vocab_size=VOCAB_SIZE, response_length=RESPONSE_LENGTH,
                             greedy_baseline=greedy_baseline)
        hub = Hub(config, PromptSource(make_dataset(rows), seed=0), store, log,
                  batch_size=batch_size, limits=limits, prompts_per_lease=per_lease,
                  total_steps=TOTAL_STEPS, steps_per_version=steps_per_version, clock=clock)
        hub.handle(Attach(generator_id="g0", engine="torch", device="cpu"))
        return hub
    return build
