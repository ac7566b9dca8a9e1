"""The built-in reward rules and their data_source routing, against hand-checked cases."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

from relay.algorithms.rewards import arithmetic, boxed_math, gsm8k
from relay.algorithms.rewards.registry import (
    UnknownDataSourceError,
    check_data_sources,
    default_compute_score,
    known_data_sources,
)

GSM8K_TRAIN = Path(__file__).resolve().parents[3].parent / "shared/data/gsm8k/train.jsonl"

# --- arithmetic ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "truth", "score", "format_ok"),
    [
        ("<answer>42</answer>", "42", 1.0, 1.0),
        ("Let me add: 40 + 2.\n<answer> 42 \n</answer>", "42", 1.0, 1.0),
        ("<answer>-17</answer>", "-17", 1.0, 1.0),
        ("<answer>17</answer>", "-17", 0.0, 1.0),
        ("<answer>-17</answer>", "17", 0.0, 1.0),
        ("<answer>007</answer>", "7", 1.0, 1.0),  # parses as the integer 7
        ("<answer>43</answer>", "42", 0.0, 1.0),
        ("42", "42", 0.0, 0.0),  # no tags
        ("<answer>42", "42", 0.0, 0.0),  # never closed
        ("42</answer>", "42", 0.0, 0.0),  # never opened
        ("<answer>41</answer> no, <answer>42</answer>", "42", 0.0, 0.0),  # the answer ends it
        ("<answer>42</answer> no, <answer>41</answer>", "42", 0.0, 0.0),
        ("<answer>42</answer></answer></answer>", "42", 0.0, 0.0),  # padding after the answer
        ("<answer>42</answer>\n ", "42", 1.0, 1.0),  # whitespace after it is fine
        ("<answer>1 <answer>42</answer>", "42", 0.0, 0.0),  # span runs from the first tag
        ("<answer></answer>", "42", 0.0, 0.0),
        ("<answer>42abc</answer>", "42", 0.0, 0.0),
        ("<answer>4 2</answer>", "42", 0.0, 0.0),
        ("<answer>+42</answer>", "42", 0.0, 0.0),  # only a leading minus is allowed
        ("<answer>42.0</answer>", "42", 0.0, 0.0),
        ("<answer>--42</answer>", "-42", 0.0, 0.0),
        ("<answer>\u0664\u0662</answer>", "42", 0.0, 0.0),  # Arabic-Indic digits: int() takes them
        ("<ANSWER>42</ANSWER>", "42", 0.0, 0.0),
    ],
)
def test_arithmetic_rule(completion: str, truth: str, score: float, format_ok: float) -> None:
    assert arithmetic.compute_score(completion, truth) == {"score": score, "format_ok": format_ok}


def test_arithmetic_rejects_a_non_integer_ground_truth() -> None:
    with pytest.raises(ValueError):
        arithmetic.compute_score("<answer>1</answer>", "one")


# --- GSM8K -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "method", "answer"),
    [
        ("She sold 48 + 24 = 72 clips.\n#### 72", "strict", "72"),
        ("#### 1,234", "strict", "1234"),  # thousands separators removed (verl)
        ("#### -5", "strict", "-5"),
        ("#### 70\nwait, recount.\n#### 72", "strict", "72"),  # the last one
        ("#### 72.", "strict", "72"),  # full stop dropped (a departure from verl)
        ("The answer is 72", "strict", None),
        ("####72", "strict", None),  # verl's pattern wants one space
        ("#### " + "x" * 400, "strict", None),
        ("#### 72 " + "x" * 400, "strict", None),  # outside the last 300 chars (verl)
        ("I had 5 apples, so the answer is 72.", "flexible", "72"),
        ("Total: $1,000.", "flexible", "1000"),
        ("#### 72", "flexible", "72"),
        ("no digits here...", "flexible", None),
    ],
)
def test_gsm8k_extraction(completion: str, method: gsm8k.Method, answer: str | None) -> None:
    assert gsm8k.extract_answer(completion, method) == answer


def test_gsm8k_scores_and_format_score() -> None:
    assert gsm8k.compute_score("#### 72", "72") == {"score": 1.0, "format_ok": 1.0}
    assert gsm8k.compute_score("#### 71", "72") == {"score": 0.0, "format_ok": 1.0}
    wrong_but_formatted = gsm8k.compute_score("#### 71", "72", format_score=0.1)
    assert wrong_but_formatted == {"score": 0.1, "format_ok": 1.0}
    assert gsm8k.compute_score("72", "72", format_score=0.1) == {"score": 0.0, "format_ok": 0.0}
    assert gsm8k.compute_score("so 72", "72", method="flexible")["score"] == 1.0


def test_gsm8k_rejects_an_unknown_method() -> None:
    with pytest.raises(ValueError, match="'loose'"):
        gsm8k.extract_answer("#### 1", "loose")  # type: ignore[arg-type]


def _gsm8k_rows(count: int) -> list[tuple[str, str]]:
    """(reference solution, ground truth) as verl's gsm8k.py data preparation builds them."""
    if not GSM8K_TRAIN.is_file():
        pytest.skip(f"GSM8K data not found at {GSM8K_TRAIN} (the shared data folder)")
    rows = []
    with GSM8K_TRAIN.open() as lines:
        for line in itertools.islice(lines, count):
            solution = json.loads(line)["answer"]
            truth = re.search(r"#### (-?[0-9.,]+)", solution).group(1).replace(",", "")
            rows.append((solution, truth))
    return rows


