"""GSM8K records to verl rows, as verl's examples/data_preprocess/gsm8k.py converts them."""

from __future__ import annotations

import pytest

from relay.algorithms.tasks import gsm8k


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("She sold 48 + 24 = <<48+24=72>>72 clips.\n#### 72", "72"),
        ("Total is 1,234,567.\n#### 1,234,567", "1234567"),
        ("He owes money.\n#### -15", "-15"),
        ("Half a pie.\n#### 0.5", "0.5"),
    ],
)
def test_extract_solution_takes_the_number_after_the_marker_without_commas(answer, expected):
    assert gsm8k.extract_solution(answer) == expected


def test_extract_solution_without_a_final_answer_is_an_error():
    with pytest.raises(ValueError, match="no final '#### <number>'"):
        gsm8k.extract_solution("The answer is 72.")


def test_verl_row_matches_verls_preprocessing():
    record = {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}
    assert gsm8k.verl_row(record, 4, split="test") == {
        "data_source": "openai/gsm8k",
        "prompt": [
            {
                "role": "user",
                "content": "What is 2 + 3? Let's think step by step and output the final answer "
                'after "####".',
            }
        ],
        "reward_model": {"style": "rule", "ground_truth": "5"},
        "extra_info": {
            "split": "test",
            "index": 4,
            "answer": "2 + 3 = 5\n#### 5",
            "question": "What is 2 + 3?",
        },
    }


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"answer": "#### 5"}, "field `question`: expected a string, got nothing"),
        ({"question": "q", "answer": 5}, "field `answer`: expected a string, got int"),
        ({"question": "q", "answer": "five"}, "field `answer`: no final"),
    ],
)
def test_verl_row_names_the_bad_field(record, message):
    with pytest.raises(ValueError, match=message):
        gsm8k.verl_row(record, 0, split="train")
