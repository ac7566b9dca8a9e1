"""generators.process: the loop's settings come from the run's sections."""

from __future__ import annotations

from configs.run_schema import RolloutConfig
from generators.process import sampling_params
from generators.sampling import SamplingParams


def test_sampling_params_come_from_the_rollout_section() -> None:
    rollout = RolloutConfig(temperature=0.7, top_p=0.9, top_k=20, response_length=64)
    assert sampling_params(rollout) == SamplingParams(max_new_tokens=64, temperature=0.7,
                                                      top_p=0.9, top_k=20)