@pytest.mark.parametrize("method", ["strict", "flexible"])
def test_gsm8k_reference_solutions_score_one_and_others_answers_zero(method: str) -> None:
    rows = _gsm8k_rows(200)
    assert len(rows) == 200
    for index, (solution, truth) in enumerate(rows):
        assert gsm8k.compute_score(solution, truth, method)["score"] == 1.0, index
        other = next(t for _, t in rows[index + 1:] + rows[:index] if t != truth)
        assert gsm8k.compute_score(solution, other, method)["score"] == 0.0, index


# --- math (Math-Verify) ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "truth", "score", "format_ok"),
    [
        ("So the answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0, 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0, 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0, 1.0),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\sqrt{2}/2", 1.0, 1.0),
        ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0, 1.0),
        ("First \\boxed{3}, no: \\boxed{4}", "4", 1.0, 1.0),  # the last box counts
        ("First \\boxed{4}, no: \\boxed{3}", "4", 0.0, 1.0),
        ("\\boxed{2}", "3", 0.0, 1.0),
        ("The answer is 1/2", "\\frac{1}{2}", 0.0, 0.0),  # no box
        ("\\boxed{\\frac{1}{2}", "\\frac{1}{2}", 0.0, 0.0),  # truncated box
    ],
)
def test_boxed_math_rule(completion: str, truth: str, score: float, format_ok: float) -> None:
    assert boxed_math.compute_score(completion, truth) == {"score": score, "format_ok": format_ok}


def test_last_boxed_balances_nested_braces() -> None:
    assert boxed_math.last_boxed("a \\boxed{x} b \\boxed{\\frac{1}{\\sqrt{2}}} c") == (
        "\\frac{1}{\\sqrt{2}}"
    )
    assert boxed_math.last_boxed("no box") is None


# --- routing ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data_source", "completion", "truth"),
    [
        ("relay/arithmetic", "<answer>7</answer>", "7"),
        ("openai/gsm8k", "#### 7", "7"),
        ("gsm8k", "#### 7", "7"),
        ("lighteval/MATH", "\\boxed{7}", "7"),
        ("HuggingFaceH4/MATH-500", "\\boxed{7}", "7"),
        ("aime2024", "\\boxed{7}", "7"),
    ],
)
def test_default_compute_score_routes_by_data_source(
    data_source: str, completion: str, truth: str
) -> None:
    assert default_compute_score(data_source, completion, truth, {})["score"] == 1.0
    # Each rule rejects the other rules' formats, so a wrong route would score 0.
    wrong = {"<answer>7</answer>": "#### 7", "#### 7": "\\boxed{7}", "\\boxed{7}": "#### 7"}
    assert default_compute_score(data_source, wrong[completion], truth, {})["score"] == 0.0


def test_gsm8k_options_reach_the_rule() -> None:
    assert default_compute_score("openai/gsm8k", "so 7", "7", gsm8k_method="flexible")[
        "score"
    ] == 1.0
    assert default_compute_score("openai/gsm8k", "#### 8", "7", gsm8k_format_score=0.1)[
        "score"
    ] == 0.1


def test_unknown_data_source_error_names_it_and_the_known_ones() -> None:
    check_data_sources(["relay/arithmetic", "openai/gsm8k", "aime2025"])
    with pytest.raises(UnknownDataSourceError) as caught:
        check_data_sources(["relay/arithmetic", "my/dataset"])
    message = str(caught.value)
    assert "'my/dataset'" in message and "custom reward function" in message
    assert all(source in message for source in known_data_sources())
    with pytest.raises(UnknownDataSourceError, match="'my/dataset'"):
        default_compute_score("my/dataset", "x", "1", {})
