"""verl's GSM8K answer-check tool (``verl.tools.gsm8k_tool.Gsm8kTool``), in Relay.

``calc_gsm8k_reward(answer)`` scores the submitted answer with Relay's GSM8K rule
(``relay.algorithms.rewards.gsm8k``, ``flexible`` extraction: the last number) and, as
verl's recipe does, shapes the step reward to discourage resubmitting::

    reward_k      = 1.0 if the k-th submission's answer == ground truth else 0.0
    step_reward_k = 0.0 if reward_k > reward_{k-1} else -0.05       (reward_0 = 0.0)

so every submission that does not improve on the last costs 0.05. ``calc_reward`` is the
last submission's reward. The instance's ground truth comes from the row's
``create_kwargs`` (``extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs.ground_truth``
in verl's data). Departure from verl: the answer is normalized by Relay's rule (``1,000``
is 1000, a trailing full stop is dropped), and a missing ground truth is an error rather
than a silent 0.
"""

from __future__ import annotations

from typing import Any

import msgspec

from relay.algorithms.rewards.gsm8k import compute_score
from relay.generators.tools.base import BaseTool, ExecuteResult
from relay.generators.tools.schema import (
    FunctionParameters,
    FunctionSchema,
    ToolResponse,
    ToolSchema,
)

NO_IMPROVEMENT_PENALTY = -0.05


class _Instance(msgspec.Struct):
    ground_truth: str
    response: str = ""
    reward: float = 0.0


class Gsm8kTool(BaseTool):
    """Checks a GSM8K answer against the episode's ground truth."""

    default_schema = ToolSchema(function=FunctionSchema(
        name="calc_gsm8k_reward",
        description="A tool for calculating the reward of gsm8k. (1.0 if parsed answer is "
                    "correct, 0.0 if parsed answer is incorrect or not correctly parsed)",
        parameters=FunctionParameters(
            properties={"answer": {"type": "string",
                                   "description": "The model's answer to the GSM8K math "
                                                  "problem, must be a digits"}},
            required=["answer"])))

    def __init__(self, config: dict[str, Any], tool_schema: ToolSchema | None) -> None:
        super().__init__(config, tool_schema)
        self._instances: dict[str, _Instance] = {}

    async def create(self, instance_id: str | None = None, ground_truth: Any = None,
                     **kwargs: Any) -> tuple[str, ToolResponse]:
        instance_id, response = await super().create(instance_id)
        if ground_truth is None:
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth")
        if ground_truth is None:
            raise ValueError(f"{self.name}: no ground_truth in create_kwargs (the row's "
                             f"extra_info.tools_kwargs.{self.name}.create_kwargs.ground_truth)")
        self._instances[instance_id] = _Instance(ground_truth=str(ground_truth))
        return instance_id, response

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> ExecuteResult:
        instance = self._instance(instance_id)
        answer = str(parameters.get("answer", ""))
        instance.response = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        step_reward = 0.0 if reward > instance.reward else NO_IMPROVEMENT_PENALTY
        instance.reward = reward
        return f"Current parsed {answer=} {reward=}", step_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        instance = self._instance(instance_id)
        return compute_score(instance.response, instance.ground_truth, method="flexible")["score"]

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)

    def _instance(self, instance_id: str) -> _Instance:
        instance = self._instances.get(instance_id)
        if instance is None:
            raise KeyError(f"{self.name}: no instance {instance_id!r} (create it first)")
        return instance
