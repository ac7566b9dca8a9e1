"""verl's validation metrics (``relay.generators.val_metrics``) against hand-computed values, and
their place in an evaluation's metrics (``relay.generators.held_out``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from relay.algorithms.rewards.result import RewardResult, to_result
from relay.configs.prompt_data import ChatMessage, PromptRow, RewardSpec
from relay.generators.held_out import eval_metrics, evaluate
from relay.generators.sampling import SamplingParams
from relay.generators.val_metrics import (
    ScoredResponse,
    bootstrap,
    majority_values,
    prompt_metrics,
    subset_sizes,
    validation_metrics,
)
from relay.transport.messages import ValGeneration


class FixedDraws:
    """A stand-in random generator whose draws (one subset of indices each) are given."""

    def __init__(self, *draws: list[int]) -> None:
        self.draws = list(draws)

    def integers(self, low: int, high: int, size: tuple[int, int]) -> np.ndarray:
        assert size == (len(self.draws), len(self.draws[0]))
        assert all(low <= i < high for drawn in self.draws for i in drawn)
        return np.array(self.draws)


def test_bootstrap_mean_and_std_of_each_reducer() -> None:
    # subsets [3, 1] and [1, 1]: max 3 and 1 (mean 2, std 1), min 1 and 1 (mean 1, std 0)
    data = np.array([3.0, 1.0, 2.0])
    (best, best_std), (worst, worst_std) = bootstrap(
        3, 2, [lambda picks: data[picks].max(1), lambda picks: data[picks].min(1)],
        FixedDraws([0, 1], [1, 1]), draws=2)
    assert (best, best_std, worst, worst_std) == (2.0, 1.0, 1.0, 0.0)


def majority_value(votes: list[tuple[str, float]]) -> float:
    """``majority_values`` of one subset holding every vote once, in order."""
    answers, values = zip(*votes, strict=True)
    return float(majority_values(answers, np.array(values), np.arange(len(votes))[None])[0])


def test_majority_takes_the_most_common_answer_and_its_first_value() -> None:
    assert majority_value([("A", 0.9), ("B", 0.8), ("A", 0.7)]) == 0.9
    assert majority_value([("B", 1.0), ("A", 0.0), ("A", 0.5), ("B", 0.2)]) == 1.0  # tie: B


def test_majority_of_drawn_subsets_counts_repeated_picks() -> None:
    answers, values = ["B", "A", "A"], np.array([1.0, 0.0, 0.5])
    # picks 0 1 2: B A A -> A, first picked as item 1; 0 2 0: B A B -> B (item 0, twice);
    # 2 0 1: A B A -> A, first picked as item 2
    picks = np.array([[0, 1, 2], [0, 2, 0], [2, 0, 1]])
    assert majority_values(answers, values, picks).tolist() == [0.0, 1.0, 0.5]


def test_subset_sizes_are_powers_of_two_then_n() -> None:
    assert subset_sizes(2) == [2] and subset_sizes(5) == [2, 4, 5] and subset_sizes(8) == [2, 4, 8]


def test_one_response_has_only_mean() -> None:
    assert prompt_metrics([0.25], None) == {"mean@1": 0.25}


def test_mean_std_and_bootstrapped_best_of_a_prompt() -> None:
    metrics = prompt_metrics([1.0, 0.0], ["7", "3"])
    assert metrics["mean@2"] == 0.5 and metrics["std@2"] == 0.5
    # best of 2 draws with replacement from {1, 0}: 1 unless both draws are 0, P = 3/4
    assert metrics["best@2/mean"] == pytest.approx(0.75, abs=3 * (0.1875 / 1000) ** 0.5)
    assert metrics["best@2/std"] == pytest.approx(0.1875 ** 0.5, abs=0.03)
    assert metrics["worst@2/mean"] == pytest.approx(0.25, abs=3 * (0.1875 / 1000) ** 0.5)
    assert set(metrics) >= {"maj@2/mean", "maj@2/std"}
    assert prompt_metrics([1.0, 0.0], ["7", "3"]) == metrics  # seeded: the same numbers


def test_names_and_averages_over_prompts_follow_verl() -> None:
    responses = [ScoredResponse("src", 0, {"reward": 1.0, "acc": 1.0}, pred="4"),
                 ScoredResponse("src", 0, {"reward": 1.0, "acc": 1.0}, pred="4"),
                 ScoredResponse("src", 1, {"reward": 0.5, "acc": 0.0}, pred="9"),
                 ScoredResponse("src", 1, {"reward": 0.0, "acc": 0.0}, pred="9")]
    metrics = validation_metrics(responses)
    # acc: prompt 0 always 1, prompt 1 always 0, so every statistic of a prompt is exact
    assert metrics["val-core/src/acc/mean@2"] == 0.5
    assert metrics["val-core/src/acc/best@2/mean"] == 0.5
    assert metrics["val-core/src/acc/best@2/std"] == 0.0
    assert metrics["val-core/src/acc/maj@2/mean"] == 0.5
    assert metrics["val-aux/src/acc/std@2"] == 0.0
    assert metrics["val-aux/src/acc/worst@2/mean"] == 0.5
    # reward is not the core variable when acc is reported: (1 + 0.25) / 2
    assert metrics["val-aux/src/reward/mean@2"] == 0.625
    assert metrics["val-aux/src/reward/std@2"] == pytest.approx((0 + 0.25) / 2)
    assert not any(name.startswith("val-core/src/reward") for name in metrics)


def test_without_answers_there_is_no_majority_vote() -> None:
    metrics = validation_metrics([ScoredResponse("s", 0, {"reward": 1.0}),
                                  ScoredResponse("s", 0, {"reward": 0.0})])
    assert "val-core/s/reward/best@2/mean" in metrics
    assert not any("maj@" in name for name in metrics)


def test_a_reward_functions_pred_is_kept_for_voting() -> None:
    assert to_result({"score": 1.0, "acc": True, "pred": "42"}) == RewardResult(
        score=1.0, info={"acc": 1.0}, pred="42")


def test_an_evaluation_reports_verls_metrics_per_data_source() -> None:
    rows = [PromptRow(prompt=(ChatMessage("user", f"q{i}"),), data_source=f"src{i}",
                      reward_model=RewardSpec("rule", "x")) for i in range(2)]
    tokenizer = SimpleNamespace(apply_chat_template=lambda messages, **_: [1, 2, 3],
                                decode=lambda ids, **_: {1: "q?", 7: "right"}.get(int(ids[0]),
                                                                                 "wrong"))
    # row 0's responses: right, right; row 1's: right, wrong
    tokens = iter([7, 7, 7, 8])
    engine = SimpleNamespace(generate=lambda prompts, params: [
        SimpleNamespace(token_ids=torch.tensor([next(tokens), 2])) for _ in prompts])
    scorer = SimpleNamespace(score=lambda items: [
        RewardResult(score=float(item.solution_str == "right"), pred=item.solution_str)
        for item in items])
    result = evaluate(engine, tokenizer, rows, scorer, SamplingParams(max_new_tokens=2), n=2,
                      keep=2)
    # verl's pick from all four responses (sample_generations: 1, 3, 0, 2 of the four), the
    # second one row 1's second response
    assert result.generations == [ValGeneration(input="q?", output="right", score=1.0),
                                  ValGeneration(input="q?", output="wrong", score=0.0)]
    metrics = eval_metrics(result)
    assert metrics["val-core/src0/reward/mean@2"] == 1.0
    assert metrics["val-core/src1/reward/mean@2"] == 0.5
    assert metrics["val-aux/src1/reward/std@2"] == 0.5
    assert metrics["eval/accuracy"] == 0.75


def test_a_data_source_is_made_fit_for_a_metric_name() -> None:
    metrics = validation_metrics([ScoredResponse("math+code (v2)", 0, {"reward": 1.0})])
    assert metrics == {"val-core/math_code _v2_/reward/mean@1": 1.0}  # spaces are fine
