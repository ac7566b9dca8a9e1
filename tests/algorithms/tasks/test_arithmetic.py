"""The arithmetic task: problem text, target format, seeding, difficulty mix, split."""

from __future__ import annotations

import itertools

import msgspec

from relay.algorithms.rewards.arithmetic import compute_score
from relay.algorithms.tasks import arithmetic
from relay.algorithms.tasks.arithmetic import Problem
from relay.configs.prompt_data import PromptRow


def test_problem_text_answer_and_response_format():
    problem = Problem(4821, "-", 379)
    assert problem.question == "What is 4821 - 379?"
    assert problem.answer == 4442
    assert problem.response == "<answer>4442</answer>"
    assert Problem(7, "+", 95).response == "<answer>102</answer>"


def test_only_the_tagged_answer_style_earns_reward():
    problem = Problem(4821, "-", 379)
    styles = [problem.response_in(i) for i in range(len(arithmetic.ANSWER_STYLES))]
    assert styles == ["<answer>4442</answer>", "The answer is 4442.", "4442"]
    assert [compute_score(text, "4442")["score"] for text in styles] == [1.0, 0.0, 0.0]


def test_same_seed_same_problems_and_other_seed_other_problems():
    first = arithmetic.sample_problems(seed=3, count=50, split="train")
    assert first == arithmetic.sample_problems(seed=3, count=50, split="train")
    assert first != arithmetic.sample_problems(seed=4, count=50, split="train")


def test_train_and_test_problems_are_disjoint_whatever_the_seeds():
    train = set(arithmetic.sample_problems(seed=0, count=5000, split="train"))
    test = set(arithmetic.sample_problems(seed=1, count=300, split="test"))
    assert len(train) == 5000 and len(test) == 300  # sampled problems are distinct
    assert not train & test
    assert {arithmetic.split_of(p) for p in train} == {"train"}
    assert {arithmetic.split_of(p) for p in test} == {"test"}
    # The training stream, however long, never yields a test problem.
    stream = itertools.islice(arithmetic.iter_problems(seed=0, split="train"), 20000)
    assert not test & set(stream)


def test_split_sends_about_a_tenth_of_problems_to_test():
    problems = {Problem(a, "+", b) for a in range(100) for b in range(100)}
    tested = sum(arithmetic.split_of(p) == "test" for p in problems)
    assert 0.07 < tested / len(problems) < 0.13


def test_difficulty_varies_and_answers_are_never_negative():
    problems = arithmetic.sample_problems(seed=0, count=2000, split="train")
    digit_pairs = {(len(str(p.a)), len(str(p.b))) for p in problems}
    every = range(1, arithmetic.MAX_DIGITS + 1)
    assert digit_pairs == set(itertools.product(every, every))
    assert {p.op for p in problems} == {"+", "-"}
    assert min(p.answer for p in problems) >= 0
    assert all(p.a >= p.b for p in problems if p.op == "-")


def test_verl_row_is_valid_and_its_target_earns_full_reward():
    problem = Problem(56, "+", 78)
    row = msgspec.convert(arithmetic.verl_row(problem, "test", 7), PromptRow)
    assert row.data_source == "relay/arithmetic"
    assert [(m.role, m.content) for m in row.prompt] == [("user", "What is 56 + 78?")]
    assert row.reward_model.ground_truth == "134"
    assert row.extra_info == {"split": "test", "index": 7}
    assert compute_score(problem.response, row.reward_model.ground_truth)["score"] == 1.0
    assert compute_score("<answer>133</answer>", row.reward_model.ground_truth)["score"] == 0.0
