"""verl's GSM8K answer-check tool: its score and its reward shaping, per episode instance."""

from __future__ import annotations

import asyncio

import pytest

from relay.generators.tools.gsm8k import NO_IMPROVEMENT_PENALTY, Gsm8kTool


def submissions(answers: list[object], ground_truth: str = "72",
                **create: object) -> tuple[list[tuple], float]:
    tool = Gsm8kTool({"type": "native"}, None)

    async def episode() -> tuple[list[tuple], float]:
        instance_id, _ = await tool.create(None, **(create or {"ground_truth": ground_truth}))
        steps = [await tool.execute(instance_id, {"answer": answer}) for answer in answers]
        reward = await tool.calc_reward(instance_id)
        await tool.release(instance_id)
        return steps, reward

    return asyncio.run(episode())


def test_a_right_first_answer_scores_1_with_no_penalty() -> None:
    steps, reward = submissions(["72"])
    assert steps == [("Current parsed answer='72' reward=1.0", 0.0, {})]
    assert reward == 1.0


def test_each_submission_that_does_not_improve_costs_the_penalty() -> None:
    steps, reward = submissions(["70", "#### 71", "72", "72", "1,000"])
    assert [step[1] for step in steps] == [NO_IMPROVEMENT_PENALTY] * 2 + [0.0] + \
        [NO_IMPROVEMENT_PENALTY] * 2
    assert NO_IMPROVEMENT_PENALTY == -0.05
    assert reward == 0.0  # the last submission counts


@pytest.mark.parametrize("answer,score", [("The answer is 72.", 1.0), ("72.0", 0.0),
                                          (72, 1.0), ("seventy-two", 0.0)])
def test_the_answer_is_the_last_number_flexibly(answer: object, score: float) -> None:
    assert submissions([answer])[1] == score


def test_the_ground_truth_may_come_in_verls_create_kwargs() -> None:
    steps, reward = submissions(["1000"], create_kwargs={"ground_truth": "1000"})
    assert reward == 1.0


def test_a_missing_ground_truth_is_an_error_naming_where_it_belongs() -> None:
    with pytest.raises(ValueError, match="tools_kwargs.calc_gsm8k_reward.create_kwargs"):
        submissions(["1"], create_kwargs={})


def test_instances_of_two_episodes_are_independent() -> None:
    tool = Gsm8kTool({"type": "native"}, None)

    async def two() -> tuple[float, float]:
        a, _ = await tool.create("a", ground_truth="1")
        b, _ = await tool.create("b", ground_truth="2")
        await tool.execute(a, {"answer": "1"})
        await tool.execute(b, {"answer": "1"})
        return await tool.calc_reward(a), await tool.calc_reward(b)

    assert asyncio.run(two()) == (1.0, 0.0)
